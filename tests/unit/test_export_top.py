"""`brownout top`: parsing the text format and rendering totals and rates (O1, O2, O5)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from brownout import Priority, Reason
from brownout.events import BreakerStateChanged, RequestCompleted, RequestOffered, RequestShed
from brownout.export.prometheus import register
from brownout.export.top import _quantile, parse, render
from brownout.stats import Stats


def req(cls, **kw):
    return cls(
        at=0.0,
        source="api",
        operation="/search",
        priority=Priority.CRITICAL,
        caller=kw.pop("caller", "alice"),
        **kw,
    )


def text_of(renderable) -> str:
    console = Console(width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_render_totals_then_rates():
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    stats.watch_gauge("in_flight", {"source": "api"}, lambda: 7)
    for _ in range(10):
        stats.emit(req(RequestOffered, remaining=1.0))
        stats.emit(req(RequestCompleted, latency=0.02, useful=True))
    stats.emit(
        req(
            RequestShed,
            caller="mallory",
            reason=Reason.QUEUE_FULL,
            remaining=1.0,
            queue_wait=0.0,
            false_positive=True,
        )
    )
    stats.emit(BreakerStateChanged(at=0.0, source="db", old="closed", new="open"))
    first = parse(generate_latest(registry).decode(), at=100.0)
    out = text_of(render(first, title="svc"))
    assert "totals since start" in out
    assert "/search" in out
    assert "mallory" in out
    assert "queue_full" in out
    assert "FALSE-POSITIVE SHEDDING: 1" in out
    assert "breakers open: db" in out
    assert "7" in out

    for _ in range(20):
        stats.emit(req(RequestOffered, remaining=1.0))
    second = parse(generate_latest(registry).decode(), at=102.0)
    out = text_of(render(second, first))
    assert "rates per second" in out
    assert " 10.0 " in out  # 20 offered in 2 s


def test_quantile_matches_prometheus_interpolation():
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert _quantile(buckets, 0.5) == 0.1
    assert abs(_quantile(buckets, 0.75) - 0.15) < 1e-9
    assert _quantile({float("inf"): 0.0}, 0.5) != _quantile({float("inf"): 0.0}, 0.5)  # NaN
