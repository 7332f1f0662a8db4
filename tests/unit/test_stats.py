"""Stats: goodput accounting (O1), per-hop histograms (O2), success-only latency (O3),
false-positive shedding (S8), bounded labels and series, and live gauges (O5)."""

from __future__ import annotations

import gc
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import Priority, Reason, Stats
from brownout._stats import (
    COUNTER_KINDS,
    OTHER,
    LabelCap,
    LatencyHistogram,
    TopKLabels,
    label_value,
)
from brownout.events import (
    AttemptRetried,
    BreakerStateChanged,
    DeadlineHeaderIgnored,
    DegradedModeChanged,
    EventHub,
    GuardFailedClosed,
    LimitChanged,
    OverloadLevelChanged,
    QuotaBackendChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
    RetryBudgetExhausted,
    StaleServed,
)
from brownout.testing import ManualClock

CRIT = Priority.CRITICAL


def req(cls, caller="alice", op="get", source="edge", priority=CRIT, **kw):
    return cls(
        at=kw.pop("at", 0.0), source=source, operation=op, priority=priority, caller=caller, **kw
    )


def test_every_kind_is_counted_separately_by_label():
    s = Stats()
    s.emit(req(RequestOffered, remaining=1.0))
    s.emit(req(RequestOffered, remaining=0.5, caller="bob", priority=Priority.SHEDDABLE))
    s.emit(req(RequestQueued, depth=1))
    s.emit(req(RequestAdmitted, queue_wait=0.01))
    s.emit(
        req(
            RequestShed,
            caller="bob",
            priority=Priority.SHEDDABLE,
            reason=Reason.QUEUE_FULL,
            remaining=0.5,
            queue_wait=0.0,
        )
    )
    s.emit(req(RequestExpired, stage="queue", queue_wait=0.2))
    s.emit(req(RequestCompleted, latency=0.05, useful=True))
    s.emit(req(RequestCompleted, latency=2.0, useful=False))
    s.emit(req(RequestFailed, latency=0.1, error="ValueError"))
    s.emit(req(RequestAbandoned, latency=0.3))
    s.emit(req(AttemptRetried, source="db", attempt=2, cause="unavailable", backoff=0.1))
    s.emit(req(RetryBudgetExhausted, source="db", attempt=3))

    assert s.count("offered") == 2
    assert s.count("offered", caller="bob", priority="sheddable") == 1
    assert s.count("shed", reason="queue_full", caller="bob") == 1
    assert s.count("shed_false_positive") == 0
    assert s.count("expired", reason="queue") == 1
    assert s.count("completed") == 1  # goodput
    assert s.count("completed_late") == 1  # wasted work
    assert s.count("failed", reason="ValueError") == 1
    assert s.count("abandoned") == 1
    assert s.count("retried", source="db", reason="unavailable") == 1
    assert s.count("budget_exhausted") == 1
    assert s.count("offered", source="db") == 0
    with pytest.raises(ValueError, match="unknown counter"):
        s.count("goodput")


def test_success_latency_holds_useful_successes_only():  # O3
    s = Stats()
    s.emit(req(RequestCompleted, latency=0.010, useful=True))
    s.emit(req(RequestCompleted, latency=9.0, useful=False))
    s.emit(req(RequestFailed, latency=5.0, error="E"))
    s.emit(req(RequestShed, reason=Reason.OVERLOADED, remaining=None, queue_wait=0.0))
    lat = s.latency()
    assert lat.count == 1
    assert lat.max == pytest.approx(0.010)
    assert s.latency(operation="get", priority="critical").count == 1
    assert s.latency(operation="put").count == 0


def test_queue_wait_and_remaining_deadline_are_kept_per_hop():  # O2
    s = Stats()
    s.emit(req(RequestOffered, source="edge", remaining=2.0))
    s.emit(req(RequestOffered, source="db", remaining=0.4))
    s.emit(req(RequestOffered, source="db", remaining=None))
    s.emit(req(RequestAdmitted, source="db", queue_wait=0.03))
    assert set(s.remaining_on_arrival) == {"edge", "db"}
    assert s.remaining_on_arrival["db"].count == 1
    assert s.remaining_on_arrival["db"].max == pytest.approx(0.4)
    assert s.queue_wait["db"].count == 1
    assert "edge" not in s.queue_wait


