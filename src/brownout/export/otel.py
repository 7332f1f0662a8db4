"""OpenTelemetry metrics and traces through ``opentelemetry-api`` only (O1, O2, O3, O5).

`OtelMetrics` registers *observable* instruments whose callbacks read `Stats` when the SDK's
reader collects, so the request path pays nothing extra. The library depends on the API only;
the application installs and configures the SDK (a `MeterProvider` with a reader/exporter) as
it already does. Without an SDK the API's no-op meter makes this free.

The API has no observable histogram, so latency distributions are exported as quantile gauges
(``brownout.success.latency.quantile`` with a ``quantile`` attribute). For real OpenTelemetry
histograms subscribe `OtelHistogramSink`, which records synchronously on each event (it costs
a histogram ``record`` per useful success, admission and arrival).

Traces: `OtelSpanSink` records each decision on the current span (span events named
``brownout.*``), `enable_tracing` also puts the budget of every outbound call made by
brownout's clients on the span current there, and `BudgetPropagator` carries the budget
beside ``traceparent`` for services using OpenTelemetry propagation (docs/observability.md,
"Traces").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from opentelemetry import metrics, trace
    from opentelemetry.context import Context, create_key, get_value, set_value
    from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
    from opentelemetry.propagators.textmap import (
        CarrierT,
        Getter,
        Setter,
        TextMapPropagator,
        default_getter,
        default_setter,
    )
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "otel", e) from e

from .._clock import Clock, default_clock
from .._context import RequestContext, current
from .._errors import HeaderError, Reason
from .._histogram import LatencyHistogram
from .._propagation import (
    BUDGET_HEADER,
    add_outbound_hook,
    decode_budget_ms,
    encode_budget_ms,
    remove_outbound_hook,
)
from .._snapshot import items_of
from .._stats import Gauge, LabelCap, Stats
from .._version import VERSION
from ..events import (
    AttemptRetried,
    DegradedModeChanged,
    Event,
    EventHub,
    HandlerOverran,
    OutcomeUnknown,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
    RequestsTallied,
    RetryBudgetExhausted,
    StaleServed,
    hub,
)
from ._catalog import COUNTERS, GAUGES, HISTOGRAMS, STATE_COUNTERS

__all__ = [
    "QUANTILES",
    "BudgetPropagator",
    "OtelHistogramSink",
    "OtelMetrics",
    "OtelSpanSink",
    "disable_tracing",
    "enable_tracing",
    "extracted_budget",
]

QUANTILES = (0.5, 0.9, 0.99)

_Callback = Callable[[CallbackOptions], Iterable[Observation]]


def _meter(meter: Meter | None, meter_provider: MeterProvider | None) -> Meter:
    if meter is not None:
        return meter
    return metrics.get_meter("brownout", VERSION, meter_provider=meter_provider)


class OtelMetrics:
    """Observable OpenTelemetry instruments over a `Stats` (counters, gauges, quantiles).

    ``caller_attribute=False`` sums counters over callers. Instruments stay registered for the
    meter's lifetime; keep one `OtelMetrics` per `Stats`.
    """

    def __init__(
        self,
        stats: Stats,
        meter: Meter | None = None,
        *,
        meter_provider: MeterProvider | None = None,
        caller_attribute: bool = True,
        clock: Clock | None = None,
    ) -> None:
        self.stats = stats
        self.caller_attribute = caller_attribute
        self.meter = _meter(meter, meter_provider)
        self._clock = clock if clock is not None else default_clock()
        self._gauge_cache: tuple[float, dict[str, list[Gauge]]] | None = None
        m = self.meter
        for spec in COUNTERS:
            m.create_observable_counter(
                spec.otel,
                callbacks=[self._counter_callback(spec.kind, spec.reason_label)],
                unit="{request}",
                description=spec.help,
            )
        for attr, _prom, otel_name, labels, help_text in STATE_COUNTERS:
            m.create_observable_counter(
                otel_name,
                callbacks=[self._state_callback(attr, labels)],
                unit="1",
                description=help_text,
            )
        for g in GAUGES:
            m.create_observable_gauge(
                g.otel, callbacks=[self._gauge_callback(g.kind)], unit=g.unit, description=g.help
            )
        for h in HISTOGRAMS:
            m.create_observable_gauge(
                f"{h.otel}.quantile",
                callbacks=[self._quantile_callback(h.table, h.labels)],
                unit="s",
                description=f"{h.help} Quantile estimates (attribute 'quantile').",
            )
            m.create_observable_counter(
                f"{h.otel}.count",
                callbacks=[self._hist_count_callback(h.table, h.labels)],
                unit="1",
                description=f"Samples in {h.otel}.",
            )

    def _counter_callback(self, kind: str, reason_label: str | None) -> _Callback:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            sums: dict[tuple[tuple[str, str], ...], int] = {}
            for (k, src, op, pr, ca, reason), n in items_of(self.stats.rows):
                if k != kind:
                    continue
                attrs: tuple[tuple[str, str], ...] = (
                    ("source", src),
                    ("operation", op),
                    ("priority", pr),
                )
                if self.caller_attribute:
                    attrs += (("caller", ca),)
                if reason_label:
                    attrs += ((reason_label, reason),)
                sums[attrs] = sums.get(attrs, 0) + n
            return [Observation(n, dict(attrs)) for attrs, n in sums.items()]

        return observe

    def _state_callback(self, attr: str, labels: tuple[str, ...]) -> _Callback:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            table: dict[Any, int] = getattr(self.stats, attr)
            out = []
            for key, n in items_of(table):
                values = key if isinstance(key, tuple) else (key,)
                out.append(Observation(n, dict(zip(labels, values))))
            return out

        return observe

    def _gauges_by_name(self) -> dict[str, list[Gauge]]:
        # Every gauge instrument's callback runs in one collection: read observables once.
        now = self._clock.now()
        cached = self._gauge_cache
        if cached is not None and now - cached[0] < 0.5:
            return cached[1]
        grouped: dict[str, list[Gauge]] = {}
        for reading in self.stats.gauges():
            grouped.setdefault(reading[0], []).append(reading)
        self._gauge_cache = (now, grouped)
        return grouped

    def _gauge_callback(self, kind: str) -> _Callback:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(value, dict(labels))
                for _name, labels, value in self._gauges_by_name().get(kind, [])
            ]

        return observe

    def _hist_items(
        self, table: str, labels: tuple[str, ...]
    ) -> list[tuple[Mapping[str, str], LatencyHistogram]]:
        self.stats.sync()
        htable: dict[Any, LatencyHistogram] = getattr(self.stats, table)
        out: list[tuple[Mapping[str, str], LatencyHistogram]] = []
        for key, hist in items_of(htable):
            values = key if isinstance(key, tuple) else (key,)
            out.append((dict(zip(labels, values)), hist))
        return out

    def _quantile_callback(self, table: str, labels: tuple[str, ...]) -> _Callback:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            out = []
            for attrs, hist in self._hist_items(table, labels):
                if hist.count:
                    for q in QUANTILES:
                        out.append(Observation(hist.quantile(q), {**attrs, "quantile": str(q)}))
            return out

        return observe

    def _hist_count_callback(self, table: str, labels: tuple[str, ...]) -> _Callback:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(h.count, dict(a)) for a, h in self._hist_items(table, labels)]

        return observe


class OtelHistogramSink:
    """An event sink recording real OpenTelemetry histograms: useful-success latency (O3),
    queue wait and remaining deadline on arrival per hop (O2). Subscribe it to a hub.

    It accepts tallies (`RequestsTallied`): the success latencies it records are then the
    ledger's sample (every success with a deadline, one in ``estimate_every`` of the others)
    and arrive when the ledger flushes (at most ``flush_interval``, 1 s, after the request).
    """

    accepts_tallies = True

    def __init__(
        self,
        meter: Meter | None = None,
        *,
        meter_provider: MeterProvider | None = None,
        max_operations: int = 200,
        max_sources: int = 100,
    ) -> None:
        m = _meter(meter, meter_provider)
        by_table = {h.table: h for h in HISTOGRAMS}
        spec = by_table["success_latency"]
        self._success = m.create_histogram(spec.otel, unit="s", description=spec.help)
        spec = by_table["queue_wait"]
        self._queue_wait = m.create_histogram(spec.otel, unit="s", description=spec.help)
        spec = by_table["remaining_on_arrival"]
        self._remaining = m.create_histogram(spec.otel, unit="s", description=spec.help)
        self._operations = LabelCap(max_operations)
        self._sources = LabelCap(max_sources)

    def emit(self, event: Event) -> None:
        if isinstance(event, RequestsTallied):
            self._tallied(event)
        elif isinstance(event, RequestCompleted):
            if event.useful:
                attrs = {"operation": self._operations(event.operation)}
                attrs["priority"] = event.priority.label
                self._success.record(event.latency, attrs)
        elif isinstance(event, RequestAdmitted):
            self._queue_wait.record(event.queue_wait, {"source": self._sources(event.source)})
        elif isinstance(event, RequestOffered) and event.remaining is not None:
            self._remaining.record(event.remaining, {"source": self._sources(event.source)})

    def _tallied(self, e: RequestsTallied) -> None:
        source = {"source": self._sources(e.source)}
        admitted_now = sum(row[4] for row in e.rows)
        for _ in range(admitted_now):  # the API records one value at a time
            self._queue_wait.record(0.0, source)
        for seconds in e.remaining:
            self._remaining.record(seconds, source)
        for operation, priority, seconds in e.latencies:
            attrs = {"operation": self._operations(operation), "priority": priority.label}
            self._success.record(seconds, attrs)


# -- traces ------------------------------------------------------------------------------------

_get_span = trace.get_current_span

_FALLBACK_REASONS = frozenset(
    {
        Reason.BREAKER_OPEN,
        Reason.THROTTLED,
        Reason.BUDGET_EXHAUSTED,
        Reason.DEPENDENCY_UNAVAILABLE,
        Reason.DO_NOT_RETRY,
        Reason.OUTCOME_UNKNOWN,
    }
)
"""A dependency's refusals: the application may answer them (a fallback), so on a server
span they are events, not the request's error."""


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class OtelSpanSink:
    """An event sink recording brownout's decisions on the current OpenTelemetry span (O1).

    Events are emitted in the request's own task, so the current span is the request's (the
    server span, or a client span when an instrumented client wraps brownout's). Each
    decision becomes a span event named ``brownout.*``; the first arrival on a span also sets
    ``brownout.budget.remaining_ms`` and ``brownout.deadline.source`` on it. Names and the
    status rule: docs/observability.md, "Traces".

    It does not accept tallies: it needs each request's events, so while it is subscribed
    the edge emits them instead of counting. Without an SDK the current span does not record
    and the sink returns at once. ``set_status``: refusals set the span's status to ERROR
    (shed or expired on a server span, except quota refusals, which are the caller's doing
    as a 429 is; any refusal on a client span). ``max_spans``: spans remembered as already
    carrying the inbound attributes (oldest forgotten first).
    """

    accepts_tallies = False

    def __init__(self, *, set_status: bool = True, max_spans: int = 4096) -> None:
        if max_spans < 1:
            raise ValueError("max_spans must be >= 1")
        self.set_status = set_status
        self._max_spans = max_spans
        self._marked: dict[int, None] = {}

    def emit(self, event: Event) -> None:
        span = _get_span()
        if not span.is_recording():
            return
        if isinstance(event, RequestOffered):
            self._arrived(span, event)
        elif isinstance(event, RequestAdmitted):
            span.add_event(
                "brownout.admitted",
                {"brownout.source": event.source, "brownout.queue.wait_ms": _ms(event.queue_wait)},
            )
        elif isinstance(event, RequestCompleted):
            span.add_event(
                "brownout.completed",
                {
                    "brownout.source": event.source,
                    "brownout.latency_ms": _ms(event.latency),
                    "brownout.useful": event.useful,
                },
            )
        elif isinstance(event, RequestShed):
            attrs: dict[str, str | float | bool] = {
                "brownout.source": event.source,
                "brownout.reason": event.reason.value,
                "brownout.queue.wait_ms": _ms(event.queue_wait),
            }
            if event.remaining is not None:
                attrs["brownout.budget.remaining_ms"] = _ms(event.remaining)
            span.add_event("brownout.shed", attrs)
            if self.set_status:
                self._refused(span, event.reason)
        elif isinstance(event, RequestExpired):
            span.add_event(
                "brownout.expired",
                {
                    "brownout.source": event.source,
                    "brownout.expired.stage": event.stage,
                    "brownout.queue.wait_ms": _ms(event.queue_wait),
                },
            )
            if self.set_status:
                self._refused(span, Reason.DEADLINE_EXPIRED)
        elif isinstance(event, AttemptRetried):
            span.add_event(
                "brownout.retry",
                {
                    "brownout.source": event.source,
                    "brownout.retry.attempt": event.attempt,
                    "brownout.retry.backoff_ms": _ms(event.backoff),
                    "brownout.retry.cause": event.cause,
                },
            )
        elif isinstance(event, RetryBudgetExhausted):
            span.add_event(
                "brownout.retry.budget_exhausted",
                {"brownout.source": event.source, "brownout.retry.attempt": event.attempt},
            )
        elif isinstance(event, OutcomeUnknown):
            unknown: dict[str, str] = {"brownout.source": event.source}
            if event.idempotency_key is not None:
                unknown["brownout.idempotency_key"] = event.idempotency_key
            span.add_event("brownout.outcome_unknown", unknown)
        elif isinstance(event, DegradedModeChanged):
            span.add_event(
                "brownout.degraded",
                {
                    "brownout.source": event.source,
                    "brownout.degraded.mode": event.mode,
                    "brownout.degraded.active": event.active,
                    "brownout.degraded.trigger": event.trigger,
                },
            )
        elif isinstance(event, StaleServed):
            span.add_event(
                "brownout.stale_served",
                {"brownout.source": event.source, "brownout.stale.age_ms": _ms(event.age)},
            )
        elif isinstance(event, RequestQueued):
            span.add_event(
                "brownout.queued",
                {"brownout.source": event.source, "brownout.queue.depth": event.depth},
            )
        elif isinstance(event, RequestFailed):
            span.add_event(
                "brownout.failed", {"brownout.source": event.source, "brownout.error": event.error}
            )
        elif isinstance(event, RequestAbandoned):
            span.add_event("brownout.abandoned", {"brownout.source": event.source})
        elif isinstance(event, HandlerOverran):
            span.add_event(
                "brownout.overran",
                {"brownout.source": event.source, "brownout.overrun_ms": _ms(event.overrun)},
            )

    def _arrived(self, span: Span, event: RequestOffered) -> None:
        sid = span.get_span_context().span_id
        marked = self._marked
        if sid in marked:  # a dependency's bulkhead inside the request: not this hop's arrival
            return
        marked[sid] = None
        if len(marked) > self._max_spans:
            del marked[next(iter(marked))]
        attrs: dict[str, str | float] = {
            "brownout.source": event.source,
            "brownout.priority": event.priority.label,
        }
        if event.remaining is not None:
            attrs["brownout.budget.remaining_ms"] = _ms(event.remaining)
            deadline = current().deadline
            if deadline is not None:
                attrs["brownout.deadline.source"] = deadline.origin
        span.set_attributes(attrs)

    @staticmethod
    def _refused(span: Span, reason: Reason) -> None:
        kind = getattr(span, "kind", None)  # (the SDK's spans say; the API's do not)
        if kind is SpanKind.SERVER:
            if reason is Reason.QUOTA or reason in _FALLBACK_REASONS:
                return
        elif kind is not SpanKind.CLIENT:
            return
        span.set_status(Status(StatusCode.ERROR, f"brownout: {reason.value}"))

    def record_outbound(self, ctx: RequestContext, budget: float | None) -> None:
        """The `brownout._propagation.OutboundHook` `enable_tracing` installs: one
        ``brownout.outbound`` span event per attempt a brownout client sends, with its
        budget and the deadline's source."""
        span = _get_span()
        if not span.is_recording():
            return
        attrs: dict[str, str | float | int] = {"brownout.attempt": ctx.attempt}
        if budget is not None:
            attrs["brownout.budget.remaining_ms"] = _ms(budget)
        if ctx.deadline is not None:
            attrs["brownout.deadline.source"] = ctx.deadline.origin
        span.add_event("brownout.outbound", attrs)


