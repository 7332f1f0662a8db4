"""Readers on other threads while the loop writes: a real ``prometheus_client`` HTTP server
thread and the OpenTelemetry SDK's periodic reader thread scrape `Stats` while an asyncio loop
floods it with ever new label sets through real bulkheads and an `EventHub`.

Every scrape must succeed (HTTP 200, parseable), counters must never go backwards between
scrapes, histogram counts must equal their +Inf bucket, and nothing may raise or be logged as
an error on either thread (`EventHub.emit` and `Stats.gauges` log and swallow exceptions, so
the logs are part of the verdict).

Requirements: O1 (counts exact and monotonic), O2/O5 (gauges read from observables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from brownout import Bulkhead, Deadline, Priority, Reason, Rejected, Stats
from brownout.events import (
    AttemptRetried,
    BreakerStateChanged,
    DeadlineHeaderIgnored,
    DegradedModeChanged,
    EventHub,
    LimitChanged,
    QuotaBackendChanged,
    RequestCompleted,
    RequestFailed,
    RequestOffered,
    RequestShed,
)
from brownout.export.prometheus import register
from brownout.limits import FixedLimit

pytestmark = pytest.mark.integration

FLOOD_SECONDS = 6.0


@contextlib.contextmanager
def busy_switching() -> Iterator[None]:
    # The GIL changes hands every 5 ms by default; a shorter interval makes the interleavings
    # that happen in production over days happen within seconds.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class ErrorLog(logging.Handler):
    """Every ERROR (or worse) record from any logger on any thread."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        out = []
        for r in self.records:
            text = f"{r.name}: {r.getMessage()}"
            if r.exc_info and r.exc_info[1] is not None:
                text += f" ({type(r.exc_info[1]).__name__}: {r.exc_info[1]})"
            out.append(text)
        return out


@contextlib.contextmanager
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def small_stats() -> Stats:
    # Small caps, a low series ceiling and a short caller epoch: label folding, series overflow
    # and top-k rebalancing (which moves counts between rows) all happen many times a second.
    return Stats(
        max_operations=8,
        max_callers=8,
        max_sources=12,
        max_reasons=10,
        max_series=400,
        caller_epoch=300,
    )


async def flood(hub: EventHub, stats: Stats, stop: threading.Event, seconds: float) -> int:
    """Real bulkheads (new ones all the time, old ones dropped) and events with ever new
    callers, operations, sources, reasons, modes; returns the requests offered."""
    end = time.monotonic() + seconds
    bulkheads: list[Bulkhead] = []
    gauges: list[object] = []
    offered = 0
    n = 0

    async def one(b: Bulkhead, i: int) -> None:
        heavy = f"heavy{i // 400}"  # the heavy caller changes over time: top-k evictions
        caller = heavy if i % 3 else f"c{i}"
        deadline = Deadline.after(5.0) if i % 2 else None
        try:
            async with b.admit(
                priority=Priority(i % 4), caller=caller, operation=f"/op{i % 37}", deadline=deadline
            ):
                if i % 5 == 0:
                    await asyncio.sleep(0)
        except Rejected:
            pass

    while time.monotonic() < end and not stop.is_set():
        n += 1
        if n % 4 == 1:
            b = Bulkhead(f"b{n}", FixedLimit(4), events=hub)
            stats.watch(b)
            if len(gauges) < 60:  # watched while scrapes run; each must stay watched
                gauges.append(
                    stats.watch_gauge("custom_gauge", {"gauge": f"g{n}"}, lambda n=n: float(n))
                )
            bulkheads.append(b)
            # Dropped bulkheads: their observables go away, and their ledgers once a flush
            # has emitted what they counted (the exact offered count below depends on it).
            del bulkheads[:-6]
        b = bulkheads[n % len(bulkheads)]
        await asyncio.gather(*(one(b, offered + k) for k in range(24)))
        offered += 24
        now = asyncio.get_running_loop().time()
        src = f"s{n}"
        for k in range(4):
            hub.emit(RequestFailed(now, src, f"/f{n}", Priority(k), f"x{n}", 0.01, f"Error{n}x{k}"))
            hub.emit(AttemptRetried(now, src, f"/r{n}", Priority(k), f"y{n}", 1, f"cause{n}", 0.0))
            hub.emit(
                RequestShed(now, src, f"/s{n}", Priority(k), f"z{n}", Reason.OVERLOADED, None, 0.0)
            )
            hub.emit(RequestCompleted(now, src, f"/c{n}", Priority(k), f"w{n}", 0.002 * k, True))
        hub.emit(LimitChanged(now, src, n, n + 1))
        hub.emit(BreakerStateChanged(now, src, "closed", "open" if n % 2 else "closed"))
        hub.emit(DegradedModeChanged(now, src, f"mode{n % 30}", bool(n % 2), "test"))
        hub.emit(QuotaBackendChanged(now, src, bool(n % 2), "test"))
        hub.emit(DeadlineHeaderIgnored(now, src, f"h{n % 20}", f"p{n}"))
        await asyncio.sleep(0)
    read = stats.gauges()
    sources = {labels.get("source") for name, labels, _ in read if name == "in_flight"}
    assert {b.name for b in bulkheads} <= sources, "a bulkhead watched during a scrape is lost"
    names = {labels.get("gauge") for name, labels, _ in read if name == "custom_gauge"}
    assert len(names) == len(gauges), f"{len(gauges) - len(names)} watched gauges lost"
    return offered


