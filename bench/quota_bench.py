"""Quota decisions per second, in memory and on Redis (issue #9).

Prints, with baselines measured in the same run:
- in memory: ``Quota.check`` vs the pure ``gcra.decide`` it wraps (one hot key, 10k keys);
- on Redis: one decision (EVALSHA round trip) vs a bare ``PING`` round trip on the same
  client, sequentially (latency) and with 32 concurrent callers (throughput);
- the fail-open fallback (Redis unreachable, deciding locally between probes).

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/quota_bench.py [--redis-port 6379]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
import uuid

from brownout import EventHub, InMemoryQuotaStore, Quota, RedisQuotaStore
from brownout.quota import GcraPolicy, decide


async def per_second(check: object, keys: list[str], n: int) -> float:
    fn = check  # Quota.check bound method
    nk = len(keys)
    t0 = time.perf_counter()
    for i in range(n):
        await fn(keys[i % nk])  # type: ignore[operator]
    return n / (time.perf_counter() - t0)


def pure_per_second(n: int) -> float:
    policy = GcraPolicy(1e9, 100)
    tat: float | None = None
    t0 = time.perf_counter()
    for i in range(n):
        tat = decide(policy, tat, i * 1e-9).tat
    return n / (time.perf_counter() - t0)


async def concurrent(fn: object, key: str, n: int, workers: int) -> float:
    async def worker(k: int) -> None:
        for _ in range(k):
            await fn(key)  # type: ignore[operator]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(n // workers) for _ in range(workers)))
    return (n // workers * workers) / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(port: int, n_mem: int, n_redis: int) -> None:
    events = EventHub()
    print("in memory")
    pure = pure_per_second(n_mem)
    hot = Quota(1e9, 100, store=InMemoryQuotaStore(), events=events)
    one = await per_second(hot.check, ["caller-1"], n_mem)
    many = Quota(1e9, 100, store=InMemoryQuotaStore(max_keys=100_000), events=events)
    keys = [f"caller-{i}" for i in range(10_000)]
    spread = await per_second(many.check, keys, n_mem)
    print(f"  gcra.decide (pure)              {pure / 1e6:8.3f} M/s  ({1e6 / pure:6.2f} us)")
    print(
        f"  Quota.check, 1 key              {one / 1e6:8.3f} M/s  ({1e6 / one:6.2f} us)"
        f"  {pure / one:5.2f}x pure"
    )
    print(
        f"  Quota.check, 10k keys           {spread / 1e6:8.3f} M/s  ({1e6 / spread:6.2f} us)"
        f"  {pure / spread:5.2f}x pure"
    )

    try:
        import redis.asyncio as redis
    except ImportError:
        print("redis: not installed, skipped")
        return
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        await client.ping()
    except Exception as e:  # a benchmark reports and goes on
        print(f"redis on 127.0.0.1:{port}: not answering ({e}), skipped")
        await client.aclose()
        return
    prefix = f"bq-bench:{uuid.uuid4().hex[:8]}:"
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)
    quota = Quota(1e9, 100, store=store, events=events)
    await quota.check("warm")

    async def ping(_: str) -> None:
        await client.ping()

    print(f"redis 127.0.0.1:{port} (loopback, one client, pooled connections)")
    for _ in range(2):  # warm both paths
        await per_second(ping, ["x"], 500)
        await per_second(quota.check, ["caller-1"], 500)
    ping_s = await per_second(ping, ["x"], n_redis)
    dec_s = await per_second(quota.check, ["caller-1"], n_redis)
    print(f"  PING, sequential                {ping_s:10.0f} /s  ({1e6 / ping_s:6.1f} us)")
    print(
        f"  Quota.check, sequential         {dec_s:10.0f} /s  ({1e6 / dec_s:6.1f} us)"
        f"  {ping_s / dec_s:5.2f}x a PING round trip"
    )
    ping_c = await concurrent(ping, "x", n_redis, 32)
    dec_c = await concurrent(quota.check, "caller-1", n_redis, 32)
    print(f"  PING, 32 concurrent             {ping_c:10.0f} /s")
    print(
        f"  Quota.check, 32 concurrent      {dec_c:10.0f} /s"
        f"  {ping_c / dec_c:5.2f}x a PING round trip"
    )
    print(f"  (one EVALSHA per decision: {store.calls} store calls, {store.script_loads} EVAL)")
    await client.aclose()

    dead = redis.Redis(host="127.0.0.1", port=free_port())
    down = Quota(
        1e9,
        100,
        store=RedisQuotaStore(dead, prefix=prefix, timeout=0.05),
        expected_instances=4,
        max_probe_backoff=10.0,
        events=events,
    )
    await down.check("caller-1")  # trips to the fallback
    fb = await per_second(down.check, ["caller-1"], n_mem // 4)
    print("redis unreachable (fail-open, deciding locally between probes)")
    print(f"  Quota.check, fallback           {fb / 1e6:8.3f} M/s  ({1e6 / fb:6.2f} us)")
    await dead.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--n-memory", type=int, default=200_000)
    parser.add_argument("--n-redis", type=int, default=5_000)
    args = parser.parse_args()
    asyncio.run(main(args.redis_port, args.n_memory, args.n_redis))
