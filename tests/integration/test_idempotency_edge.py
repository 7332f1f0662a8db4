"""The edge carries the idempotency key and the attempt number (I1), and retries yield to first
attempts under overload (I3): uvicorn + Starlette, aiohttp and grpc.aio over loopback, with a
raw HTTP/1.1 client (so repeated headers reach the server as sent) and a real grpcio client.

The key is bound to the caller the classifier names (``x-caller`` here, standing in for
authentication); the attempt is read only from a trusted source."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute
from tests.integration.servers import serve, serve_aiohttp, serve_grpc

import brownout
from brownout import (
    Bulkhead,
    EdgePolicy,
    Reason,
    Stats,
    Trust,
)
from brownout._lab.http1 import ResponseParser, encode_request
from brownout.events import DeadlineHeaderIgnored, Event, EventHub, RequestShed
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.grpc_server import BrownoutServerInterceptor, GrpcCall
from brownout.integrations.httpx import BrownoutTransport
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.wire import bind_idempotency_key

pytestmark = pytest.mark.integration

Pairs = tuple[tuple[str, str], ...]
METHOD = "/test.Idem/Echo"


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def ignored(self) -> list[tuple[str, str]]:
        return [(e.header, e.problem) for e in self.events if isinstance(e, DeadlineHeaderIgnored)]


def caller_of_scope(scope: Any, cls: Any) -> Any:
    for k, v in scope["headers"]:
        if k == b"x-caller":
            return cls._replace(caller=v.decode())
    return cls


def caller_of_aiohttp(request: Any, cls: Any) -> Any:
    return cls._replace(caller=request.headers.get("x-caller", cls.caller))


def caller_of_grpc(call: GrpcCall, cls: Any) -> Any:
    for k, v in call.metadata:
        if k == "x-caller":
            return cls._replace(caller=str(v))
    return cls


def policy_for(trust: Trust, classifier: Any, hub: EventHub, **kw: Any) -> EdgePolicy:
    return EdgePolicy(
        bulkhead=kw.pop("bulkhead", None) or Bulkhead("api", FixedLimit(4), events=hub),
        trust=trust,
        classifier=classifier,
        events=hub,
        **kw,
    )


def seen_now() -> dict[str, Any]:
    ctx = brownout.current()
    return {"attempt": ctx.attempt, "key": ctx.idempotency_key}


async def raw(base: str, method: str, path: str, pairs: Pairs) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(encode_request(method, path, "edge", pairs))
        parser = ResponseParser()
        while True:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the server closed the connection"
            got = parser.feed(data)
            if got:
                return got[0].status, got[0].body
    finally:
        writer.close()


CASES: list[tuple[Trust, Pairs, int, str | None, list[tuple[str, str]]]] = [
    # (trust, headers, attempt seen, raw key whose binding is seen, ignored headers)
    (Trust.TRUSTED, (("idempotency-key", '"pay-42"'),), 1, "pay-42", []),
    (Trust.TRUSTED, (("idempotency-key", "pay-42"), ("brownout-attempt", "3")), 3, "pay-42", []),
    (Trust.TRUSTED, (("idempotency-key", '"a \\"q\\" b"'),), 1, 'a "q" b', []),
    (
        Trust.UNTRUSTED,
        (("idempotency-key", "pay-42"), ("brownout-attempt", "3")),
        1,
        "pay-42",
        [("brownout-attempt", "untrusted source")],
    ),
    (
        Trust.SIGNED,
        (("idempotency-key", "pay-42"), ("brownout-attempt", "2")),
        1,
        "pay-42",
        [("brownout-attempt", "untrusted source")],
    ),
    (
        Trust.TRUSTED,
        (("idempotency-key", "a"), ("idempotency-key", "b"), ("brownout-attempt", "2")),
        2,
        None,
        [("idempotency-key", "repeated")],
    ),
    (
        Trust.TRUSTED,
        (("idempotency-key", "a"), ("idempotency-key", "a")),
        1,
        "a",
        [],
    ),
    (
        Trust.TRUSTED,
        (("brownout-attempt", "2"), ("brownout-attempt", "5")),
        1,
        None,
        [("brownout-attempt", "repeated")],
    ),
    (
        Trust.TRUSTED,
        (("idempotency-key", "x" * 256), ("brownout-attempt", "0")),
        1,
        None,
        [("idempotency-key", "too long"), ("brownout-attempt", "malformed")],
    ),
    (Trust.TRUSTED, (("idempotency-key", "a b"),), 1, None, [("idempotency-key", "malformed")]),
]
IDS = [f"{t.value}-{'+'.join(v[:12] for _, v in p)}" for t, p, _, _, _ in CASES]


def judge(
    got: dict[str, Any],
    rec: Recorder,
    attempt: int,
    key: str | None,
    ignored: list[tuple[str, str]],
) -> None:
    assert got["attempt"] == attempt
    assert got["key"] == (None if key is None else bind_idempotency_key("alice", key))
    assert rec.ignored() == ignored


def starlette_app(policy: EdgePolicy) -> Starlette:
    async def item(request: Request) -> JSONResponse:
        return JSONResponse(seen_now())

    app = Starlette(routes=[StarletteRoute("/items/{id}", item, methods=["GET", "POST"])])
    app.add_middleware(BrownoutMiddleware, policy=policy)
    return app


def aiohttp_app(policy: EdgePolicy) -> web.Application:
    async def item(request: web.Request) -> web.Response:
        return web.json_response(seen_now())

    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_route("*", "/items/{id}", item)
    return app


@pytest.mark.parametrize(("trust", "pairs", "attempt", "key", "ignored"), CASES, ids=IDS)
async def test_uvicorn(
    trust: Trust, pairs: Pairs, attempt: int, key: str | None, ignored: list[tuple[str, str]]
) -> None:
    hub, rec = EventHub(), Recorder()
    hub.subscribe(rec)
    async with serve(starlette_app(policy_for(trust, caller_of_scope, hub))) as base:
        status, body = await raw(base, "POST", "/items/1", (("x-caller", "alice"), *pairs))
    assert status == 200
    judge(json.loads(body), rec, attempt, key, ignored)


@pytest.mark.parametrize(("trust", "pairs", "attempt", "key", "ignored"), CASES, ids=IDS)
async def test_aiohttp(
    trust: Trust, pairs: Pairs, attempt: int, key: str | None, ignored: list[tuple[str, str]]
) -> None:
    hub, rec = EventHub(), Recorder()
    hub.subscribe(rec)
    async with serve_aiohttp(aiohttp_app(policy_for(trust, caller_of_aiohttp, hub))) as base:
        status, body = await raw(base, "POST", "/items/1", (("x-caller", "alice"), *pairs))
    assert status == 200
    judge(json.loads(body), rec, attempt, key, ignored)


@contextlib.asynccontextmanager
async def grpc_edge(policy: EdgePolicy) -> AsyncIterator[grpc.aio.Channel]:
    async def echo(request: bytes, context: Any) -> bytes:
        return json.dumps(seen_now()).encode()

    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Idem", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        yield channel


@pytest.mark.parametrize(("trust", "pairs", "attempt", "key", "ignored"), CASES, ids=IDS)
async def test_grpc(
    trust: Trust, pairs: Pairs, attempt: int, key: str | None, ignored: list[tuple[str, str]]
) -> None:
    hub, rec = EventHub(), Recorder()
    hub.subscribe(rec)
    async with grpc_edge(policy_for(trust, caller_of_grpc, hub)) as channel:
        answer = await channel.unary_unary(METHOD)(
            b"", metadata=(("x-caller", "alice"), *pairs), timeout=10
        )
    judge(json.loads(answer), rec, attempt, key, ignored)


async def test_the_key_and_attempt_reach_the_service_behind_the_front() -> None:
    """client -> front (uvicorn) -> payment (aiohttp), the front calling with brownout's httpx
    transport: two attempts of one client key reach the payment service as one key, with
    their attempt numbers; another caller's same key arrives as another key."""
    seen: list[dict[str, Any]] = []
    pay_hub = EventHub()

    async def pay(request: web.Request) -> web.Response:
        seen.append({**seen_now(), "caller": brownout.current().caller})
        return web.json_response({"ok": True})

    payment = web.Application(
        middlewares=[brownout_middleware(policy_for(Trust.TRUSTED, caller_of_aiohttp, pay_hub))]
    )
    payment.router.add_post("/pay", pay)
    async with serve_aiohttp(payment) as pay_base:
        outbound = httpx.AsyncClient(
            base_url=pay_base,
            transport=BrownoutTransport(httpx.AsyncHTTPTransport()),
            headers={"x-caller": "front"},
        )

        async def checkout(request: Request) -> JSONResponse:
            r = await outbound.post("/pay", content=b"{}")
            return JSONResponse({"status": r.status_code})

        front = Starlette(routes=[StarletteRoute("/checkout", checkout, methods=["POST"])])
        front.add_middleware(
            BrownoutMiddleware,
            policy=policy_for(Trust.TRUSTED, caller_of_scope, EventHub()),
        )
        try:
            async with serve(front) as front_base:
                for caller, attempt in (("alice", "1"), ("alice", "2"), ("bob", "1")):
                    status, body = await raw(
                        front_base,
                        "POST",
                        "/checkout",
                        (
                            ("x-caller", caller),
                            ("idempotency-key", '"order-7"'),
                            ("brownout-attempt", attempt),
                        ),
                    )
                    assert (status, json.loads(body)) == (200, {"status": 200})
        finally:
            await outbound.aclose()
    alice = bind_idempotency_key("front", bind_idempotency_key("alice", "order-7"))
    bob = bind_idempotency_key("front", bind_idempotency_key("bob", "order-7"))
    assert seen == [
        {"attempt": 1, "key": alice, "caller": "front"},
        {"attempt": 2, "key": alice, "caller": "front"},
        {"attempt": 1, "key": bob, "caller": "front"},
    ]
    assert alice != bob