def counters_and_histograms(
    text: str,
) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], list[str]]:
    """Counter samples (and histogram _count/_sum/_bucket) by (name, labels), and every broken
    histogram invariant found in this one scrape."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    problems: list[str] = []
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        elif fam.type == "histogram":
            by_series: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
            buckets: dict[tuple[tuple[str, str], ...], list[float]] = {}
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                key = tuple(sorted(labels.items()))
                if s.name.endswith("_bucket"):
                    buckets.setdefault(key, []).append(s.value)
                    if s.labels["le"] == "+Inf":
                        by_series.setdefault(key, {})["inf"] = s.value
                else:
                    suffix = s.name.rsplit("_", 1)[1]
                    by_series.setdefault(key, {})[suffix] = s.value
                values[(s.name, tuple(sorted(s.labels.items())))] = s.value
            for key, got in by_series.items():
                if got.get("count") != got.get("inf"):
                    problems.append(f"{fam.name}{dict(key)}: _count {got} != +Inf bucket")
            for key, series in buckets.items():
                if series != sorted(series):
                    problems.append(f"{fam.name}{dict(key)}: buckets not cumulative {series}")
    return values, problems


def scrape_loop(url: str, stop: threading.Event, per_series: bool) -> tuple[int, list[str]]:
    """Scrape until ``stop``; returns (scrapes, problems). ``per_series``: each counter series
    must be monotonic (right when no label is dropped and re-admitted, i.e. without callers);
    otherwise each metric's total over its series must be."""
    scrapes = 0
    problems: list[str] = []
    last: dict[Any, float] = {}
    while not stop.is_set() and len(problems) < 20:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                status = resp.status
                body = resp.read().decode()
        except Exception as e:  # a 500 is raised by urlopen
            problems.append(f"scrape {scrapes}: {type(e).__name__}: {e}")
            continue
        scrapes += 1
        if status != 200:
            problems.append(f"scrape {scrapes}: HTTP {status}")
            continue
        try:
            values, broken = counters_and_histograms(body)
        except Exception as e:
            problems.append(f"scrape {scrapes}: unparseable: {type(e).__name__}: {e}")
            continue
        problems += broken
        if per_series:
            current: dict[Any, float] = dict(values)
        else:
            current = {}
            for (name, _labels), v in values.items():
                if name.endswith(("_total", "_count", "_sum")):
                    current[name] = current.get(name, 0.0) + v
        for key, v in current.items():
            before = last.get(key)
            if before is not None and v < before:
                problems.append(f"scrape {scrapes}: {key} went back from {before} to {v}")
        last.update(current)
    return scrapes, problems


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # reported by the test, not lost in the thread
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def snapshot_loop(stats: Stats, stop: threading.Event) -> int:
    """`Stats.snapshot()` and the other read methods, as fast as they go."""
    n = 0
    last_offered = 0
    while not stop.is_set():
        snap = stats.snapshot()
        offered = snap["totals"]["offered"]
        assert offered >= last_offered, (offered, last_offered)
        last_offered = offered
        stats.count("shed", caller="other")
        stats.gauges()
        n += 1
    return n


