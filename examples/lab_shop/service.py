"""The shop: a FastAPI service in front of the inventory, protected by brownout.

Item pages (critical) read stock, orders (critical) reserve it with the caller's
idempotency key, recommendations (sheddable) are optional. The inventory is reached at
``INVENTORY_URL``: point it at ``brownout proxy`` to inject faults between the two.

    INVENTORY_URL=http://127.0.0.1:7001 uvicorn examples.lab_shop.service:app --port 8000
"""

from __future__ import annotations

import os
import random

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import brownout
from brownout import (
    Bulkhead,
    Dependency,
    EdgePolicy,
    ExponentialBackoff,
    InboundDeadlinePolicy,
    Priority,
    RetryBudget,
    RetryPolicy,
    Route,
    Stats,
)
from brownout.events import hub
from brownout.export.prometheus import mount_metrics, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.httpx import BrownoutTransport
from brownout.limits import Gradient2Limit

INVENTORY_URL = os.environ.get("INVENTORY_URL", "http://127.0.0.1:8001")

inventory = Dependency(
    "inventory",
    timeout=0.25,  # one attempt; the inventory answers in ~20 ms when healthy
    retry=RetryPolicy(
        3,
        budget=RetryBudget(ratio=0.1, min_per_second=5),
        backoff=ExponentialBackoff(0.02, cap=0.2, rng=random.Random()),
    ),
)
client = httpx.AsyncClient(
    base_url=INVENTORY_URL,
    transport=BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=inventory),
)

bulkhead = Bulkhead("shop", limit=Gradient2Limit())
app = FastAPI()
app.add_middleware(
    BrownoutMiddleware,
    policy=EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(default=1.0, maximum=2.0),
        routes={"/recommendations": Route(priority=Priority.SHEDDABLE)},
    ),
)
stats = hub.subscribe(Stats())
stats.watch(bulkhead)  # its queue depth, oldest wait, limit and in-flight, read at scrape time
stats.watch(inventory)  # the retry budget's tokens and the breaker's state
register(stats)
mount_metrics(app)


@app.exception_handler(brownout.UnknownOutcome)
async def unknown(request: Request, exc: brownout.UnknownOutcome) -> JSONResponse:
    # The reservation may have happened: the client retries with the same key.
    return JSONResponse({"outcome": "unknown"}, status_code=504)


@app.get("/items/{item}")
async def item(item: int) -> dict[str, object]:
    stock = (await client.get(f"/stock/sku-{item % 50}")).json()
    return {"item": item, "available": stock["available"]}


@app.post("/orders", status_code=201)
async def order(request: Request) -> dict[str, object]:
    body = await request.json()
    key = request.headers.get("idempotency-key")  # the caller's key travels on (R5)
    headers = {"idempotency-key": key} if key else {}
    reply = await client.post("/reservations", json=body, headers=headers)
    reply.raise_for_status()
    return {"order": "accepted", **reply.json()}


@app.get("/recommendations")
async def recommendations() -> dict[str, object]:
    return {"items": [1, 2, 3]}


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}
