"""Per-query cost of `BrownoutPool` vs the bare asyncpg pool on ``SELECT 1`` over loopback.

Both run the pool's shortcut (``fetchval``: acquire, query, release) on one asyncpg pool;
both inside a request context with a deadline, so the brownout side takes its whole path
(statement budget, admission, asyncpg's timeout). Rounds are interleaved and each figure is
the best round, so a noisy shared machine inflates both sides alike. Prints microseconds
per query and the
ratio (target <= 1.10x). Needs PostgreSQL (``BROWNOUT_TEST_POSTGRES``, default
127.0.0.1:5432, database ``test``). Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/db_bench.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

import asyncpg

import brownout
from brownout.integrations.asyncpg import BrownoutPool

ROUNDS = 7
QUERIES = 2_000
CONCURRENCY = 4


async def timed(query: Callable[[], Awaitable[object]], n: int) -> float:
    """Microseconds per query, ``n`` queries from `CONCURRENCY` tasks, each task inside one
    request with a deadline (both sides: the pool's cost is measured, not the scope's)."""

    async def worker(count: int) -> None:
        async with brownout.request(deadline=60.0):
            for _ in range(count):
                await query()

    start = time.perf_counter()
    await asyncio.gather(*(worker(n // CONCURRENCY) for _ in range(CONCURRENCY)))
    return (time.perf_counter() - start) / n * 1e6


async def main() -> int:
    address = os.environ.get("BROWNOUT_TEST_POSTGRES", "127.0.0.1:5432")
    pool = await asyncpg.create_pool(
        f"postgresql://postgres@{address}/test", min_size=CONCURRENCY, max_size=CONCURRENCY
    )
    db = BrownoutPool(pool, name="bench-db", reserve=0.02)
    try:
        bare: list[float] = []
        wrapped: list[float] = []
        await timed(lambda: pool.fetchval("SELECT 1"), 400)  # warm both
        await timed(lambda: db.fetchval("SELECT 1"), 400)
        for _ in range(ROUNDS):
            bare.append(await timed(lambda: pool.fetchval("SELECT 1"), QUERIES))
            wrapped.append(await timed(lambda: db.fetchval("SELECT 1"), QUERIES))
    finally:
        await pool.close()
    b, w = min(bare), min(wrapped)
    print(f"bare asyncpg pool   : {b:8.1f} us/query (best of {ROUNDS})")
    print(f"BrownoutPool        : {w:8.1f} us/query (best of {ROUNDS})")
    print(f"ratio               : {w / b:8.3f}x (target <= 1.10x)")
    return 0 if w / b <= 1.10 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