async def test_a_server_at_its_limit_sheds_retries_first() -> None:
    """I3 over loopback: one slot, a queue of two. The slot is held; two retries (attempt 2
    from a trusted client) wait; two first attempts then arrive: each evicts a retry, and
    they are served before any retry would be. The refusals are counted as retries."""
    hub, stats = EventHub(), Stats()
    hub.subscribe(stats)
    rec = Recorder()
    hub.subscribe(rec)
    bulkhead = Bulkhead("api", FixedLimit(1), queue=FifoQueue(2, 30.0), events=hub)
    release = asyncio.Event()
    order: list[str] = []

    async def item(request: Request) -> JSONResponse:
        tag = request.headers["x-tag"]
        order.append(tag)
        if tag == "holder":
            await release.wait()
        return JSONResponse(seen_now())

    app = Starlette(routes=[StarletteRoute("/items/{id}", item)])
    app.add_middleware(
        BrownoutMiddleware, policy=EdgePolicy(bulkhead=bulkhead, trust=Trust.TRUSTED, events=hub)
    )
    async with serve(app) as base:

        async def call(tag: str, attempt: str) -> int:
            pairs = (("x-tag", tag), ("brownout-attempt", attempt), ("brownout-budget-ms", "20000"))
            status, _ = await raw(base, "GET", "/items/1", pairs)
            return status

        async def until(n: int) -> None:
            for _ in range(1000):
                if bulkhead.queue_depth == n and bulkhead.in_flight == 1:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"queue depth {bulkhead.queue_depth}, wanted {n}")

        holder = asyncio.create_task(call("holder", "1"))
        for _ in range(1000):
            if order:
                break
            await asyncio.sleep(0.01)
        retries = [asyncio.create_task(call(f"retry{i}", "2")) for i in range(2)]
        await until(2)
        firsts = [asyncio.create_task(call(f"first{i}", "1")) for i in range(2)]
        statuses = await asyncio.wait_for(asyncio.gather(*retries), 20)  # both evicted
        await until(2)
        release.set()
        statuses += await asyncio.wait_for(asyncio.gather(holder, *firsts), 20)
    assert statuses == [503, 503, 200, 200, 200]
    assert order == ["holder", "first0", "first1"] or order == ["holder", "first1", "first0"]
    shed = [e for e in rec.events if isinstance(e, RequestShed)]
    assert [(e.reason, e.retry) for e in shed] == [(Reason.QUEUE_FULL, True)] * 2
    assert stats.count("shed_retry", reason="queue_full") == 2 == stats.count("shed")
