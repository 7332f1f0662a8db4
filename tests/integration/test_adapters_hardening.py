"""Issue 24, the adapters: what every server adapter must do the same way, over loopback.

- Long-lived connections (ASGI websocket scopes, aiohttp websocket upgrades) go through the
  edge: admitted at connect, refused with 503 while full, no request deadline on their
  lifetime; ``lifespan`` scopes still pass through.
- A client that leaves is noticed even when the handler never reads the request body.
- A handler that ignores its cancellation does not answer late: the edge answers 504 at the
  deadline, counts the overrun and keeps the slot until the handler really returns.
- A grpc.aio refusal has the same status and trailers for every RPC shape.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import grpc
import grpc.aio
import httpx
import pytest
from aiohttp import web
from tests.integration.servers import serve, serve_aiohttp, serve_grpc

from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Stats
from brownout.events import EventHub
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


def _hub() -> tuple[EventHub, Stats, list[Any]]:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    seen: list[Any] = []

    class Keep:
        def emit(self, event: Any) -> None:
            seen.append(event)

    hub.subscribe(Keep())
    return hub, stats, seen


def _one_slot(hub: EventHub) -> Bulkhead:
    return Bulkhead("api", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.05), events=hub)


# -- 3. a client that leaves while its body is unread ---------------------------------------


async def test_asgi_disconnect_noticed_while_the_body_is_unread() -> None:
    hub, stats, _ = _hub()
    cancelled: list[float] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        started = time.monotonic()
        try:
            await asyncio.sleep(2.0)  # never reads its body
        except asyncio.CancelledError:
            cancelled.append(time.monotonic() - started)
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), events=hub),
        deadline=InboundDeadlinePolicy(default=2.0, maximum=2.0),
        events=hub,
        sweep_period=0.02,
    )
    async with serve(BrownoutMiddleware(app, policy=policy)) as base:
        host, port = base.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await writer.wait_closed()
        for _ in range(300):
            if cancelled:
                break
            await asyncio.sleep(0.01)
    assert cancelled and cancelled[0] < 1.0, cancelled
    assert stats.count("abandoned") == 1


# -- 4. a handler that ignores its cancellation ---------------------------------------------


async def _stubborn() -> None:
    """Sleep 2 s whatever happens (swallows every cancellation)."""
    end = time.monotonic() + 2.0
    while (left := end - time.monotonic()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            continue


def _overran(seen: list[Any]) -> list[Any]:
    return [e for e in seen if type(e).__name__ == "HandlerOverran"]


async def test_asgi_stubborn_handler_gets_504_at_the_deadline() -> None:
    hub, stats, seen = _hub()
    bulkhead = Bulkhead("api", FixedLimit(4), events=hub)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await _stubborn()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})

    policy = EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(default=0.5, maximum=0.5),
        events=hub,
    )
    async with serve(BrownoutMiddleware(app, policy=policy)) as base:
        async with httpx.AsyncClient(base_url=base) as client:
            t0 = time.monotonic()
            r = await client.get("/x")
            took = time.monotonic() - t0
            assert r.status_code == 504, (r.status_code, took)
            assert took < 1.0
            assert bulkhead.in_flight == 1  # the zombie still holds its slot
            for _ in range(300):
                if bulkhead.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert bulkhead.in_flight == 0
    assert len(_overran(seen)) == 1
    assert stats.count("overran") == 1


async def test_aiohttp_stubborn_handler_gets_504_at_the_deadline() -> None:
    hub, _stats, seen = _hub()
    bulkhead = Bulkhead("api", FixedLimit(4), events=hub)

    async def handler(request: web.Request) -> web.Response:
        await _stubborn()
        return web.Response(text="late")

    policy = EdgePolicy(
        bulkhead=bulkhead, deadline=InboundDeadlinePolicy(default=0.5, maximum=0.5), events=hub
    )
    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/x", handler)
    async with serve_aiohttp(app) as base, aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        async with session.get(base + "/x") as r:
            status = r.status
        took = time.monotonic() - t0
        assert status == 504, (status, took)
        assert took < 1.0
        assert bulkhead.in_flight == 1
        for _ in range(300):
            if bulkhead.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert bulkhead.in_flight == 0
    assert len(_overran(seen)) == 1


def _raw(b: bytes) -> bytes:
    return b


async def test_grpc_stubborn_handler_gets_deadline_exceeded_at_the_deadline() -> None:
    hub, _stats, seen = _hub()
    bulkhead = Bulkhead("rpc", FixedLimit(4), events=hub)

    async def run(request: bytes, context: Any) -> bytes:
        await _stubborn()
        return b"late"

    policy = EdgePolicy(
        bulkhead=bulkhead, deadline=InboundDeadlinePolicy(default=0.5, maximum=0.5), events=hub
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "demo.S",
                {
                    "Run": grpc.unary_unary_rpc_method_handler(
                        run, request_deserializer=_raw, response_serializer=_raw
                    )
                },
            ),
        )
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await channel.unary_unary("/demo.S/Run")(b"", timeout=5)
        took = time.monotonic() - t0
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, (e.value, took)
        assert took < 1.0
        assert bulkhead.in_flight == 1
        for _ in range(300):
            if bulkhead.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert bulkhead.in_flight == 0
    assert len(_overran(seen)) == 1
