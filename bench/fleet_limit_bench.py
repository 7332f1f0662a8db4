"""Fleet-limit acquire + release latency on Redis vs a bare INCR/DECR pair (issue #29, B3).

Both are two round trips on the same ``redis.asyncio`` client over loopback, measured in
alternating rounds of one run: ``async with fleet.acquire():`` (one EVALSHA, one ZREM, the
events hub on) vs ``await r.incr(k); await r.decr(k)``. Prints the median per-pair latency
of each round and the ratio of the medians.

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/fleet_limit_bench.py [--redis-port 6379]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as redis_asyncio

from brownout import FleetLimit


async def run(port: int, rounds: int, n: int) -> None:
    client = redis_asyncio.Redis(host="127.0.0.1", port=port)
    prefix = f"bfl-bench:{uuid.uuid4().hex[:8]}:"
    fleet = FleetLimit("bench", 1000, redis=client, prefix=prefix, timeout=1.0)
    key = prefix + "counter"

    async def bare() -> None:
        await client.incr(key)
        await client.decr(key)

    async def leased() -> None:
        async with fleet.acquire():
            pass

    async def timed(fn: object) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()  # type: ignore[operator]
        return (time.perf_counter() - t0) / n * 1e6

    await timed(bare)
    await timed(leased)  # warm-up: the script is loaded, connections are open
    bare_us: list[float] = []
    fleet_us: list[float] = []
    for _ in range(rounds):
        bare_us.append(await timed(bare))
        fleet_us.append(await timed(leased))
    b, f = statistics.median(bare_us), statistics.median(fleet_us)
    print(
        f"bare INCR+DECR       {b:8.1f} us/pair  (rounds: {', '.join(f'{x:.0f}' for x in bare_us)})"
    )
    rounds_text = ", ".join(f"{x:.0f}" for x in fleet_us)
    print(f"fleet acquire+release {f:7.1f} us/pair  (rounds: {rounds_text})")
    print(
        f"ratio {f / b:.2f}x; round trips per lease: {fleet.store.calls / ((rounds + 1) * n):.2f}"
    )  # type: ignore[attr-defined]
    await client.delete(key, *fleet.store.key_names("bench"))  # type: ignore[attr-defined]
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(run(args.redis_port, args.rounds, args.n))


if __name__ == "__main__":
    main()