def test_false_positive_from_bulkhead_flag_and_idle_overload_manager():  # S8
    s = Stats()
    s.emit(
        req(
            RequestShed,
            source="api",
            reason=Reason.OVERLOADED,
            remaining=1.0,
            queue_wait=0.0,
            false_positive=True,
        )
    )
    # An overload manager that reports level 0 and still sheds is shedding with capacity.
    s.emit(OverloadLevelChanged(at=0.0, source="overload", old=1, new=0, signals=()))
    s.emit(
        req(RequestShed, source="overload", reason=Reason.OVERLOADED, remaining=1.0, queue_wait=0.0)
    )
    s.emit(OverloadLevelChanged(at=1.0, source="overload", old=0, new=2, signals=("lag",)))
    s.emit(
        req(RequestShed, source="overload", reason=Reason.OVERLOADED, remaining=1.0, queue_wait=0.0)
    )
    # A bulkhead at its limit sheds legitimately even while the manager is idle.
    s.emit(req(RequestShed, source="api", reason=Reason.QUEUE_FULL, remaining=1.0, queue_wait=0.0))
    assert s.count("shed") == 4
    assert s.count("shed_false_positive") == 2
    assert s.count("shed_false_positive", source="overload") == 1
    assert s.overload_level == 2


def test_label_cap_first_come():
    cap = LabelCap(2)
    assert [cap("a"), cap("b"), cap("c"), cap("a")] == ["a", "b", OTHER, "a"]
    assert len(cap) == 2
    with pytest.raises(ValueError):
        LabelCap(0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["other", "_other", "__other", "x", "x_other", "othe"]) | st.text())
)
def test_label_value_keeps_every_value_distinct_and_none_reads_as_the_overflow(
    values: list[str],
) -> None:
    """O1: the shift is one-to-one and never yields `OTHER`, so a real "other" cannot merge
    with the overflow row; a value outside the ``_*other`` family is unchanged."""
    shown = [label_value(v) for v in values]
    assert OTHER not in shown
    assert len(set(shown)) == len(set(values))
    for v, out in zip(values, shown, strict=True):
        assert out == v or (v.lstrip("_") == OTHER and out == "_" + v)


@pytest.mark.parametrize("caller_policy", ["top", "first"])
def test_a_caller_named_other_is_not_merged_with_the_overflow(caller_policy: str) -> None:
    """A real caller "other" (and "_other") keep rows of their own beside the overflow row,
    through a top-k rebalance that evicts neither, and every request is still counted."""
    s = Stats(max_callers=3, caller_policy=caller_policy, caller_epoch=50)
    for caller in ("other", "_other", "a"):
        s.emit(req(RequestOffered, caller=caller, remaining=None))
    for i in range(300):
        s.emit(req(RequestOffered, caller=("other", "_other")[i % 2], remaining=None))
        s.emit(req(RequestOffered, caller=f"newcomer{i}", remaining=None))  # the overflow
    assert s.count("offered") == 603
    assert s.count("offered", caller="_other") == 151
    assert s.count("offered", caller="__other") == 151
    assert s.count("offered", caller=OTHER) == 300
    assert {c for (_k, _s, _o, _p, c, _r) in s.rows} == {"_other", "__other", "a", OTHER}


def test_top_k_gives_a_heavy_newcomer_a_slot_and_folds_the_evicted():
    evicted: list[frozenset[str]] = []
    top = TopKLabels(3, epoch=100, on_evict=evicted.append)
    for v in ("a", "b", "c"):
        assert top(v) == v
    # "heavy" arrives after the slots are taken: "other" at first...
    assert top("heavy") == OTHER
    for _ in range(300):
        top("heavy")
        top("a")
    # ...then it out-hits the idle holders and takes a slot.
    assert top("heavy") == "heavy"
    assert "a" in top.values()
    assert evicted and evicted[0] <= {"b", "c"}
    assert len(top) == 3


