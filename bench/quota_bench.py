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
import statistics
import time
import uuid

from brownout import InMemoryQuotaStore, Quota, RedisQuotaStore
from brownout._quota import GcraPolicy, decide
from brownout.events import EventHub


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


def line(label: str, rates: list[float], base: list[float] | None, unit: str) -> None:
    """Best rate of the rounds; ratio = median per-round ratio against the baseline."""
    best = max(rates)
    text = f"  {label:32}"
    if unit == "M":
        text += f"{best / 1e6:8.3f} M/s  ({1e6 / best:6.2f} us)"
    else:
        text += f"{best:8.0f} /s  ({1e6 / best:7.1f} us)"
    if base is not None:
        ratio = statistics.median(b / r for b, r in zip(base, rates))
        text += f"  {ratio:5.2f}x baseline"
    print(text)


async def main(port: int, n_mem: int, n_redis: int, rounds: int) -> None:
    events = EventHub()
    hot = Quota(1e9, 100, store=InMemoryQuotaStore(), events=events)
    many = Quota(1e9, 100, store=InMemoryQuotaStore(max_keys=100_000), events=events)
    keys = [f"caller-{i}" for i in range(10_000)]
    pure: list[float] = []
    one: list[float] = []
    spread: list[float] = []
    for _ in range(rounds):  # interleaved, so drift on a noisy machine hits every path
        pure.append(pure_per_second(n_mem))
        one.append(await per_second(hot.check, ["caller-1"], n_mem))
        spread.append(await per_second(many.check, keys, n_mem))
    print(f"in memory (best of {rounds} interleaved rounds; baseline: pure gcra.decide)")
    line("gcra.decide (pure)", pure, None, "M")
    line("Quota.check, 1 key", one, pure, "M")
    line("Quota.check, 10k keys", spread, pure, "M")

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

    await per_second(ping, ["x"], 500)
    await per_second(quota.check, ["caller-1"], 500)
    ping_s: list[float] = []
    dec_s: list[float] = []
    ping_c: list[float] = []
    dec_c: list[float] = []
    calls_before = store.calls
    for _ in range(rounds):
        ping_s.append(await per_second(ping, ["x"], n_redis))
        dec_s.append(await per_second(quota.check, ["caller-1"], n_redis))
        ping_c.append(await concurrent(ping, "x", n_redis, 32))
        dec_c.append(await concurrent(quota.check, "caller-1", n_redis, 32))
    decisions = store.calls - calls_before
    print(f"redis 127.0.0.1:{port} (loopback; baseline: a PING round trip on the same client)")
    line("PING, sequential", ping_s, None, "")
    line("Quota.check, sequential", dec_s, ping_s, "")
    line("PING, 32 concurrent", ping_c, None, "")
    line("Quota.check, 32 concurrent", dec_c, ping_c, "")
    print(f"  ({decisions} decisions, {decisions} EVALSHA round trips, {store.script_loads} EVAL)")
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
    fb = [await per_second(down.check, ["caller-1"], n_mem // 4) for _ in range(rounds)]
    print("redis unreachable (fail-open, deciding locally between probes)")
    line("Quota.check, fallback", fb, pure, "M")
    await dead.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--n-memory", type=int, default=100_000)
    parser.add_argument("--n-redis", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.redis_port, args.n_memory, args.n_redis, args.rounds))
