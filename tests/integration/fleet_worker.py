"""One process of the fleet-limit crash test: N tasks acquiring, working, releasing.

Each task writes ``S token start end_bound`` when it starts acting under a lease and
``E token end`` when it stops. ``start`` is read before the lease's check, which passes only
while ``start`` is before the lease's local expiry; ``end_bound`` is that expiry, the latest
its action can last if the process is killed meanwhile.

Run as ``python -m tests.integration.fleet_worker PORT PREFIX LIMIT TASKS LEASE OUT``.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import redis.asyncio as redis_asyncio

from brownout import FleetLimit, Rejected


async def main(port: int, prefix: str, limit: int, tasks: int, lease: float, out: str) -> None:
    client = redis_asyncio.Redis(host="127.0.0.1", port=port, max_connections=64)
    fleet = FleetLimit(
        "crash",
        limit,
        redis=client,
        prefix=prefix,
        lease=lease,
        timeout=2.0,
        on_store_failure="closed",
    )
    # Line-buffered: each line reaches the file before the next, so a SIGKILL loses none.
    sink = open(out, "a", buffering=1)  # noqa: SIM115, ASYNC230

    async def task() -> None:
        rng = random.Random()
        while True:
            try:
                async with fleet.acquire() as held:
                    start = time.monotonic()
                    if start >= held.expires_at:
                        continue  # as lease.check() would refuse: never act on it
                    held.check()
                    sink.write(f"S {held.token} {start!r} {held.expires_at!r}\n")
                    work = rng.uniform(0.001, 0.03) if rng.random() < 0.97 else lease * 2
                    # Never act past the lease: stop at its local expiry at the latest.
                    await asyncio.sleep(min(work, max(0.0, held.remaining)))
                    sink.write(f"E {held.token} {min(time.monotonic(), held.expires_at)!r}\n")
            except Rejected:
                await asyncio.sleep(rng.uniform(0.1, 0.5))  # a refused caller backs off

    await asyncio.gather(*(task() for _ in range(tasks)))


if __name__ == "__main__":
    port, prefix, limit, tasks, lease, out = sys.argv[1:]
    asyncio.run(main(int(port), prefix, int(limit), int(tasks), float(lease), out))