def test_top_k_ignores_a_flood_of_one_shot_values():
    top = TopKLabels(10, epoch=1000)
    for i in range(10):
        top(f"steady{i}")
    for i in range(50_000):
        assert top(f"once{i}") == OTHER
        top(f"steady{i % 10}")
    assert top.values() == {f"steady{i}" for i in range(10)}
    assert top.evictions == 0


def test_evicted_callers_fold_into_other_and_totals_are_kept():
    s = Stats(max_callers=2, caller_epoch=50)
    s.emit(req(RequestOffered, caller="early1", remaining=None))
    s.emit(req(RequestOffered, caller="early2", remaining=None))
    for _ in range(200):
        s.emit(req(RequestOffered, caller="heavy", remaining=None))
    assert s.count("offered") == 202
    assert s.count("offered", caller="heavy") > 0
    assert s.count("offered", caller="early1") + s.count("offered", caller="early2") < 2
    assert s.count("offered", caller=OTHER) == 202 - s.count("offered", caller="heavy") - (
        s.count("offered", caller="early1") + s.count("offered", caller="early2")
    )


def test_100k_distinct_callers_stay_under_the_cap():  # O1 bounded
    s = Stats(max_callers=50)
    for i in range(100_000):
        s.emit(req(RequestOffered, caller=f"c{i}", remaining=1.0))
        s.emit(
            req(
                RequestShed, caller=f"c{i}", reason=Reason.QUEUE_FULL, remaining=1.0, queue_wait=0.0
            )
        )
    assert len(s.callers) <= 50
    assert s.series_count() <= 2 * 51 + 1
    assert s.count("offered") == 100_000
    assert s.count("shed") == 100_000


def test_max_series_folds_caller_then_operation():
    s = Stats(max_series=10, max_callers=1000, max_operations=1000)
    for i in range(1000):
        s.emit(req(RequestOffered, caller=f"c{i}", op=f"op{i}", remaining=None))
    assert len(s.rows) <= 12
    assert s.count("offered") == 1000
    assert s.count("offered", operation=OTHER, caller=OTHER) > 0


def test_backwards_compatible_views():
    s = Stats()
    s.emit(req(RequestOffered, source="a", remaining=None))
    s.emit(req(RequestOffered, source="b", remaining=None))
    assert s.counters == {("offered", "get", "critical", "alice", ""): 2}
    assert list(s.series()) == [(("offered", "get", "critical", "alice", ""), 2)]
    snap = s.snapshot()
    assert snap["totals"]["offered"] == 2
    assert set(snap["totals"]) == set(COUNTER_KINDS)
    s.reset()
    assert s.count("offered") == 0


class Pool:
    def __init__(self, name: str) -> None:
        self.name = name
        self.in_flight = 3

    def gauges(self):
        yield ("in_flight", {"source": self.name}, self.in_flight)
        yield ("limit", {"source": self.name}, 10)


def test_observables_are_read_at_scrape_time_and_override_events():  # O5
    s = Stats()
    s.emit(LimitChanged(at=0.0, source="api", old=5, new=8))
    pool = Pool("api")
    s.watch(pool)
    balance = [4.0]
    s.watch_gauge("retry_budget_balance", {"source": "db"}, lambda: balance[0])
    readings = {(n, tuple(sorted(lab.items()))): v for n, lab, v in s.gauges()}
    assert readings[("in_flight", (("source", "api"),))] == 3
    assert readings[("limit", (("source", "api"),))] == 10  # live value beats the event's 8
    assert readings[("retry_budget_balance", (("source", "db"),))] == 4.0
    pool.in_flight = 7
    balance[0] = 0.0
    readings = {(n, tuple(sorted(lab.items()))): v for n, lab, v in s.gauges()}
    assert readings[("in_flight", (("source", "api"),))] == 7
    assert readings[("retry_budget_balance", (("source", "db"),))] == 0.0
    s.unwatch(pool)
    assert all(n != "in_flight" for n, _, _ in s.gauges())


