"""The front of the lab's "slow database" scenario (issue 29, item 5).

``python -m brownout._lab.database_service --mode unprotected|brownout --dsn DSN ...`` runs a
Starlette app under uvicorn on an ephemeral loopback port and prints ``PORT <n>`` once it
listens. ``GET /api/query`` runs one query on PostgreSQL through a pool of ``--pool-size``
connections: it takes the lab's advisory lock in shared mode (the lab holds it exclusively
to make the database slow) and sleeps ``--work`` seconds.

- ``unprotected``: a plain asyncpg pool, ``pool.acquire()`` waits as long as it takes and
  the statement has no timeout: what most services ship;
- ``brownout``: `BrownoutMiddleware` (the caller's budget from ``brownout-budget-ms``, the
  handler cancelled at the deadline) and `BrownoutPool` (the pool as admission, each
  statement's timeout from the budget, the server told to cancel at the deadline).

Each query carries a SQL comment with the lab's run id and the moment its caller gives up
(``x-lab-give-up``, ``time.monotonic()`` of the lab's process: one clock per machine on
Linux), so the lab's sampler can tell, from ``pg_stat_activity``, the queries still running
for a caller who is gone. ``GET /lab/pool`` returns each connection acquisition's start and
wait (those still waiting too), for the lab's pool-wait figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

__all__ = ["GIVE_UP_HEADER", "MODES", "QUERY_TAG", "main", "parse_tag", "tagged_query"]

MODES = ("unprotected", "brownout")
QUERY_TAG = "brownout-lab-db"
"""The comment that marks the lab's queries in ``pg_stat_activity``."""
GIVE_UP_HEADER = "x-lab-give-up"
"""When the lab's client stops waiting for this request (``time.monotonic()`` seconds)."""
_WAITS_BOUND = 200_000
"""Acquisitions remembered for ``/lab/pool``: bounded, oldest forgotten first."""
_TAG = re.compile(QUERY_TAG + r" run=(\w+) give_up=([0-9.]+)")


def tagged_query(run: str, give_up: float) -> str:
    """The lab's query, tagged with its run and its caller's give-up time."""
    return (
        f"/* {QUERY_TAG} run={run} give_up={give_up:.3f} */ "
        "SELECT pg_advisory_xact_lock_shared($1::bigint)::text, pg_sleep($2::float8)::text"
    )


def parse_tag(query: str) -> tuple[str, float] | None:
    """(run, give-up time) from a query's text as ``pg_stat_activity`` shows it, or None for
    a query that is not the lab's."""
    found = _TAG.search(query)
    if found is None:
        return None
    return found.group(1), float(found.group(2))


def create_app(
    mode: str, dsn: str, pool_size: int, work: float, key: int, run: str, max_wait: float
) -> Any:
    """The front as an ASGI app (``mode``: one of `MODES`; ``max_wait``: the brownout pool's
    queue age bound)."""
    import asyncpg
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    holder: dict[str, Any] = {}
    waits: deque[tuple[float, float]] = deque(maxlen=_WAITS_BOUND)
    waiting: dict[int, float] = {}  # acquisitions under way: id -> start

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # Unique query texts (the tag): no statement cache, in both modes alike.
        pool = await asyncpg.create_pool(
            dsn, min_size=pool_size, max_size=pool_size, statement_cache_size=0
        )
        holder["pool"] = pool
        if mode == "brownout":
            from brownout.integrations.asyncpg import BrownoutPool

            holder["db"] = BrownoutPool(pool, name="lab-db", reserve=0.01, max_wait=max_wait)
        try:
            yield
        finally:
            pool.terminate()  # queries may still be waiting on the lab's lock

    def params(request: Request) -> tuple[str, int, float]:
        give_up = float(request.headers.get(GIVE_UP_HEADER, "0") or 0)
        return tagged_query(run, give_up), key, work

    async def unprotected(request: Request) -> Response:
        sql, *args = params(request)
        start = time.monotonic()
        waiting[id(request)] = start
        try:
            async with holder["pool"].acquire() as conn:
                waits.append((start, time.monotonic() - start))
                waiting.pop(id(request), None)
                await conn.execute(sql, *args)
        finally:
            if waiting.pop(id(request), None) is not None:
                waits.append((start, time.monotonic() - start))
        return PlainTextResponse("ok")

    async def protected(request: Request) -> Response:
        sql, *args = params(request)
        start = time.monotonic()
        waiting[id(request)] = start
        try:
            # Refusals (Rejected) and the deadline (DeadlineExceeded) are the edge's to answer.
            async with holder["db"].acquire() as conn:
                waits.append((start, time.monotonic() - start))
                waiting.pop(id(request), None)
                await conn.execute(sql, *args)
        finally:
            if waiting.pop(id(request), None) is not None:
                waits.append((start, time.monotonic() - start))
        return PlainTextResponse("ok")

    async def pool_waits(request: Request) -> Response:
        now = time.monotonic()
        still = [[round(s, 4), round(now - s, 4)] for s in waiting.values()]
        return JSONResponse(
            {
                "waits": [[round(s, 4), round(w, 4)] for s, w in waits],
                "still_waiting": still,
            }
        )

    middleware = []
    if mode == "brownout":
        from starlette.middleware import Middleware

        from brownout import EdgePolicy, Trust
        from brownout.integrations.asgi import BrownoutMiddleware

        # The pool is the admission: no bulkhead at the edge, only the caller's deadline.
        # Inside Starlette's error handler, so a refusal out of the handler is answered as one.
        policy = EdgePolicy(trust=Trust.TRUSTED, health_paths=("/lab/pool",))
        middleware.append(Middleware(BrownoutMiddleware, policy=policy))
    return Starlette(
        routes=[
            Route("/api/query", protected if mode == "brownout" else unprotected),
            Route("/lab/pool", pool_waits),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    app = create_app(
        args.mode, args.dsn, args.pool_size, args.work, args.lock_key, args.run, args.max_wait
    )
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="error",
        access_log=False,
        backlog=4096,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("uvicorn did not start")
        await asyncio.sleep(0.01)
    print(f"PORT {server.servers[0].sockets[0].getsockname()[1]}", flush=True)
    await task


def _exit_with_parent(parent: int) -> None:
    """Exit once ``parent`` is no longer this process's parent (no one will stop us)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m brownout._lab.database_service")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--work", type=float, default=0.1)
    parser.add_argument("--max-wait", type=float, default=0.25)
    parser.add_argument("--lock-key", type=int, required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        print(f"FAILED {type(e).__name__}: {e}", flush=True, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
