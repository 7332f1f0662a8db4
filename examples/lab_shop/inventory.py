"""The shop's dependency: an inventory service with a fixed capacity.

Eight reservations or stock reads at a time, 20 ms each (about 400 per second). Reservations
are idempotent by ``Idempotency-Key`` (brownout's server half), so a retry of a reservation
whose answer came too late is answered from the store instead of reserving twice.
``/effects`` answers the lab's ``late_success_reconciled`` check: reservations applied twice
(``duplicates``) and retries answered by replay (``replayed``).

    uvicorn examples.lab_shop.inventory:app --port 8001
"""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from brownout import EdgePolicy, Stats
from brownout.events import hub
from brownout.export.prometheus import mount_metrics, register
from brownout.idempotency import Idempotency, IdempotencyRule, InMemoryIdempotencyStore
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.asgi_idempotency import IdempotencyMiddleware

WORKERS = 8
SERVICE_SECONDS = 0.02

workers = asyncio.Semaphore(WORKERS)
applied: dict[str, int] = {}  # the side effect, by idempotency key


async def work() -> None:
    async with workers:
        await asyncio.sleep(SERVICE_SECONDS)


async def stock(request: Request) -> JSONResponse:
    await work()
    return JSONResponse({"sku": request.path_params["sku"], "available": 7})


async def reserve(request: Request) -> JSONResponse:
    body = await request.json()
    await work()
    key = request.headers["idempotency-key"]
    applied[key] = applied.get(key, 0) + 1
    return JSONResponse({"reserved": body["quantity"], "sku": body["sku"]}, status_code=201)


replayed = 0  # answers the idempotency layer gave from its store


async def effects(request: Request) -> JSONResponse:
    duplicates = sum(1 for n in applied.values() if n > 1)
    return JSONResponse({"duplicates": duplicates, "replayed": replayed, "applied": len(applied)})


def count_replays(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            global replayed
            headers = message.get("headers", []) if message["type"] == "http.response.start" else []
            if (b"idempotent-replayed", b"true") in headers:
                replayed += 1
            await send(message)

        await app(scope, receive, sending)

    return wrapped


app = Starlette(
    routes=[
        Route("/stock/{sku}", stock),
        Route("/reservations", reserve, methods=["POST"]),
        Route("/effects", effects),
    ]
)
app.add_middleware(
    IdempotencyMiddleware,
    idempotency=Idempotency(
        InMemoryIdempotencyStore(max_entries=100_000),
        operations={"/reservations": IdempotencyRule(required=True, ttl=3600)},
    ),
)
app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(metrics_paths=("/metrics", "/effects")))
app.add_middleware(count_replays)
register(hub.subscribe(Stats()))
mount_metrics(app)
