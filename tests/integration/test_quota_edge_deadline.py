"""The edge's quota step runs under the request's deadline (issue 24): a stalled shared store
takes at most half of what the request has left, behind a real ASGI server."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.integration.servers import serve

import brownout
from brownout import EdgePolicy, Quota, RedisQuotaStore, Trust
from brownout.events import EventHub
from brownout.integrations.asgi import BrownoutMiddleware

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = pytest.mark.integration


async def test_a_stalled_store_answers_a_40ms_request_well_before_its_deadline() -> None:
    """A store that accepts and never answers, with a 500 ms timeout: a request with a 40 ms
    budget gets the fail-open decision with time to spare and is served. Was: the quota
    step ran before the request's deadline was set, waited the store's whole 500 ms, and
    the request was answered 504 after half a second."""

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answer
        writer.close()

    stalled = await asyncio.start_server(stall, "127.0.0.1", 0)
    port = stalled.sockets[0].getsockname()[1]
    client = redis_asyncio.Redis(host="127.0.0.1", port=port, retry=None)
    events = EventHub()
    quota = Quota(
        100.0,
        20,
        store=RedisQuotaStore(client, prefix="edge-deadline:", timeout=0.5),
        on_store_failure="open",
        events=events,
    )
    left: list[float | None] = []

    async def handler(request: Request) -> JSONResponse:
        left.append(brownout.remaining())
        return JSONResponse({"ok": True})

    policy = EdgePolicy(
        quota=quota.for_edge(key=lambda c: c.operation, per_caller=False),
        trust=Trust.TRUSTED,
        events=events,
    )
    app = Starlette(
        routes=[Route("/work", handler)],
        middleware=[Middleware(BrownoutMiddleware, policy=policy)],
    )
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as http:
            # The first request: the quota has not seen the store fail yet (after a store
            # timeout it decides locally, without asking the store, until a probe).
            t0 = time.monotonic()
            r = await http.get("/work", headers={"brownout-budget-ms": "40"})
            took = time.monotonic() - t0
    finally:
        await client.aclose()
        stalled.close()
    assert r.status_code == 200, (r.status_code, took)
    assert took < 0.25, took  # nowhere near the store's 500 ms
    # The check took at most half of the 40 ms: the handler starts with time left.
    assert len(left) == 1 and left[0] is not None and left[0] > 0.005, left