def test_discarded_observable_disappears_and_broken_one_is_skipped(caplog):
    s = Stats()
    s.watch(Pool("gone"))
    gc.collect()
    assert s.gauges() == []

    class Broken:
        def gauges(self):
            raise RuntimeError("boom")

    broken = Broken()
    s.watch(broken)
    s.watch(keep := Pool("kept"))
    assert {n for n, _, _ in s.gauges()} == {"in_flight", "limit"}
    assert "raised" in caplog.text
    assert keep.name == "kept"


def test_state_gauges_breakers_degraded_modes_and_header_problems():  # O2, G2
    clock = ManualClock(100.0)
    s = Stats(clock=clock)
    s.declare_degraded_mode("stale_search", 60.0)
    s.emit(
        DegradedModeChanged(
            at=100.0, source="degrade", mode="stale_search", active=True, trigger="db slow"
        )
    )
    s.emit(BreakerStateChanged(at=100.0, source="db", old="closed", new="open"))
    s.emit(
        DeadlineHeaderIgnored(
            at=100.0, source="edge", header="brownout-budget-ms", problem="malformed"
        )
    )
    clock.advance(90.0)
    g = {(n, tuple(sorted(lab.items()))): v for n, lab, v in s.gauges()}
    assert g[("degraded_mode_active", (("mode", "stale_search"),))] == 1.0
    assert g[("degraded_mode_active_seconds", (("mode", "stale_search"),))] == 90.0
    assert g[("degraded_mode_max_seconds", (("mode", "stale_search"),))] == 60.0
    assert g[("breaker_state", (("source", "db"), ("state", "open")))] == 1.0
    assert g[("breaker_state", (("source", "db"), ("state", "closed")))] == 0.0
    assert s.breaker_transitions == {("db", "open"): 1}
    assert s.headers_ignored == {("brownout-budget-ms", "malformed"): 1}
    s.emit(
        DegradedModeChanged(
            at=190.0, source="degrade", mode="stale_search", active=False, trigger="recovered"
        )
    )
    g = {(n, tuple(sorted(lab.items()))): v for n, lab, v in s.gauges()}
    assert g[("degraded_mode_active_seconds", (("mode", "stale_search"),))] == 0.0
    assert s.degraded_activations == {"stale_search": 1}


def test_histogram_quantiles_and_cumulative_shape():
    h = LatencyHistogram()
    for ms in range(1, 101):
        h.observe(ms / 1000)
    assert h.quantile(0.5) == pytest.approx(0.050, rel=0.2)
    cum = h.cumulative()
    assert cum[-1] == (float("inf"), 100)
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(cum))


@settings(max_examples=60, deadline=None)
@given(
    callers=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=600),
    cap=st.integers(min_value=1, max_value=6),
    epoch=st.integers(min_value=1, max_value=50),
)
def test_top_k_never_loses_a_count_nor_exceeds_its_cap(callers, cap, epoch):
    s = Stats(max_callers=cap, caller_epoch=epoch)
    for c in callers:
        s.emit(req(RequestOffered, caller=f"c{c}", remaining=None))
    assert s.count("offered") == len(callers)
    assert len(s.callers) <= cap
    assert len({key[3] for key in s.counters}) <= cap + 1  # the slot holders and "other"
    assert sum(s.count("offered", caller=c) for c in {key[3] for key in s.counters}) == len(callers)


def test_exception_names_do_not_fold_degraded_modes_into_other() -> None:
    """Mode names had the same cap as exception type names: after 64 distinct failures every
    later mode became "other", and one mode turning off reset the gauge of another that was
    on."""
    s = Stats(max_reasons=4)
    for i in range(10):
        s.emit(
            RequestFailed(
                at=1.0,
                source="api",
                operation="get",
                priority=Priority.CRITICAL,
                caller="c",
                latency=0.01,
                error=f"Error{i}",
            )
        )
    for mode, active in (
        ("stale_search", True),
        ("no_recommendations", True),
        ("no_recommendations", False),
    ):
        s.emit(DegradedModeChanged(at=2.0, source="degrade", mode=mode, active=active, trigger="t"))
    assert s.degraded_modes == {"stale_search": True, "no_recommendations": False}


