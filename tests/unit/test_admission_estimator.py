"""Per-operation latency estimates (D7) and the bulkhead's accounting in Stats (O1, S8)."""

from __future__ import annotations

import asyncio

import pytest

from brownout import Bulkhead, Deadline, Priority, Rejected, Stats
from brownout.events import EventHub
from brownout.limits import FixedLimit, LatencyEstimator
from brownout.queues import FifoQueue


def test_estimate_needs_min_samples_then_tracks_the_mean() -> None:
    est = LatencyEstimator(alpha=0.5, min_samples=3)
    est.observe("op", 0.1)
    est.observe("op", 0.1)
    assert est.estimate("op") is None
    est.observe("op", 0.1)
    assert est.estimate("op") == pytest.approx(0.1)
    for _ in range(20):
        est.observe("op", 0.3)
    assert est.estimate("op") == pytest.approx(0.3, rel=1e-3)
    assert est.estimate("unknown") is None


def test_k_widens_by_deviation() -> None:
    est = LatencyEstimator(alpha=0.2, k=2.0, min_samples=1)
    for i in range(200):
        est.observe("op", 0.1 if i % 2 else 0.3)
    estimate = est.estimate("op")
    assert estimate is not None and estimate > 0.3


def test_operations_are_bounded() -> None:
    est = LatencyEstimator(max_operations=3, min_samples=1)
    for i in range(10):
        est.observe(f"op{i}", 0.1)
    assert len(est) == 3
    assert est.operations() == ["op7", "op8", "op9"]
    with pytest.raises(ValueError):
        LatencyEstimator(alpha=0)


@pytest.mark.parametrize("min_samples", [1, 5])
def test_bounded_one_off_operations_cannot_push_out_the_estimates_in_use(min_samples: int) -> None:
    """D7 under input-derived operation names: 100,000 operations seen once each (a scan of
    distinct URLs labelled by raw path) churn among themselves; the operations the service
    keeps serving keep their estimates, and memory stays at ``max_operations``."""
    e = LatencyEstimator(min_samples=min_samples, max_operations=16)
    for _ in range(10):
        e.observe("/orders/{id}", 0.2)
        e.observe("/search", 0.05)
    for i in range(100_000):
        e.observe(f"/scan/{i}", 0.01)
        if i % 1000 == 0:
            e.observe("/search", 0.05)  # still in use, now and then
        assert len(e) <= 16 and len(e.estimates) <= 16
    assert e.estimate("/orders/{id}") == pytest.approx(0.2)
    assert e.estimate("/search") == pytest.approx(0.05)
    assert set(e.estimates) <= set(e.operations())


def test_established_operations_go_least_recently_observed_first() -> None:
    e = LatencyEstimator(min_samples=1, max_operations=3)
    for op in ("a", "b", "c", "a", "b", "c"):
        e.observe(op, 0.1)  # all three established (two samples each)
    e.observe("a", 0.1)  # a is now the most recently observed
    e.observe("d", 0.1)  # no operation on trial: the least recently observed (b) goes
    assert e.operations() == ["c", "a", "d"]
    assert e.estimate("b") is None and e.estimate("d") == pytest.approx(0.1)
    e.observe("e", 0.1)  # d is on trial: it goes first
    assert e.operations() == ["c", "a", "e"]


@pytest.mark.looptime
async def test_bulkhead_decisions_are_counted_in_stats() -> None:
    events = EventHub()
    stats = Stats()
    events.subscribe(stats)
    b = Bulkhead("db", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.5), events=events)

    async def work(priority: Priority, seconds: float) -> None:
        async with b.admit(priority=priority, operation="q", caller="web"):
            await asyncio.sleep(seconds)

    results = await asyncio.gather(
        work(Priority.CRITICAL, 1.0),  # runs
        work(Priority.SHEDDABLE, 0.1),  # queues, then times out after 0.5 s
        work(Priority.SHEDDABLE, 0.1),  # queue full
        return_exceptions=True,
    )
    assert [type(r) for r in results] == [type(None), Rejected, Rejected]
    async with b.admit(operation="q", deadline=Deadline.after(2.0)):
        await asyncio.sleep(0.1)
    assert stats.count("offered") == 4
    assert stats.count("admitted") == 2
    assert stats.count("queued") == 1
    assert stats.count("shed", reason="queue_timeout", priority="sheddable") == 1
    assert stats.count("shed", reason="queue_full") == 1
    assert stats.count("shed_false_positive") == 0  # S8
    assert stats.count("completed", operation="q", caller="web") == 1
    assert stats.count("completed") == 2
    assert stats.latency(operation="q").count == 2


def test_bounded_100k_operations_keep_max_operations_estimates() -> None:
    """Operations named from input (a classifier that uses the raw path): at most
    ``max_operations`` are tracked, and estimates leave with them."""
    e = LatencyEstimator(min_samples=1, max_operations=256)
    for i in range(100_000):
        e.observe(f"/items/{i}", 0.01)
        assert len(e) <= 256 and len(e.estimates) <= 256
    assert set(e.estimates) == set(e.operations())


async def test_bounded_a_bulkheads_estimator_under_100k_operations() -> None:
    b = Bulkhead("api", FixedLimit(4), estimate_every=1)
    for i in range(100_000):
        async with b.admit(operation=f"/items/{i}"):
            pass
    assert b.estimator is not None
    assert len(b.estimator) <= b.estimator.max_operations
