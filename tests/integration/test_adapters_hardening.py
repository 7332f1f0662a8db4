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
from collections.abc import AsyncIterator
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


# -- 2. long-lived connections --------------------------------------------------------------


def _asgi_ws_app(bulkhead: Bulkhead, hub: EventHub, **policy: Any) -> Any:
    """A bare ASGI app: ``/slow`` holds a slot, ``/ws`` echoes, and lifespan is noted."""
    lifespan: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            msg = await receive()
            lifespan.append(msg["type"])
            await send({"type": "lifespan.startup.complete"})
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    return
                await send({"type": "websocket.send", "text": msg.get("text") or ""})
        await asyncio.sleep(1.0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    edge = EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(default=0.3, maximum=0.3),
        events=hub,
        sweep_period=0.02,
        **policy,
    )
    wrapped = BrownoutMiddleware(app, policy=edge)
    wrapped.lifespan = lifespan  # type: ignore[attr-defined]
    return wrapped


async def test_asgi_websocket_refused_while_the_bulkhead_is_full() -> None:
    hub, _stats, _ = _hub()
    bulkhead = _one_slot(hub)
    app = _asgi_ws_app(bulkhead, hub)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        busy = asyncio.create_task(client.get("/slow"))
        while bulkhead.in_flight == 0:
            await asyncio.sleep(0.005)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(base.replace("http", "ws") + "/ws")
        assert refused.value.status == 503
        await busy
    assert bulkhead.in_flight == 0


async def test_asgi_websocket_lives_past_the_request_deadline_and_holds_a_slot() -> None:
    hub, stats, _ = _hub()
    bulkhead = Bulkhead("api", FixedLimit(4), events=hub)
    connections = Bulkhead("ws", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.05), events=hub)
    app = _asgi_ws_app(bulkhead, hub, connections=connections)
    async with serve(app) as base, aiohttp.ClientSession() as session:
        url = base.replace("http", "ws") + "/ws"
        async with session.ws_connect(url) as ws:
            assert connections.in_flight == 1 and bulkhead.in_flight == 0
            await asyncio.sleep(0.6)  # twice the request deadline: still open
            await ws.send_str("hello")
            assert (await ws.receive(timeout=2)).data == "hello"
            with pytest.raises(aiohttp.WSServerHandshakeError) as second:
                await session.ws_connect(url)  # the connection cap is 1
            assert second.value.status == 503
        for _ in range(100):
            if connections.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert connections.in_flight == 0
    assert stats.count("admitted") >= 1  # offered and admitted at connect, like a request


async def test_asgi_lifespan_still_passes_through() -> None:
    hub, _, _ = _hub()
    app = _asgi_ws_app(_one_slot(hub), hub)
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "lifespan.startup"}

    async def send(msg: Any) -> None:
        sent.append(msg)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert app.lifespan == ["lifespan.startup"]
    assert sent == [{"type": "lifespan.startup.complete"}]


async def test_aiohttp_websocket_lives_past_the_request_deadline() -> None:
    hub, _stats, _ = _hub()
    connections = Bulkhead("ws", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.05), events=hub)
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), events=hub),
        connections=connections,
        deadline=InboundDeadlinePolicy(default=0.3, maximum=0.3),
        events=hub,
        sweep_period=0.02,
    )

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str(msg.data)
        return ws

    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/ws", ws_handler)
    async with serve_aiohttp(app) as base, aiohttp.ClientSession() as session:
        async with session.ws_connect(base + "/ws") as ws:
            await asyncio.sleep(0.6)
            await ws.send_str("hello")
            assert (await ws.receive(timeout=2)).data == "hello"
            assert connections.in_flight == 1
            with pytest.raises(aiohttp.WSServerHandshakeError) as second:
                await session.ws_connect(base + "/ws")
            assert second.value.status == 503
        for _ in range(100):
            if connections.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert connections.in_flight == 0


# -- 15. gRPC refusals, every RPC shape -----------------------------------------------------

SHAPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


async def _slow_unary(request: Any, context: Any) -> bytes:
    await asyncio.sleep(1.0)
    return b"done"


async def _slow_stream(request: Any, context: Any) -> AsyncIterator[bytes]:
    await asyncio.sleep(1.0)
    yield b"done"


def _handler(shape: str) -> Any:
    make = getattr(grpc, f"{shape}_rpc_method_handler")
    behavior = _slow_stream if shape.endswith("stream") else _slow_unary
    return make(behavior, request_deserializer=_raw, response_serializer=_raw)


async def _call(channel: grpc.aio.Channel, shape: str) -> None:
    multi = getattr(channel, shape)(f"/demo.Shapes/{shape}")

    async def requests() -> AsyncIterator[bytes]:
        yield b"a"

    arg: Any = requests() if shape.startswith("stream") else b"a"
    call = multi(arg, timeout=5)
    if shape.endswith("stream"):
        async for _ in call:
            pass
    else:
        await call


@pytest.mark.parametrize("shape", SHAPES)
async def test_grpc_refusal_is_the_same_for_every_rpc_shape(shape: str) -> None:
    hub, _, _ = _hub()
    bulkhead = _one_slot(hub)
    server = grpc.aio.server(
        interceptors=[BrownoutServerInterceptor(EdgePolicy(bulkhead=bulkhead))]
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("demo.Shapes", {s: _handler(s) for s in SHAPES}),)
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        busy = asyncio.ensure_future(_call(channel, "unary_unary"))
        while bulkhead.in_flight == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _call(channel, shape)
        await busy
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value
    trailers = dict(refused.value.trailing_metadata() or ())
    assert trailers.get("brownout-reason") in ("queue_timeout", "queue_full"), trailers
