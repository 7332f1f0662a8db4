"""The Prometheus collector reads Stats at scrape time (O1, O2, O3, O5, S8)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from brownout import FailClosed, FailClosedGuard, Priority, Reason, StaleCache, Stats
from brownout.events import (
    BreakerStateChanged,
    EventHub,
    RequestAdmitted,
    RequestCompleted,
    RequestOffered,
    RequestShed,
)
from brownout.export.prometheus import (
    BrownoutCollector,
    MetricsApp,
    metrics_middleware,
    register,
)


def req(cls, caller="alice", op="get", source="edge", priority=Priority.CRITICAL, **kw):
    return cls(at=0.0, source=source, operation=op, priority=priority, caller=caller, **kw)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name, **labels):
    return sum(
        v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items()
    )


@pytest.fixture
def stats_registry():
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    return stats, registry


def test_counters_histograms_and_gauges_are_exported(stats_registry):
    stats, registry = stats_registry
    for i in range(5):
        stats.emit(req(RequestOffered, remaining=1.0))
        stats.emit(req(RequestAdmitted, queue_wait=0.002 * i))
        stats.emit(req(RequestCompleted, latency=0.01, useful=True))
    stats.emit(req(RequestOffered, caller="bob", remaining=0.1))
    stats.emit(
        req(
            RequestShed,
            caller="bob",
            reason=Reason.QUEUE_FULL,
            remaining=0.1,
            queue_wait=0.0,
            false_positive=True,
        )
    )
    stats.emit(BreakerStateChanged(at=0.0, source="db", old="closed", new="open"))
    stats.watch_gauge("in_flight", {"source": "edge"}, lambda: 4)
    stats.watch_gauge("queue_oldest_age", {"source": "edge"}, lambda: 0.25)

    s = scrape(registry)
    assert value(s, "brownout_requests_offered_total") == 6
    assert value(s, "brownout_requests_offered_total", caller="alice", source="edge") == 5
    assert value(s, "brownout_requests_shed_total", reason="queue_full", caller="bob") == 1
    assert value(s, "brownout_requests_shed_false_positive_total") == 1
    assert value(s, "brownout_requests_completed_total", operation="get") == 5
    assert value(s, "brownout_success_latency_seconds_count", priority="critical") == 5
    assert value(s, "brownout_success_latency_seconds_bucket", le="+Inf") == 5
    assert value(s, "brownout_success_latency_seconds_bucket", le="0.001") == 0
    assert value(s, "brownout_success_latency_seconds_sum") == pytest.approx(0.05)
    assert value(s, "brownout_queue_wait_seconds_count", source="edge") == 5
    assert value(s, "brownout_remaining_deadline_seconds_count", source="edge") == 6
    assert value(s, "brownout_in_flight_requests", source="edge") == 4
    assert value(s, "brownout_queue_oldest_age_seconds", source="edge") == 0.25
    assert value(s, "brownout_breaker_state", source="db", state="open") == 1
    assert value(s, "brownout_breaker_state", source="db", state="closed") == 0
    assert value(s, "brownout_breaker_transitions_total", state="open") == 1
    assert value(s, "brownout_stats_series") == stats.series_count()


def test_histogram_buckets_are_cumulative_and_strided(stats_registry):
    stats, registry = stats_registry
    for ms in (1, 2, 5, 20, 50, 200, 5000):
        stats.emit(req(RequestCompleted, latency=ms / 1000, useful=True))
    s = scrape(registry)
    buckets = sorted(
        (float(dict(lab)["le"]), v)
        for (n, lab), v in s.items()
        if n == "brownout_success_latency_seconds_bucket"
    )
    assert len(buckets) == 26  # 25 of the 49 bounds (decades included), plus +Inf
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert dict(buckets)[0.1] == 5  # 1, 2, 5, 20, 50 ms
    assert buckets[-1] == (float("inf"), 7)


def test_caller_label_can_be_dropped():
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry, caller_label=False)
    stats.emit(req(RequestOffered, caller="a", remaining=None))
    stats.emit(req(RequestOffered, caller="b", remaining=None))
    s = scrape(registry)
    keys = [lab for n, lab in s if n == "brownout_requests_offered_total"]
    assert keys == [(("operation", "get"), ("priority", "critical"), ("source", "edge"))]
    assert value(s, "brownout_requests_offered_total") == 2


def test_describe_covers_everything_collect_yields():
    stats = Stats()
    stats.watch_gauge("in_flight", {"source": "x"}, lambda: 1)
    collector = BrownoutCollector(stats)
    described = {m.name for m in collector.describe()}
    collected = {m.name for m in collector.collect()}
    assert collected <= described
    registry = CollectorRegistry()
    registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(BrownoutCollector(stats))


def test_unknown_observable_gauges_are_exported_generically(stats_registry):
    stats, registry = stats_registry
    stats.watch_gauge("pool wait", {"pool-name": "db"}, lambda: 2)
    s = scrape(registry)
    assert value(s, "brownout_pool_wait", pool_name="db") == 2


def test_100k_callers_keep_the_exported_series_bounded():  # O1
    stats = Stats(max_callers=100)
    registry = CollectorRegistry()
    register(stats, registry)
    for i in range(100_000):
        stats.emit(
            req(
                RequestShed,
                caller=f"tenant-{i}",
                reason=Reason.OVERLOADED,
                remaining=None,
                queue_wait=0.0,
            )
        )
    s = scrape(registry)
    shed_series = [k for k in s if k[0] == "brownout_requests_shed_total"]
    assert len(shed_series) <= 101
    assert value(s, "brownout_requests_shed_total") == 100_000
    assert len(s) < 500


async def test_metrics_middleware_serves_metrics_and_passes_other_paths(stats_registry):
    stats, registry = stats_registry
    stats.emit(req(RequestOffered, remaining=None))

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    wrapped = metrics_middleware(app, registry=registry)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=wrapped), base_url="http://t"
    ) as client:
        r = await client.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert "brownout_requests_offered_total" in r.text
        r = await client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        assert r.text.rstrip().endswith("# EOF")
        assert (await client.get("/other")).status_code == 204


async def test_mount_metrics_on_starlette(stats_registry):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from brownout.export.prometheus import mount_metrics

    _stats, registry = stats_registry
    app = Starlette(routes=[Route("/", lambda r: PlainTextResponse("hi"))])
    mount_metrics(app, registry=registry)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        r = await client.get("/metrics")
        assert r.status_code == 200
        assert "brownout_stats_series" in r.text
        assert (await client.get("/")).text == "hi"
    assert isinstance(MetricsApp(registry), MetricsApp)


async def test_metrics_app_compresses_when_accepted_and_answers_head(stats_registry):
    """prometheus_client's handler: gzip only when the scraper accepts it, the length of
    what is sent, and HEAD with the head alone."""
    stats, registry = stats_registry
    for i in range(50):
        stats.emit(req(RequestOffered, caller=f"c{i}", remaining=None))
    app = metrics_middleware(lambda scope, receive, send: None, registry=registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        plain = await c.get("/metrics", headers={"accept-encoding": "identity"})
        assert "content-encoding" not in plain.headers
        assert int(plain.headers["content-length"]) == len(plain.content)
        async with c.stream("GET", "/metrics", headers={"accept-encoding": "gzip"}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        assert r.headers["content-encoding"] == "gzip"
        assert int(r.headers["content-length"]) == len(raw) < len(plain.content)
        assert gzip.decompress(raw) == plain.content
        head = await c.head("/metrics", headers={"accept-encoding": "identity"})
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == plain.headers["content-length"]
    off = metrics_middleware(lambda s, r, send: None, registry=registry, disable_compression=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=off), base_url="http://t") as c:
        assert "content-encoding" not in (await c.get("/metrics")).headers


@pytest.mark.looptime
async def test_stale_answers_and_fail_closed_refusals_are_counted_and_exported() -> None:
    """G1/G4, O2: `StaleServed` and `GuardFailedClosed` were emitted but no sink counted them,
    so a dashboard could not show how much content was served stale or how often
    authoritative reads failed closed."""
    hub = EventHub()
    stats = hub.subscribe(Stats())
    registry = CollectorRegistry()
    register(stats, registry)

    cache: StaleCache[str, str] = StaleCache(
        max_entries=10, fresh_for=1.0, max_staleness=60.0, name="catalog", events=hub
    )

    async def load() -> str:
        return "v"

    await cache.get("k", load)
    await asyncio.sleep(5)
    await cache.get("k", load)  # stale, within max_staleness: served, refreshed behind it
    await cache.get("k", load)  # fresh again once the refresh landed, or stale once more

    guard = FailClosedGuard("authorization", events=hub)

    async def broken() -> str:
        raise ConnectionError("down")

    for _ in range(3):
        with pytest.raises(FailClosed):
            await guard.call(broken)

    samples = scrape(registry)
    assert value(samples, "brownout_stale_served_total", source="catalog") >= 1
    assert value(samples, "brownout_stale_served_total", source="catalog") == sum(
        stats.stale_served.values()
    )
    assert (
        value(
            samples,
            "brownout_guard_failed_closed_total",
            what="authorization",
            cause="ConnectionError",
        )
        == 3
    )


def test_ledger_write_failures_are_counted_and_exported(stats_registry):
    """D6, O1: a failed ledger write was a log line only; now a counter by dependency,
    ledger and failure (the idempotency key is never a label)."""
    from brownout.events import LedgerWriteFailed

    stats, registry = stats_registry
    for key, error in (("k1", "TimeoutError"), ("k2", "TimeoutError"), ("k3", "ResponseError")):
        stats.emit(
            LedgerWriteFailed(at=0.0, source="payments", ledger="{brownout}", key=key, error=error)
        )
    samples = scrape(registry)
    name = "brownout_ledger_write_failures_total"
    assert value(samples, name, source="payments", error="TimeoutError") == 2
    assert value(samples, name, ledger="{brownout}", error="ResponseError") == 1
    assert all("key" not in dict(labels) for (n, labels) in samples if n == name)
