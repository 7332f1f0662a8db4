"""Per-query overhead of the psycopg and SQLAlchemy adapters vs the bare driver (issue #29).

Each pair runs ``SELECT 1`` on a pool of one connection over loopback, checkout included,
inside a request scope with a deadline (so the budget is computed and armed), in
alternating rounds of one run:

- psycopg: ``async with pool.connection() as c: await c.execute(...)`` vs the same through
  ``BrownoutPsycopgPool.connection()``;
- SQLAlchemy on asyncpg and on psycopg: ``async with engine.connect() as c: await
  c.execute(text(...))`` on a bare engine vs a `protect`-ed one.

Prints the median per-query latency of each round and the ratio of the medians.

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/db_drivers_bench.py [--pg-port 5432]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import psycopg_pool
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

import brownout
from brownout.integrations import sqlalchemy as bsa
from brownout.integrations.psycopg import BrownoutPsycopgPool

Query = Callable[[], Awaitable[object]]


async def timed(fn: Query, n: int) -> float:
    async with brownout.request(deadline=60.0):
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        return (time.perf_counter() - t0) / n


async def compare(name: str, bare: Query, wrapped: Query, rounds: int, n: int) -> float:
    for fn in (bare, wrapped):  # warm both: connections open, statements prepared
        await timed(fn, 200)
    base: list[float] = []
    ours: list[float] = []
    for _ in range(rounds):
        base.append(await timed(bare, n))
        ours.append(await timed(wrapped, n))
    b, o = statistics.median(base), statistics.median(ours)
    print(f"{name:22s} bare {b * 1e6:7.1f} us  adapter {o * 1e6:7.1f} us  ratio {o / b:.3f}")
    return o / b


async def run(port: int, rounds: int, n: int) -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{port}/test"
    async with (
        psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as bare_pool,
        psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as our_pool,
    ):
        db = BrownoutPsycopgPool(our_pool, name="bench-db")

        async def bare_psycopg() -> object:
            async with bare_pool.connection() as c:
                return await (await c.execute("SELECT 1")).fetchone()

        async def our_psycopg() -> object:
            async with db.connection() as c:
                return await c.fetchone("SELECT 1")

        await compare("psycopg", bare_psycopg, our_psycopg, rounds, n)

    for driver in ("asyncpg", "psycopg"):
        url = f"postgresql+{driver}://postgres@127.0.0.1:{port}/test"
        bare_engine = create_async_engine(url, pool_size=1, max_overflow=0)
        our_engine = bsa.protect(
            create_async_engine(url, pool_size=1, max_overflow=0), name="bench-db"
        )

        def select(engine: object, one: object = text("SELECT 1")) -> Query:
            async def go() -> object:
                async with engine.connect() as c:  # type: ignore[attr-defined]
                    return (await c.execute(one)).scalar()

            return go

        await compare(f"sqlalchemy+{driver}", select(bare_engine), select(our_engine), rounds, n)
        await bare_engine.dispose()
        await our_engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pg-port", type=int, default=5432)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--n", type=int, default=250)
    args = parser.parse_args()
    asyncio.run(run(args.pg_port, args.rounds, args.n))


if __name__ == "__main__":
    main()