def enable_tracing(sink: OtelSpanSink | None = None, *, events: EventHub = hub) -> OtelSpanSink:
    """Record brownout's decisions on spans: subscribe ``sink`` (a new `OtelSpanSink` by
    default) to ``events`` and have brownout's clients report each outbound budget to it.
    Returns the sink, for `disable_tracing`."""
    sink = sink if sink is not None else OtelSpanSink()
    events.subscribe(sink)
    add_outbound_hook(sink.record_outbound)
    return sink


def disable_tracing(sink: OtelSpanSink, *, events: EventHub = hub) -> None:
    """Undo `enable_tracing`."""
    remove_outbound_hook(sink.record_outbound)
    events.unsubscribe(sink)


_BUDGET_KEY = create_key("brownout-budget")


def extracted_budget(context: Context | None = None) -> float | None:
    """The budget (seconds, as received) `BudgetPropagator.extract` put in ``context`` (the
    current OpenTelemetry context by default), or ``None``."""
    value = get_value(_BUDGET_KEY, context)
    return value if isinstance(value, float) else None


class BudgetPropagator(TextMapPropagator):
    """Carries brownout's budget header (``brownout-budget-ms``) in OpenTelemetry propagation.

    ``inject`` writes the current brownout request's remaining budget (less ``reserve``
    seconds) in the encoding brownout's own clients send; nothing without a deadline.
    ``extract`` reads it into the OpenTelemetry context (`extracted_budget`): the shortest
    valid value, malformed ones ignored. It sets no brownout deadline: the edge reads the
    same header under its own trust rules (`InboundDeadlinePolicy`) and decides whether to
    believe it.
    """

    def __init__(self, *, reserve: float = 0.0) -> None:
        if not reserve >= 0.0:
            raise ValueError("reserve must be >= 0")
        self.reserve = reserve

    def inject(
        self,
        carrier: CarrierT,
        context: Context | None = None,
        setter: Setter[CarrierT] = default_setter,
    ) -> None:
        deadline = current().deadline
        if deadline is None:
            return
        setter.set(carrier, BUDGET_HEADER, encode_budget_ms(deadline.remaining() - self.reserve))

    def extract(
        self,
        carrier: CarrierT,
        context: Context | None = None,
        getter: Getter[CarrierT] = default_getter,
    ) -> Context:
        ctx = context if context is not None else Context()
        values = getter.get(carrier, BUDGET_HEADER)
        best: float | None = None
        for value in values or ():
            for text in value.split(","):
                try:
                    seconds = decode_budget_ms(text)
                except HeaderError:
                    continue
                if best is None or seconds < best:
                    best = seconds
        if best is None:
            return ctx
        return set_value(_BUDGET_KEY, best, ctx)

    @property
    def fields(self) -> set[str]:
        return {BUDGET_HEADER}