async def test_prometheus_server_thread_scrapes_a_flooding_loop() -> None:
    hub = EventHub()
    stats = hub.subscribe(small_stats())
    with_callers, without_callers = CollectorRegistry(), CollectorRegistry()
    register(stats, with_callers)
    register(stats, without_callers, caller_label=False, bucket_stride=1)
    server1, thread1 = start_http_server(0, "127.0.0.1", registry=with_callers)
    server2, thread2 = start_http_server(0, "127.0.0.1", registry=without_callers)
    stop = threading.Event()
    try:
        with error_log() as errors, busy_switching():
            s1, r1 = in_thread(
                lambda: scrape_loop(f"http://127.0.0.1:{server1.server_port}/", stop, False)
            )
            s2, r2 = in_thread(
                lambda: scrape_loop(f"http://127.0.0.1:{server2.server_port}/", stop, True)
            )
            s3, r3 = in_thread(lambda: snapshot_loop(stats, stop))
            try:
                offered = await flood(hub, stats, stop, FLOOD_SECONDS)
            finally:
                stop.set()
                for t in (s1, s2, s3):
                    await asyncio.to_thread(t.join, 30)
        for r in (r1, r2, r3):
            if isinstance(r[0], BaseException):
                raise r[0]
        (scrapes1, problems1), (scrapes2, problems2), snapshots = r1[0], r2[0], r3[0]
        assert problems1 == [], problems1[:5]
        assert problems2 == [], problems2[:5]
        assert errors.lines() == [], errors.lines()[:5]
        # Enough reads overlapped the flood to mean something (a slow machine scraped 5 times
        # in the flood; each scrape was checked whole above).
        assert scrapes1 >= 3 and scrapes2 >= 3 and snapshots >= 3, (scrapes1, scrapes2, snapshots)
        assert stats.count("offered") == offered
    finally:
        stop.set()
        for server, thread in ((server1, thread1), (server2, thread2)):
            server.shutdown()
            server.server_close()
            thread.join(10)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        body: bytes = resp.read()
    return body.decode()


def offered_total(text: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "brownout_requests_offered"
        for s in fam.samples
        if s.name.endswith("_total")
    )


async def test_a_reader_never_sees_a_counter_go_back_while_callers_are_evicted() -> None:
    """Top-k caller eviction moves an evicted caller's rows into "other" (pop, then add). A
    read that copies the rows between the two misses those counts: summed over callers (in
    `snapshot()`, `count()`, a Prometheus scrape without the caller label, any dashboard's
    ``sum()``) the counter goes back, which Prometheus takes for a reset. Seen within 0.4 to
    7.6 s in probes; the loop runs until the first drop or 12 s."""
    hub = EventHub()
    stats = hub.subscribe(
        Stats(max_callers=1, caller_epoch=500, max_operations=1000, max_series=100_000)
    )
    stop = threading.Event()

    def reader(read: Callable[[], int]) -> list[tuple[int, int]]:
        drops: list[tuple[int, int]] = []
        last = 0
        while not stop.is_set() and not drops:
            n = read()
            if n < last:
                drops.append((last, n))
            last = max(last, n)
        stop.set()
        return drops

    with busy_switching():
        t1, r1 = in_thread(lambda: reader(lambda: int(stats.snapshot()["totals"]["offered"])))
        t2, r2 = in_thread(lambda: reader(lambda: stats.count("offered")))
        i = 0
        end = time.monotonic() + 12.0
        while time.monotonic() < end and not stop.is_set():
            for _ in range(600):  # a new heavy caller every 600 events: an eviction an epoch
                caller = f"h{i // 600}"
                hub.emit(
                    RequestOffered(0.0, "api", f"/op{i % 50}", Priority.CRITICAL, caller, None)
                )
                i += 1
            await asyncio.sleep(0)
        stop.set()
        for t in (t1, t2):
            await asyncio.to_thread(t.join, 30)
    for r in (r1, r2):
        if isinstance(r[0], BaseException):
            raise r[0]
    assert r1[0] == [] and r2[0] == [], f"the offered counter went back: {r1[0]} {r2[0]}"
    assert stats.callers.evictions > 10
    assert stats.count("offered") == i