# -- bounded: 100,000 distinct values of every label ---------------------------------------------


def test_bounded_max_series_is_a_hard_ceiling_whatever_the_labels() -> None:
    """Past ``max_series`` new rows fold the caller, then the operation, then source and
    reason: at most one row per (kind, priority) takes what comes past that, so many sources,
    priorities and exception names cannot carry the row count past the documented ceiling."""
    s = Stats(max_series=1000, max_callers=10_000, max_operations=10_000)
    reasons = list(Reason)
    for i in range(100_000):
        kw = {"caller": f"c{i}", "op": f"op{i}", "source": f"src{i % 10}"}
        p = Priority(i % 4)
        s.emit(req(RequestOffered, priority=p, remaining=None, **kw))
        s.emit(req(RequestFailed, priority=p, latency=0.1, error=f"Err{i % 64}", **kw))
        s.emit(
            req(
                RequestShed,
                priority=p,
                reason=reasons[i % len(reasons)],
                remaining=None,
                queue_wait=0.0,
                **kw,
            )
        )
    assert len(s.rows) <= 1000 + len(COUNTER_KINDS) * len(Priority)
    assert s.count("offered") == s.count("failed") == s.count("shed") == 100_000
    # private: these caches bound memory only; no public read shows their size
    assert len(s._label_cache) <= 4096
    assert len(s._activity_base) <= len(s.callers) + 1


def test_bounded_every_table_under_100k_distinct_sources_modes_and_causes() -> None:
    s = Stats(max_sources=20, max_reasons=30)
    for i in range(100_000):
        s.emit(LimitChanged(at=0.0, source=f"bh{i}", old=1, new=2))
        s.emit(BreakerStateChanged(at=0.0, source=f"dep{i}", old="closed", new="open"))
        s.emit(OverloadLevelChanged(at=0.0, source=f"om{i}", old=0, new=1, signals=("x",)))
        s.emit(DegradedModeChanged(at=0.0, source="d", mode=f"m{i}", active=True, trigger="x"))
        s.emit(QuotaBackendChanged(at=0.0, source=f"q{i}", fallback=True, detail="x"))
        s.emit(DeadlineHeaderIgnored(at=0.0, source="edge", header=f"h{i}", problem=f"p{i}"))
        s.emit(StaleServed(at=0.0, source=f"cache{i}", age=1.0, refreshing=False))
        s.emit(GuardFailedClosed(at=0.0, source="g", what=f"w{i}", cause=f"E{i}"))
        s.emit(req(RequestAdmitted, source=f"bh{i}", queue_wait=0.0))
        s.emit(req(RequestOffered, source=f"bh{i}", remaining=1.0))
        s.emit(req(RequestCompleted, op=f"op{i}", latency=0.1, useful=True))
        s.declare_degraded_mode(f"declared{i}", 60.0)
    per_source = (s.limits, s.breakers, s.overload_levels, s.quota_fallback, s.stale_served)
    assert all(len(t) <= 21 for t in per_source)
    assert len(s.breaker_transitions) <= 21
    assert len(s.queue_wait) <= 21 and len(s.remaining_on_arrival) <= 21
    assert len(s.success_latency) <= s.operations.max_values + 1
    for table in (s.degraded_modes, s.degraded_since, s.degraded_activations, s.degraded_max):
        assert len(table) <= 31
    assert len(s.headers_ignored) <= 31 * 31
    assert len(s.guard_failed_closed) <= 21 * 31
    assert len(s.gauges()) < 500


def test_bounded_hubs_a_stats_was_subscribed_to_are_forgotten_when_gone() -> None:
    s = Stats()
    for _ in range(1000):
        hub = EventHub()
        hub.subscribe(s)
        hub.unsubscribe(s)
        del hub
    gc.collect()
    keep = EventHub()
    keep.subscribe(s)
    assert len(s._hubs) <= 2  # private: the weak references to hubs show only as memory
