"""The processes of the payments chain (issue 27, item 5): a front and a payment service.

``python -m brownout._lab.payments_service ROLE --mode brownout|naive ...`` runs one under
uvicorn on an ephemeral loopback port and prints ``PORT <n>`` once it listens. Used by the
lab's ``payments`` scenario and by ``tests/integration/test_idempotency_system.py``.

- ``payment``: ``POST /payments`` inserts one row into ``--table`` on PostgreSQL. With
  ``--mode brownout`` the edge (`BrownoutMiddleware`) and the idempotency layer on
  `PostgresIdempotencyStore` run it: the row and the stored answer commit in one transaction.
  With ``--mode naive`` every request inserts. A request carrying ``x-slow-after-commit:
  SECONDS`` gets its answer that much later, after the commit, the first time its order is
  applied (a replay is never slowed). ``GET /payments/{key}`` counts the rows applied under a
  key (as the payment service sees it: bound to its caller, the front).
- ``front``: ``POST /checkout`` calls the payment service and relays its answer. With
  ``--mode brownout`` it runs behind `BrownoutMiddleware` and calls through
  `BrownoutTransport`, so the caller's deadline, attempt number and (bound) idempotency key
  travel on; ``naive`` forwards nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

__all__ = ["FRONT_CALLER", "main"]

FRONT_CALLER = "front"
"""The caller the front names itself to the payment service (``x-caller``)."""
SLOW_HEADER = "x-slow-after-commit"
_DELAY_HEADER = b"x-delay-send"
_SEEN_BOUND = 100_000
"""Orders remembered as already slowed once: bounded, oldest forgotten first."""


def _caller(scope: Any, cls: Any) -> Any:
    for k, v in scope["headers"]:
        if k == b"x-caller":
            return cls._replace(caller=v.decode("latin-1"))
    return cls


def _edge_policy() -> Any:
    from brownout import EdgePolicy, Trust

    # Loopback callers of the lab are trusted: the attempt number is honoured.
    return EdgePolicy(trust=Trust.TRUSTED, classifier=_caller)


class _SlowAfterCommit:
    """Outermost ASGI wrapper: holds back an answer the handler marked until the app inside
    (edge, idempotency layer, commit) has finished, then sends it; a replay is never held."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        delay: float | None = None
        held: list[Any] = []

        async def hold(message: Any) -> None:
            nonlocal delay
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                names = {k.lower(): v for k, v in headers}
                marked = names.get(_DELAY_HEADER)
                if marked is not None and b"idempotent-replayed" not in names:
                    delay = float(marked)
                message = dict(
                    message, headers=[(k, v) for k, v in headers if k.lower() != _DELAY_HEADER]
                )
            if delay is None:
                await send(message)
            else:
                held.append(message)

        await self.app(scope, receive, hold)
        if delay is not None:
            # Outside the edge's deadline: the answer comes late, it is not cut off.
            await asyncio.sleep(delay)
            for message in held:
                await send(message)


async def _payment_app(args: argparse.Namespace) -> tuple[Any, Any]:
    import asyncpg
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    import brownout
    from brownout.idempotency import (
        Idempotency,
        IdempotencyRule,
        PostgresIdempotencyStore,
        transaction,
    )
    from brownout.integrations.asgi import BrownoutMiddleware
    from brownout.integrations.asgi_idempotency import IdempotencyMiddleware

    pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=args.pool)
    table = args.table
    await pool.execute(
        f"CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, order_id text NOT NULL,"
        " idem_key text, amount int NOT NULL)"
    )
    seen: OrderedDict[str, None] = OrderedDict()
    brownout_mode = args.mode == "brownout"

    async def pay(request: Request) -> Response:
        body = await request.json()
        order, amount = str(body["order"]), int(body["amount"])
        key = brownout.current().idempotency_key if brownout_mode else None
        insert = (
            f"INSERT INTO {table} (order_id, idem_key, amount) VALUES ($1, $2, $3) RETURNING id"
        )
        if brownout_mode:  # the row commits with the stored answer
            row_id = await transaction().fetchval(insert, order, key, amount)
        else:
            row_id = await pool.fetchval(insert, order, key, amount)
        headers = {}
        slow = request.headers.get(SLOW_HEADER)
        if slow is not None and order not in seen:
            seen[order] = None
            if len(seen) > _SEEN_BOUND:
                seen.popitem(last=False)
            headers[_DELAY_HEADER.decode()] = slow
        return JSONResponse(
            {"payment": row_id, "order": order, "amount": amount}, status_code=201, headers=headers
        )

    async def applied(request: Request) -> Response:
        n = await pool.fetchval(
            f"SELECT count(*) FROM {table} WHERE idem_key = $1", request.path_params["key"]
        )
        return JSONResponse({"applied": int(n)})

    app: Any = Starlette(
        routes=[
            Route("/payments", pay, methods=["POST"]),
            Route("/payments/{key}", applied, methods=["GET"]),
        ]
    )
    if brownout_mode:
        store = PostgresIdempotencyStore(pool, table=f"{table}_idem")
        await store.setup()
        idem = Idempotency(
            store, operations={"/payments": IdempotencyRule(required=True, ttl=3600)}
        )
        app = BrownoutMiddleware(IdempotencyMiddleware(app, idem), policy=_edge_policy())
    return _SlowAfterCommit(app), pool.close


async def _front_app(args: argparse.Namespace) -> tuple[Any, Any]:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from brownout import UnknownOutcome
    from brownout.integrations.asgi import BrownoutMiddleware
    from brownout.integrations.httpx import BrownoutTransport

    brownout_mode = args.mode == "brownout"
    inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=200))
    outbound = httpx.AsyncClient(
        base_url=args.payment_url,
        transport=BrownoutTransport(inner) if brownout_mode else inner,
        headers={"x-caller": FRONT_CALLER},
        timeout=30.0,
    )
    relayed = ("content-type", "idempotent-replayed", "retry-after")

    async def checkout(request: Request) -> Response:
        headers = {}
        slow = request.headers.get(SLOW_HEADER)
        if slow is not None:
            headers[SLOW_HEADER] = slow
        try:
            r = await outbound.post("/payments", content=await request.body(), headers=headers)
        except httpx.HTTPError as e:
            return Response(f"payment service: {type(e).__name__}", status_code=502)
        except UnknownOutcome:  # cut off at the caller's deadline: the caller has gone
            return Response("payment outcome unknown", status_code=504)
        return Response(
            r.content,
            status_code=r.status_code,
            headers={k: r.headers[k] for k in relayed if k in r.headers},
        )

    app: Any = Starlette(routes=[Route("/checkout", checkout, methods=["POST"])])
    if brownout_mode:
        app = BrownoutMiddleware(app, policy=_edge_policy())
    return app, outbound.aclose


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    build = _payment_app if args.role == "payment" else _front_app
    app, close = await build(args)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="error", lifespan="off", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("uvicorn did not start")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)

    try:
        await task
    finally:
        await close()


def _exit_with_parent(parent: int) -> None:
    """Exit once ``parent`` is no longer this process's parent (no one will stop us)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m brownout._lab.payments_service")
    p.add_argument("role", choices=("payment", "front"))
    p.add_argument("--mode", choices=("brownout", "naive"), default="brownout")
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--table", default="lab_payments")
    p.add_argument("--pool", type=int, default=20)
    p.add_argument("--payment-url", default="")
    p.add_argument("--parent-pid", type=int, default=os.getppid())
    args = p.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    if not args.table.isidentifier():
        p.error(f"--table {args.table!r}: letters, digits and _ only")
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
