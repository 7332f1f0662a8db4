"""OpenTelemetry traces: decisions on the current span, budgets on outbound calls, and the
budget propagator (O1, D2). Spans are read back from the SDK's in-memory exporter; each test
has its own tracer provider (the global one is never set)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import brownout
from brownout import Bulkhead, Deadline, Priority, Reason, Stats
from brownout._clock import ManualClock
from brownout.events import (
    AttemptRetried,
    DegradedModeChanged,
    EventHub,
    OutcomeUnknown,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestOffered,
    RequestShed,
    RetryBudgetExhausted,
)
from brownout.export.otel import (
    BudgetPropagator,
    OtelHistogramSink,
    OtelSpanSink,
    disable_tracing,
    enable_tracing,
    extracted_budget,
)
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.wire import BUDGET_HEADER, outbound_headers


def req(cls, source="edge", **kw):
    return cls(0.0, source, "get", Priority.SHEDDABLE, "c", **kw)


@pytest.fixture
def traced() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def only_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = exporter.get_finished_spans()
    return span


def events_of(span: ReadableSpan) -> dict[str, dict]:
    return {e.name: dict(e.attributes or {}) for e in span.events}


def test_each_decision_is_a_span_event(traced):
    tracer, exporter = traced
    events = EventHub()
    events.subscribe(OtelSpanSink())
    clock = ManualClock(100.0)
    with (
        tracer.start_as_current_span("GET /x", kind=SpanKind.INTERNAL),
        brownout.deadline(Deadline(100.25, clock, origin="header")),
    ):
        events.emit(req(RequestOffered, remaining=0.25))
        events.emit(req(RequestAdmitted, queue_wait=0.0125))
        events.emit(req(RequestCompleted, latency=0.05, useful=True))
        events.emit(req(AttemptRetried, source="billing", attempt=2, cause="503", backoff=0.1))
        events.emit(req(RetryBudgetExhausted, source="billing", attempt=3))
        events.emit(req(OutcomeUnknown, source="billing", idempotency_key="k1"))
        events.emit(DegradedModeChanged(0.0, "edge", "stale_prices", True, "overload"))
        events.emit(req(RequestShed, reason=Reason.QUOTA, remaining=0.2, queue_wait=0.0))
        events.emit(req(RequestExpired, stage="queue", queue_wait=0.3))
    span = only_span(exporter)
    assert span.attributes is not None
    assert span.attributes["brownout.budget.remaining_ms"] == 250.0
    assert span.attributes["brownout.deadline.source"] == "header"
    assert span.attributes["brownout.priority"] == "sheddable"
    got = events_of(span)
    assert got["brownout.admitted"] == {"brownout.source": "edge", "brownout.queue.wait_ms": 12.5}
    assert got["brownout.completed"]["brownout.useful"] is True
    assert got["brownout.retry"] == {
        "brownout.source": "billing",
        "brownout.retry.attempt": 2,
        "brownout.retry.backoff_ms": 100.0,
        "brownout.retry.cause": "503",
    }
    assert got["brownout.retry.budget_exhausted"]["brownout.retry.attempt"] == 3
    assert got["brownout.outcome_unknown"]["brownout.idempotency_key"] == "k1"
    assert got["brownout.degraded"]["brownout.degraded.mode"] == "stale_prices"
    assert got["brownout.shed"]["brownout.reason"] == "quota"
    assert got["brownout.shed"]["brownout.budget.remaining_ms"] == 200.0
    assert got["brownout.expired"]["brownout.expired.stage"] == "queue"
    assert span.status.status_code is StatusCode.UNSET  # an internal span: not brownout's call


def test_the_first_arrival_on_a_span_sets_its_budget(traced):
    tracer, exporter = traced
    events = EventHub()
    events.subscribe(OtelSpanSink())
    with tracer.start_as_current_span("GET /x", kind=SpanKind.SERVER):
        events.emit(req(RequestOffered, remaining=2.0))
        # A dependency's bulkhead inside the request: not this hop's arrival.
        events.emit(req(RequestOffered, source="billing", remaining=0.5))
    span = only_span(exporter)
    assert span.attributes["brownout.budget.remaining_ms"] == 2000.0
    assert span.attributes["brownout.source"] == "edge"
    assert "brownout.deadline.source" not in span.attributes  # no brownout deadline here


@pytest.mark.parametrize(
    ("kind", "reason", "error"),
    [
        (SpanKind.SERVER, Reason.OVERLOADED, True),
        (SpanKind.SERVER, Reason.QUEUE_TIMEOUT, True),
        (SpanKind.SERVER, Reason.QUOTA, False),  # the caller's doing, as a 429 is
        (SpanKind.SERVER, Reason.BREAKER_OPEN, False),  # a fallback may answer it
        (SpanKind.CLIENT, Reason.BREAKER_OPEN, True),  # the call was not made
        (SpanKind.INTERNAL, Reason.OVERLOADED, False),
    ],
)
def test_refusal_status(traced, kind, reason, error):
    tracer, exporter = traced
    events = EventHub()
    events.subscribe(OtelSpanSink())
    with tracer.start_as_current_span("s", kind=kind):
        events.emit(req(RequestShed, reason=reason, remaining=None, queue_wait=0.0))
    status = only_span(exporter).status
    if error:
        assert status.status_code is StatusCode.ERROR
        assert status.description == f"brownout: {reason.value}"
    else:
        assert status.status_code is StatusCode.UNSET


def test_expired_on_a_server_span_is_an_error_unless_told_otherwise(traced):
    tracer, exporter = traced
    for set_status in (True, False):
        events = EventHub()
        events.subscribe(OtelSpanSink(set_status=set_status))
        with tracer.start_as_current_span("s", kind=SpanKind.SERVER):
            events.emit(req(RequestExpired, stage="running", queue_wait=0.0))
    first, second = exporter.get_finished_spans()
    assert first.status.status_code is StatusCode.ERROR
    assert second.status.status_code is StatusCode.UNSET
    assert "brownout.expired" in events_of(second)


def test_without_a_recording_span_the_sink_does_nothing():
    sink = OtelSpanSink(max_spans=1)
    sink.emit(req(RequestOffered, remaining=1.0))  # no span: the API's invalid span
    sink.emit(req(RequestShed, reason=Reason.OVERLOADED, remaining=None, queue_wait=0.0))
    sink.record_outbound(brownout.current(), 1.0)
    assert sink._marked == {}


def test_spans_remembered_stay_bounded(traced):
    tracer, _ = traced
    sink = OtelSpanSink(max_spans=3)
    for _ in range(10):
        with tracer.start_as_current_span("s"):
            sink.emit(req(RequestOffered, remaining=1.0))
    assert len(sink._marked) == 3
    with pytest.raises(ValueError):
        OtelSpanSink(max_spans=0)


def test_the_span_sink_turns_tallies_off():
    events = EventHub()
    events.subscribe(Stats())
    events.subscribe(OtelHistogramSink())
    assert events.tallying
    sink = events.subscribe(OtelSpanSink())
    assert not events.tallying  # per-request events reach the span sink
    events.unsubscribe(sink)
    assert events.tallying


def test_outbound_budget_is_an_event_on_the_calling_span(traced):
    tracer, exporter = traced
    events = EventHub()
    sink = enable_tracing(events=events)
    clock = ManualClock(0.0)
    try:
        assert sink in events.sinks
        with (
            tracer.start_as_current_span("call", kind=SpanKind.CLIENT),
            brownout.deadline(Deadline(1.5, clock, origin="signed")),
        ):
            headers = outbound_headers(reserve=0.25)
        with tracer.start_as_current_span("no deadline"):
            outbound_headers()
    finally:
        disable_tracing(sink, events=events)
    assert sink not in events.sinks
    with tracer.start_as_current_span("after"):
        with brownout.deadline(1.0):
            outbound_headers()
    call, bare, after = exporter.get_finished_spans()
    assert headers[BUDGET_HEADER] == "1250"
    assert events_of(call)["brownout.outbound"] == {
        "brownout.attempt": 1,
        "brownout.budget.remaining_ms": 1250.0,
        "brownout.deadline.source": "signed",
    }
    assert events_of(bare)["brownout.outbound"] == {"brownout.attempt": 1}
    assert after.events == ()  # the hook went with disable_tracing


def test_a_scope_keeps_the_origin_of_the_deadline_it_shortens():
    clock = ManualClock(0.0)
    assert Deadline(1.0).origin == "local"
    with brownout.deadline(Deadline(10.0, clock, origin="header")):
        with brownout.deadline(Deadline(2.0, clock)):
            # An explicit Deadline is what it says it is.
            assert brownout.current().deadline.origin == "local"
    with brownout.deadline(5.0) as outer:
        assert outer.deadline.origin == "local"


async def test_an_async_scope_keeps_the_request_origin():
    loop_deadline = Deadline.after(10.0)
    edge = Deadline(loop_deadline.at, origin="header")
    with brownout.deadline(edge):
        async with brownout.deadline(1.0) as inner:
            assert inner.deadline is not edge
            assert inner.deadline.origin == "header"
        with brownout.deadline(1.0) as inner_sync:
            assert inner_sync.deadline.origin == "header"


def test_propagator_injects_the_budget_brownout_clients_send():
    prop = BudgetPropagator()
    assert prop.fields == {BUDGET_HEADER}
    carrier: dict[str, str] = {}
    prop.inject(carrier)
    assert carrier == {}  # no deadline, no header
    clock = ManualClock(0.0)
    with brownout.deadline(Deadline(0.75, clock)):
        prop.inject(carrier)
        assert carrier[BUDGET_HEADER] == outbound_headers()[BUDGET_HEADER] == "750"
        reserved: dict[str, str] = {}
        BudgetPropagator(reserve=0.5).inject(reserved)
        assert reserved[BUDGET_HEADER] == "250"
    with pytest.raises(ValueError):
        BudgetPropagator(reserve=-1.0)


def test_propagator_extracts_the_shortest_valid_budget():
    prop = BudgetPropagator()
    assert extracted_budget(prop.extract({})) is None
    assert extracted_budget(prop.extract({BUDGET_HEADER: "1500"})) == 1.5
    assert extracted_budget(prop.extract({BUDGET_HEADER: ["900, 400", "x"]})) == 0.4
    assert extracted_budget(prop.extract({BUDGET_HEADER: "-5"})) is None
    assert extracted_budget(prop.extract({BUDGET_HEADER: "9" * 40})) is None
    assert extracted_budget() is None  # nothing in the current context
    # Extraction sets no brownout deadline: the edge decides what to believe.
    assert brownout.current().deadline is None


def test_composite_propagation_carries_traceparent_and_budget(traced):
    tracer, _ = traced
    composite = CompositePropagator([TraceContextTextMapPropagator(), BudgetPropagator()])
    assert BUDGET_HEADER in composite.fields and "traceparent" in composite.fields
    carrier: dict[str, str] = {}
    clock = ManualClock(0.0)
    with (
        tracer.start_as_current_span("out", kind=SpanKind.CLIENT) as span,
        brownout.deadline(Deadline(2.0, clock)),
    ):
        composite.inject(carrier)
        trace_id = span.get_span_context().trace_id
    assert carrier[BUDGET_HEADER] == "2000"
    assert carrier["traceparent"].split("-")[1] == f"{trace_id:032x}"
    ctx = composite.extract(carrier)
    assert extracted_budget(ctx) == 2.0


async def test_decisions_for_a_waiter_land_on_the_waiters_span(traced):
    # A queued request is admitted (or refused) when another request frees the slot (or a
    # timer fires): the event must still reach the waiter's span, not the releaser's.
    tracer, exporter = traced
    events = EventHub()
    events.subscribe(OtelSpanSink())
    clock = ManualClock(0.0)
    bulkhead = Bulkhead("b", FixedLimit(1), FifoQueue(max_size=1), clock=clock, events=events)
    release = asyncio.Event()

    async def holder() -> None:
        with tracer.start_as_current_span("holder"):
            async with bulkhead.admit():
                await release.wait()
                clock.advance(0.5)

    async def waiter(name: str) -> None:
        with tracer.start_as_current_span(name):
            try:
                async with bulkhead.admit():
                    pass
            except brownout.Rejected:
                pass

    first = asyncio.create_task(holder())
    await asyncio.sleep(0)
    queued = asyncio.create_task(waiter("queued"))
    await asyncio.sleep(0)
    evicted_by = asyncio.create_task(waiter("evictor"))  # the queue is full: refused itself
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, queued, evicted_by)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [e.name for e in spans["holder"].events] == ["brownout.admitted", "brownout.completed"]
    assert events_of(spans["queued"])["brownout.admitted"]["brownout.queue.wait_ms"] == 500.0
    assert events_of(spans["evictor"])["brownout.shed"]["brownout.reason"] == "queue_full"