async def test_observables_watched_while_two_threads_read_gauges_stay_watched() -> None:
    """`Stats.gauges()` drops dead observables by replacing the watch list; with two readers
    (a Prometheus server thread and the OTel reader, or a health endpoint calling
    `snapshot()`), one replaced the list after the loop had appended to the other's, and the
    newly watched observable was gone for good."""
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/"
    stop = threading.Event()

    def scraper() -> int:
        n = 0
        while not stop.is_set():
            get(url)
            n += 1
        return n

    def reader() -> int:
        n = 0
        while not stop.is_set():
            stats.gauges()
            n += 1
        return n

    watched = []
    try:
        with busy_switching():
            t1, r1 = in_thread(scraper)
            t2, r2 = in_thread(reader)
            for i in range(3000):
                watched.append(stats.watch_gauge("watched", {"i": str(i)}, lambda: 1.0))
                if i % 10 == 0:
                    await asyncio.sleep(0.0002)
            stop.set()
            for t in (t1, t2):
                await asyncio.to_thread(t.join, 30)
        for r in (r1, r2):
            if isinstance(r[0], BaseException):
                raise r[0]
        assert r1[0] >= 3 and r2[0] >= 3, (r1, r2)  # reads overlapped the flood (slow machines)
        seen = {labels["i"] for name, labels, _ in stats.gauges() if name == "watched"}
        assert len(seen) == len(watched), f"{len(watched) - len(seen)} watched gauges lost"
        scraped = [
            s
            for fam in text_string_to_metric_families(get(url))
            for s in fam.samples
            if s.name == "brownout_watched"
        ]
        assert len(scraped) == len(watched)
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_otel_periodic_reader_thread_collects_a_flooding_loop() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        HistogramDataPoint,
        MetricExporter,
        MetricExportResult,
        MetricsData,
        NumberDataPoint,
        PeriodicExportingMetricReader,
    )

    class ListExporter(MetricExporter):
        """Keeps every export (the SDK has no in-memory push exporter)."""

        def __init__(self) -> None:
            super().__init__()
            self.exports: list[MetricsData] = []

        def export(
            self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
        ) -> MetricExportResult:
            self.exports.append(metrics_data)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    from brownout.export._catalog import COUNTERS, STATE_COUNTERS
    from brownout.export.otel import OtelHistogramSink, OtelMetrics

    exporter = ListExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=50)
    provider = MeterProvider(metric_readers=[reader])
    hub = EventHub()
    stats = hub.subscribe(small_stats())
    OtelMetrics(stats, meter_provider=provider)
    hub.subscribe(OtelHistogramSink(meter_provider=provider))  # accepts tallies: still tallying
    stop = threading.Event()
    try:
        with error_log() as errors, busy_switching():
            offered = await flood(hub, stats, stop, FLOOD_SECONDS)
            await asyncio.to_thread(reader.force_flush)
        assert errors.lines() == [], errors.lines()[:5]
    finally:
        provider.shutdown()
    exports = exporter.exports
    # Several exports ran during the flood (5-6 in 6 s here: each collection is slow with the
    # thread switch interval at 10 us); the point is that they interleaved with it.
    assert len(exports) >= 3
    counters = {spec.otel for spec in COUNTERS} | {c[2] for c in STATE_COUNTERS}
    problems: list[str] = []
    last: dict[str, float] = {}
    for i, data in enumerate(exports):
        totals: dict[str, float] = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.data.data_points:
                        if isinstance(point, HistogramDataPoint):
                            if point.count != sum(point.bucket_counts):
                                problems.append(f"export {i}: {metric.name} count != buckets")
                            totals[metric.name] = totals.get(metric.name, 0) + point.count
                        elif isinstance(point, NumberDataPoint) and metric.name in counters:
                            totals[metric.name] = totals.get(metric.name, 0) + point.value
        for name, v in totals.items():
            if name in last and v < last[name]:
                problems.append(f"export {i}: {name} went back from {last[name]} to {v}")
        last.update(totals)
    assert problems == [], problems[:5]
    assert last["brownout.requests.offered"] == offered


async def test_bulkheads_made_on_the_loop_while_a_thread_reads() -> None:
    """A read flushes every ledger on the hub; the hub kept them in a `WeakSet`, whose
    iteration is Python code: a bulkhead's first tallied request (which makes its ledger) on
    the loop during a scrape raised "Set changed size during iteration" in the scrape."""
    hub = EventHub()
    stats = hub.subscribe(Stats())
    stop = threading.Event()

    def reader() -> int:
        n = 0
        while not stop.is_set():
            stats.count("offered")
            n += 1
        return n

    bulkheads = []
    with busy_switching():
        t, result = in_thread(reader)
        for i in range(6000):
            b = Bulkhead(f"b{i}", FixedLimit(1), events=hub)
            b.try_admit(caller="c").success()  # makes its ledger
            bulkheads.append(b)
            if i % 50 == 0:
                await asyncio.sleep(0)
        stop.set()
        await asyncio.to_thread(t.join, 30)
    if isinstance(result[0], BaseException):
        raise result[0]
    assert result[0] > 5
    assert stats.count("offered") == 6000
