"""Per-query overhead of the database adapters in instructions, not seconds.

Wall-clock ratios (`bench/db_bench.py`, `bench/db_drivers_bench.py`) move by up to 2x between
runs on a shared 2-core machine. ``valgrind --tool=callgrind`` counts the instructions this
process executes for the same queries instead (the server's work and the loopback wait are
not in them): each side runs twice under callgrind, with 0 and with N queries after the same
warm-up, so start-up and import costs cancel. Prints instructions per query for the bare
driver and through the adapter, and their ratio. Instructions are not time (a wait on the
server costs time, not instructions): this is the client's share, reported beside the
wall-clock figures, not instead of them. Needs PostgreSQL (``BROWNOUT_TEST_POSTGRES``,
default 127.0.0.1:5432, database ``test``).

    .venv/bin/python bench/db_instructions.py            # asyncpg and psycopg
    .venv/bin/python bench/db_instructions.py asyncpg    # or: psycopg, sqlalchemy+asyncpg,
                                                         #     sqlalchemy+psycopg
    .venv/bin/python bench/db_instructions.py --profile asyncpg   # cProfile of the adapter
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

N = 2_000
WARM_UP = 300
KINDS = ("asyncpg", "psycopg", "sqlalchemy+asyncpg", "sqlalchemy+psycopg")


def _dsn() -> str:
    address = os.environ.get("BROWNOUT_TEST_POSTGRES", "127.0.0.1:5432")
    return f"postgresql://postgres@{address}/test"


async def _queries(kind: str, wrapped: bool) -> tuple[Callable[[], Awaitable[object]], Any]:
    """One query of ``kind`` (bare or through the adapter) and what to close afterwards."""
    if kind == "asyncpg":
        import asyncpg

        from brownout.integrations.asyncpg import BrownoutPool

        pool = await asyncpg.create_pool(_dsn(), min_size=1, max_size=1)
        if wrapped:
            db = BrownoutPool(pool, name="bench-db", reserve=0.02)
            return (lambda: db.fetchval("SELECT 1")), pool.close
        return (lambda: pool.fetchval("SELECT 1")), pool.close
    if kind == "psycopg":
        import psycopg_pool

        from brownout.integrations.psycopg import BrownoutPsycopgPool

        raw_pool: Any = psycopg_pool.AsyncConnectionPool(_dsn(), min_size=1, max_size=1, open=False)
        await raw_pool.open()
        if wrapped:
            ours = BrownoutPsycopgPool(raw_pool, name="bench-db")

            async def our_query() -> object:
                async with ours.connection() as c:
                    return await c.fetchone("SELECT 1")

            return our_query, raw_pool.close

        async def bare_query() -> object:
            async with raw_pool.connection() as c:
                return await (await c.execute("SELECT 1")).fetchone()

        return bare_query, raw_pool.close
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from brownout.integrations import sqlalchemy as bsa

    driver = kind.split("+")[1]
    url = _dsn().replace("postgresql://", f"postgresql+{driver}://")
    engine = create_async_engine(url, pool_size=1, max_overflow=0)
    if wrapped:
        bsa.protect(engine, name="bench-db")
    one = text("SELECT 1")

    async def select() -> object:
        async with engine.connect() as c:
            return (await c.execute(one)).scalar()

    return select, engine.dispose


async def _run(kind: str, wrapped: bool, n: int) -> None:
    import brownout

    query, close = await _queries(kind, wrapped)
    try:
        # Both sides inside a request with a deadline: the adapter takes its whole path.
        async with brownout.request(deadline=600.0):
            for _ in range(WARM_UP):
                await query()
            for _ in range(n):
                await query()
    finally:
        await close()


def _instructions(kind: str, variant: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                kind,
                variant,
                str(n),
            ],
            capture_output=True,
            text=True,
            check=True,
            # str hashes are salted per process: fix the salt so dicts and sets do the same
            # work in every run
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def _profile(kind: str) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(_run(kind, True, N))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(40)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        asyncio.run(_run(args[1], args[2] == "adapter", int(args[3])))
        return
    if args[:1] == ["--profile"]:
        _profile(args[1] if len(args) > 1 else "asyncpg")
        return
    kinds = args or ["asyncpg", "psycopg"]
    for kind in kinds:
        if kind not in KINDS:
            sys.exit(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    for kind in kinds:
        per = {
            variant: (_instructions(kind, variant, N) - _instructions(kind, variant, 0)) / N
            for variant in ("bare", "adapter")
        }
        bare, ours = per["bare"], per["adapter"]
        print(
            f"{kind:20s} SELECT 1 over loopback, {N:,} queries under callgrind: "
            f"bare {bare:,.0f} instructions/query, adapter {ours:,.0f} "
            f"(+{ours - bare:,.0f}): {ours / bare:.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
