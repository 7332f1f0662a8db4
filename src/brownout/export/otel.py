"""OpenTelemetry metrics through ``opentelemetry-api`` only (O1, O2, O3, O5).

`OtelMetrics` registers *observable* instruments whose callbacks read `Stats` when the SDK's
reader collects, so the request path pays nothing extra. The library depends on the API only;
the application installs and configures the SDK (a `MeterProvider` with a reader/exporter) as
it already does. Without an SDK the API's no-op meter makes this free.

The API has no observable histogram, so latency distributions are exported as quantile gauges
(``brownout.success.latency.quantile`` with a ``quantile`` attribute). For real OpenTelemetry
histograms subscribe `OtelHistogramSink`, which records synchronously on each event (it costs
a histogram ``record`` per useful success, admission and arrival).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "otel", e) from e

from .._clock import Clock, default_clock
from .._histogram import LatencyHistogram
from .._snapshot import items_of
from .._stats import Gauge, LabelCap, Stats
from .._version import VERSION
from ..events import Event, RequestAdmitted, RequestCompleted, RequestOffered, RequestsTallied
from ._catalog import COUNTERS, GAUGES, HISTOGRAMS, STATE_COUNTERS

__all__ = ["QUANTILES", "OtelHistogramSink", "OtelMetrics"]

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
