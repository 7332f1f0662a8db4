"""Traces through real servers: a FastAPI app behind `BrownoutMiddleware` under uvicorn, with a
raw ASGI middleware opening server spans, calling a second uvicorn server through brownout's
httpx transport (O1, D2). Spans are read back from the SDK's in-memory exporter.

Margins are wide (a shared 2-core host): the handler holding the bulkhead sleeps 0.4 s, the
queued request must report at least 0.15 s of queue wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute
from tests.integration.servers import serve

from brownout import Bulkhead, EdgePolicy, Route, Stats, Trust
from brownout.events import EventHub
from brownout.export.otel import BudgetPropagator, disable_tracing, enable_tracing
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.httpx import BrownoutTransport
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.wire import BUDGET_HEADER

pytestmark = pytest.mark.integration

PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), BudgetPropagator()])


class ServerSpans:
    """A server span per HTTP request, continuing the caller's trace (what an ASGI tracing
    middleware does; kept raw so the test owns every line of it)."""

    def __init__(self, app: Any, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = PROPAGATOR.extract(carrier)
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:

            async def send_status(message: Any) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_status)


@pytest.fixture
def traced() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def server_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans() if s.name == name and s.kind is SpanKind.SERVER
    ]


def event(span: ReadableSpan, name: str) -> dict[str, Any]:
    found = [dict(e.attributes or {}) for e in span.events if e.name == name]
    assert len(found) == 1, (name, span.name, [(e.name, e.attributes) for e in span.events])
    return found[0]


async def spans_settle(exporter: InMemorySpanExporter, count: int) -> None:
    # A server span ends just after its response is sent: give the server a moment.
    for _ in range(200):
        if len(exporter.get_finished_spans()) >= count:
            return
        await asyncio.sleep(0.01)


async def test_decisions_and_budgets_reach_the_spans(traced):
    tracer, exporter = traced
    received: list[dict[str, str]] = []

    async def echo(request: Request) -> JSONResponse:
        received.append(dict(request.headers))
        return JSONResponse({"ok": True})

    downstream = ServerSpans(Starlette(routes=[StarletteRoute("/echo", echo)]), tracer)

    events = EventHub()
    events.subscribe(Stats())
    sink = enable_tracing(events=events)
    assert not events.tallying  # the span sink needs each request's events
    app = FastAPI()
    target: list[str] = []

    @app.get("/work")
    async def work() -> dict[str, bool]:
        await asyncio.sleep(0.4)
        return {"ok": True}

    @app.get("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(5.0)
        return {"ok": True}

    @app.get("/call")
    async def call() -> dict[str, Any]:
        transport = BrownoutTransport(httpx.AsyncHTTPTransport())
        async with httpx.AsyncClient(transport=transport) as client:
            with tracer.start_as_current_span("GET /echo", kind=SpanKind.CLIENT):
                headers: dict[str, str] = {}
                PROPAGATOR.inject(headers)
                answer = await client.get(f"{target[0]}/echo", headers=headers)
        return {"status": answer.status_code}

    api = Bulkhead("api", FixedLimit(8), events=events)
    express: list[str] = []
    admit_uncontended = api.admit_uncontended

    def spy(*args: Any) -> Any:  # the express path's admission, counted (then done as is)
        express.append(args[2])
        return admit_uncontended(*args)

    api.admit_uncontended = spy  # type: ignore[method-assign]
    policy = EdgePolicy(
        bulkhead=api,
        trust=Trust.TRUSTED,
        routes={
            "/work": Route(
                bulkhead=Bulkhead(
                    "work", FixedLimit(1), FifoQueue(max_size=1, max_wait=3.0), events=events
                )
            ),
            "/slow": Route(default=0.3, maximum=0.3),
        },
        events=events,
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    upstream = ServerSpans(app, tracer)
    try:
        async with serve(downstream) as down, serve(upstream) as base:
            target.append(down)
            async with httpx.AsyncClient(base_url=base, timeout=10.0) as client:
                first = asyncio.create_task(client.get("/work"))
                await asyncio.sleep(0.1)
                second = asyncio.create_task(client.get("/work"))
                await asyncio.sleep(0.1)
                third = await client.get("/work")  # the one slot and the one queue place taken
                statuses = [(await first).status_code, (await second).status_code]
                expired = await client.get("/slow")
                called = await client.get("/call", headers={BUDGET_HEADER: "1500"})
            await spans_settle(exporter, 7)
    finally:
        disable_tracing(sink, events=events)

    assert statuses == [200, 200] and third.status_code == 503
    assert expired.status_code == 504
    assert called.json() == {"status": 200}

    # Admitted, with the time it queued.
    works = server_spans(exporter, "GET /work")
    assert len(works) == 3
    by_status = {s.attributes["http.response.status_code"]: s for s in works if s.attributes}
    admitted = sorted(
        event(s, "brownout.admitted")["brownout.queue.wait_ms"]
        for s in works
        if s.attributes and s.attributes["http.response.status_code"] == 200
    )
    assert admitted[0] < 50.0 and admitted[1] >= 150.0
    for s in works:
        if s.attributes and s.attributes["http.response.status_code"] == 200:
            assert event(s, "brownout.completed")["brownout.useful"] is True
            assert s.attributes["brownout.deadline.source"] == "default"
            assert s.status.status_code is StatusCode.UNSET

    # Shed, with its reason; an error of the server span.
    shed = by_status[503]
    assert event(shed, "brownout.shed")["brownout.reason"] == "queue_full"
    assert shed.status.status_code is StatusCode.ERROR
    assert shed.status.description == "brownout: queue_full"

    # Expired while running.
    (late,) = server_spans(exporter, "GET /slow")
    assert event(late, "brownout.expired")["brownout.expired.stage"] == "running"
    assert late.status.status_code is StatusCode.ERROR
    assert 0.0 < late.attributes["brownout.budget.remaining_ms"] <= 300.0

    # The budget at each hop, and the trace and the budget crossing to the second server.
    (inbound,) = server_spans(exporter, "GET /call")
    assert inbound.attributes["brownout.deadline.source"] == "header"
    assert 1000.0 < inbound.attributes["brownout.budget.remaining_ms"] <= 1500.0
    assert "/call" in express  # served by the express path, and still traced:
    assert {"brownout.admitted", "brownout.completed"} <= {e.name for e in inbound.events}
    (client_span,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert client_span.parent is not None
    assert client_span.parent.span_id == inbound.context.span_id
    outbound = event(client_span, "brownout.outbound")
    assert outbound["brownout.deadline.source"] == "header"
    sent = outbound["brownout.budget.remaining_ms"]
    assert 0.0 < sent <= inbound.attributes["brownout.budget.remaining_ms"]
    (headers,) = received
    assert headers["traceparent"].split("-")[2] == f"{client_span.context.span_id:016x}"
    assert 0 < int(headers[BUDGET_HEADER]) <= 1500
    (echo_span,) = server_spans(exporter, "GET /echo")
    assert echo_span.context.trace_id == inbound.context.trace_id
    assert echo_span.parent is not None
    assert echo_span.parent.span_id == client_span.context.span_id
