"""OpenTelemetry: observable instruments on the API, read by an SDK reader (O1, O2, O3, O5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from brownout import Priority, Reason, Stats
from brownout.events import (
    DegradedModeChanged,
    EventHub,
    RequestAdmitted,
    RequestCompleted,
    RequestOffered,
    RequestShed,
)
from brownout.export.otel import OtelHistogramSink, OtelMetrics


def req(cls, caller="alice", op="get", source="edge", **kw):
    return cls(at=0.0, source=source, operation=op, priority=Priority.CRITICAL, caller=caller, **kw)


def collect(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


@pytest.fixture
def reader_and_provider():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield reader, provider
    provider.shutdown()


def test_observable_counters_gauges_and_quantiles(reader_and_provider):
    reader, provider = reader_and_provider
    stats = Stats()
    OtelMetrics(stats, meter_provider=provider)
    for _ in range(3):
        stats.emit(req(RequestOffered, remaining=1.0))
        stats.emit(req(RequestCompleted, latency=0.02, useful=True))
    stats.emit(
        req(RequestShed, caller="bob", reason=Reason.QUEUE_FULL, remaining=0.1, queue_wait=0.0)
    )
    stats.emit(DegradedModeChanged(at=0.0, source="d", mode="stale", active=True, trigger="x"))
    in_flight = [5]
    stats.watch_gauge("in_flight", {"source": "edge"}, lambda: in_flight[0])

    m = collect(reader)
    [offered] = m["brownout.requests.offered"]
    assert offered.value == 3
    assert dict(offered.attributes) == {
        "source": "edge",
        "operation": "get",
        "priority": "critical",
        "caller": "alice",
    }
    [shed] = m["brownout.requests.shed"]
    assert (shed.value, shed.attributes["reason"], shed.attributes["caller"]) == (
        1,
        "queue_full",
        "bob",
    )
    assert m["brownout.requests.completed"][0].value == 3
    assert m["brownout.in_flight"][0].value == 5
    assert m["brownout.degraded_mode.active"][0].value == 1
    quantiles = {p.attributes["quantile"]: p.value for p in m["brownout.success.latency.quantile"]}
    assert set(quantiles) == {"0.5", "0.9", "0.99"}
    assert 0.015 < quantiles["0.5"] <= 0.02
    assert m["brownout.success.latency.count"][0].value == 3

    # Counters are cumulative: a later collection sees the new totals.
    stats.emit(req(RequestOffered, remaining=1.0))
    assert collect(reader)["brownout.requests.offered"][0].value == 4


def test_histogram_sink_records_useful_successes_only(reader_and_provider):  # O3
    reader, provider = reader_and_provider
    events = EventHub()
    events.subscribe(OtelHistogramSink(meter_provider=provider))
    events.emit(req(RequestCompleted, latency=0.05, useful=True))
    events.emit(req(RequestCompleted, latency=9.0, useful=False))
    events.emit(req(RequestAdmitted, source="db", queue_wait=0.01))
    events.emit(req(RequestOffered, source="db", remaining=0.3))
    m = collect(reader)
    [success] = m["brownout.success.latency"]
    assert success.count == 1
    assert success.sum == pytest.approx(0.05)
    assert m["brownout.queue.wait"][0].attributes["source"] == "db"
    assert m["brownout.deadline.remaining"][0].sum == pytest.approx(0.3)


def test_the_library_needs_only_the_api():
    # Importing the exporter must not import the SDK.
    code = (
        "import sys, brownout.export.otel as o; "
        "assert not any(m.startswith('opentelemetry.sdk') for m in sys.modules); "
        "o.OtelMetrics(__import__('brownout').Stats())"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bounded_100k_callers_and_operations_keep_the_data_points_bounded(reader_and_provider):
    """What the instruments report is what `Stats` keeps (bounded by its caps); the histogram
    sink caps operations and sources itself."""
    reader, provider = reader_and_provider
    stats = Stats(max_callers=100, max_operations=50)
    OtelMetrics(stats, meter_provider=provider)
    sink = OtelHistogramSink(meter_provider=provider, max_operations=50, max_sources=10)
    for i in range(100_000):
        stats.emit(req(RequestOffered, caller=f"tenant-{i}", op=f"/items/{i}", remaining=1.0))
        sink.emit(
            req(RequestCompleted, op=f"/items/{i}", source=f"hop{i}", latency=0.01, useful=True)
        )
        sink.emit(req(RequestAdmitted, source=f"hop{i}", queue_wait=0.0))
    for _ in range(3):  # repeated collections do not accumulate anything either
        points = collect(reader)
    # offered: one series per caller holding a slot (each with its own operation) + "other"
    assert len(points["brownout.requests.offered"]) <= 101
    assert len(points["brownout.success.latency"]) <= 51  # operations cap + "other"
    assert len(points["brownout.queue.wait"]) <= 11  # sources cap + "other"
    assert sum(len(p) for p in points.values()) < 500
    assert sum(p.value for p in points["brownout.requests.offered"]) == 100_000
