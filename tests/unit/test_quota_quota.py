"""`Quota`: decisions, RateLimit headers, and the failure policy of a shared store
(S2 429 with Retry-After, S5 via the edge hook, F1 defined behaviour when the store fails).

The shared store here is a scripted stand-in on a ManualClock: the real Redis store is
exercised in tests/integration/test_quota_redis.py.
"""

from __future__ import annotations

import itertools
import random

import pytest

import brownout
from brownout import (
    InMemoryQuotaStore,
    Quota,
    QuotaDecision,
    QuotaStoreUnavailable,
    Reason,
    Rejected,
    Stats,
)
from brownout._quota import GcraOutcome, GcraPolicy
from brownout.events import Event, EventHub, QuotaBackendChanged
from brownout.testing import ManualClock


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


class ScriptedStore:
    """A shared store whose health the test controls; when up it is an in-memory store."""

    shared = True

    def __init__(self, clock: ManualClock, timeout: float = 0.05) -> None:
        self.inner = InMemoryQuotaStore(clock=clock)
        self.timeout = timeout
        self.up = True
        self.calls = 0
        self.budgets: list[float | None] = []

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        self.calls += 1
        self.budgets.append(budget)
        if budget is not None and budget <= 0:
            raise QuotaStoreUnavailable("no time left", timed_out=True)
        if not self.up:
            raise QuotaStoreUnavailable("connection refused")
        return self.inner.decide_now(key, policy, cost)


def make(
    on_failure: str = "open", instances: int = 4
) -> tuple[Quota, ScriptedStore, ManualClock, ListSink]:
    clock = ManualClock(1000.0)
    store = ScriptedStore(clock)
    events = EventHub()
    sink = ListSink()
    events.subscribe(sink)
    quota = Quota(
        rate=100.0,
        burst=20,
        store=store,
        on_store_failure=on_failure,  # type: ignore[arg-type]
        expected_instances=instances,
        clock=clock,
        events=events,
        rng=random.Random(7),
    )
    return quota, store, clock, sink


async def test_in_memory_quota_refuses_with_quota_reason_and_retry_after() -> None:
    clock = ManualClock()
    quota = Quota(rate=2.0, burst=3, store=InMemoryQuotaStore(clock=clock), name="api")
    allowed = [await quota.check("caller-42") for _ in range(3)]
    assert all(d.allowed and d.backend == "local" for d in allowed)
    refused = await quota.check("caller-42")
    assert not refused.allowed
    assert refused.reason is Reason.QUOTA
    assert refused.retry_after == pytest.approx(0.5)
    assert refused.limit == 3
    assert refused.remaining == 0
    assert refused.headers() == {
        "RateLimit-Policy": '"api";q=4;w=2',
        "RateLimit": '"api";r=0;t=2',
        "Retry-After": "1",
    }
    with pytest.raises(Rejected) as caught:
        await quota.acquire("caller-42")
    assert caught.value.reason is Reason.QUOTA
    assert caught.value.retry_after == pytest.approx(0.5)
    clock.advance(0.5)
    assert (await quota.acquire("caller-42")).allowed


async def test_default_store_is_in_memory() -> None:
    quota = Quota(rate=1.0, burst=1)
    assert isinstance(quota.store, InMemoryQuotaStore)
    assert (await quota.check("a")).allowed
    assert not (await quota.check("a")).allowed


def test_headers_of_an_allowed_decision_have_no_retry_after() -> None:
    d = QuotaDecision(
        allowed=True,
        retry_after=0.0,
        limit=20,
        remaining=19,
        reset=0.01,
        reason=None,
        backend="shared",
        policy=GcraPolicy(100.0, 20),
        name="quota",
    )
    assert d.headers() == {"RateLimit-Policy": '"quota";q=100;w=1', "RateLimit": '"quota";r=19;t=1'}


@pytest.mark.parametrize(
    ("rate", "burst", "window", "quota"),
    [(100.0, 20, 1, 100), (0.1, 5, 50, 5), (1 / 3, 1, 3, 1), (2.5, 1, 1, 2), (10.0, 100, 10, 100)],
)
def test_policy_window(rate: float, burst: int, window: int, quota: int) -> None:
    from brownout._quota import policy_window

    assert policy_window(GcraPolicy(rate, burst)) == (window, quota)


async def test_shared_store_decides_while_healthy() -> None:
    quota, store, _, sink = make()
    d = await quota.check("a")
    assert d.allowed and d.backend == "shared"
    assert store.budgets == [0.05]
    assert quota.shared_decisions == 1
    assert not quota.fallback_active
    assert sink.events == []


async def test_fail_open_falls_back_to_the_local_share_and_says_so() -> None:
    quota, store, _, sink = make("open", instances=4)
    store.up = False
    decisions = [await quota.check("a") for _ in range(10)]
    assert quota.fallback_active
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 5  # burst 20 / 4
    assert all(d.backend == "fallback" for d in decisions)
    assert decisions[-1].reason is Reason.QUOTA
    assert decisions[-1].policy == GcraPolicy(25.0, 5)
    assert decisions[-1].retry_after == pytest.approx(1 / 25)
    (event,) = sink.events
    assert isinstance(event, QuotaBackendChanged)
    assert event.fallback is True
    assert event.source == "quota"
    assert "connection refused" in event.detail and "fail-open" in event.detail
    assert quota.fallback_decisions == 10
    assert store.calls == 1  # the dead store is not asked again before the backoff


async def test_fail_closed_refuses_with_a_503_reason_and_a_retry_after() -> None:
    quota, store, _, sink = make("closed")
    store.up = False
    d = await quota.check("a")
    assert not d.allowed
    assert d.backend == "closed"
    assert d.reason is Reason.DEPENDENCY_UNAVAILABLE
    assert 0.25 <= d.retry_after <= 0.5  # until the next probe (backoff 0.5 s, jittered)
    assert d.headers() == {"Retry-After": "1"}
    rejection = d.rejection()
    assert rejection.reason is Reason.DEPENDENCY_UNAVAILABLE
    assert not rejection.reason.is_quota
    assert quota.closed_refusals == 1
    assert isinstance(sink.events[0], QuotaBackendChanged)


async def test_probes_after_a_doubling_jittered_backoff_then_recovers() -> None:
    quota, store, clock, sink = make()
    store.up = False
    await quota.check("a")
    probe_times = []
    for _ in range(2000):  # 20 s of traffic at 100/s
        clock.advance(0.01)
        before = store.calls
        await quota.check("a")
        if store.calls > before:
            probe_times.append(clock.now())
    gaps = [b - a for a, b in itertools.pairwise(probe_times)]
    assert len(probe_times) < 12  # not hammered: ~1 call per backoff, not 2000
    assert all(later >= earlier * 0.5 for earlier, later in itertools.pairwise(gaps))
    assert max(gaps) <= 10.0 + 0.02  # capped
    store.up = True
    for _ in range(1100):
        clock.advance(0.01)
        if not quota.fallback_active:
            break
        await quota.check("a")
    assert not quota.fallback_active
    d = await quota.check("b")
    assert d.backend == "shared"
    assert [type(e) for e in sink.events] == [QuotaBackendChanged, QuotaBackendChanged]
    assert [e.fallback for e in sink.events if isinstance(e, QuotaBackendChanged)] == [True, False]


async def test_a_timeout_cut_short_by_the_deadline_does_not_trip_the_fallback() -> None:
    quota, store, clock, _sink = make()
    with brownout.deadline(0.01):
        d = await quota.check("a")
    assert d.backend == "shared"
    assert store.budgets[-1] is not None and store.budgets[-1] <= 0.01  # deadline bounds it
    store.budgets.clear()

    class Slow(ScriptedStore):
        async def decide(
            self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
        ) -> GcraOutcome:
            raise QuotaStoreUnavailable("slow", timed_out=True)

    quota2 = Quota(100.0, 20, store=Slow(clock), clock=clock, events=EventHub())
    with brownout.deadline(0.001):
        d = await quota2.check("a")
    assert d.backend == "fallback"
    assert not quota2.fallback_active  # the request's own deadline, not the store's fault
    d = await quota2.check("a")  # no deadline: the full store timeout ran out
    assert quota2.fallback_active


async def test_the_store_gets_at_most_half_of_the_remaining_time() -> None:
    quota, store, _clock, _sink = make()
    with brownout.deadline(0.04):
        await quota.check("a")
    assert store.budgets[-1] is not None and 0.015 < store.budgets[-1] <= 0.02
    with brownout.deadline(1.0):
        await quota.check("a")
    assert store.budgets[-1] == 0.05  # never more than the store's own timeout


async def test_deadline_cut_timeouts_add_up_to_an_outage() -> None:
    """Issue 24: with every request's deadline shorter than the store's timeout, a stalled
    store was never counted against: each timeout was "the request's own". Now they add up:
    once they have waited as long as the timeout since the store last answered, it is down."""
    clock = ManualClock(1000.0)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)

    class Stalled(ScriptedStore):
        async def decide(
            self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
        ) -> GcraOutcome:
            self.calls += 1
            self.budgets.append(budget)
            if self.up:
                return self.inner.decide_now(key, policy, cost)
            raise QuotaStoreUnavailable("stalled", timed_out=True)

    store = Stalled(clock)
    quota = Quota(100.0, 20, store=store, clock=clock, events=events, rng=random.Random(1))
    store.up = False
    for _ in range(2):  # 2 x 20 ms < 50 ms
        with brownout.deadline(0.04):
            assert (await quota.check("a")).backend == "fallback"
    assert not quota.fallback_active and quota.store_failures == 2
    store.up = True  # an answer: what was waited before it no longer counts
    assert (await quota.check("a")).backend == "shared"
    store.up = False
    for _ in range(2):
        with brownout.deadline(0.04):
            await quota.check("a")
    assert not quota.fallback_active
    with brownout.deadline(0.04):
        await quota.check("a")  # 3 x 20 ms >= 50 ms
    assert quota.fallback_active and quota.store_failures == 5
    assert [type(e) for e in sink.events] == [QuotaBackendChanged]
    calls = store.calls
    with brownout.deadline(0.04):
        assert (await quota.check("a")).backend == "fallback"
    assert store.calls == calls  # down: decided locally, the store is not asked


async def test_a_probe_cut_short_by_its_deadline_still_backs_off() -> None:
    quota, store, clock, _sink = make()
    store.up = False
    await quota.check("a")
    assert quota.fallback_active
    clock.advance(1.0)  # a probe is due

    async def stalled(
        key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        store.calls += 1
        raise QuotaStoreUnavailable("stalled", timed_out=True)

    store.decide = stalled  # type: ignore[method-assign]
    with brownout.deadline(0.01):
        await quota.check("a")
    calls = store.calls
    for _ in range(10):  # every later request would probe again, each losing half its time
        with brownout.deadline(0.01):
            await quota.check("a")
    assert store.calls == calls


async def test_a_store_of_your_own_that_ignores_its_budget_is_bounded_anyway() -> None:
    """Found with issue 24: the quota awaited a custom shared store with no bound of its own,
    trusting it to honour ``budget``; one that hangs held the request for ever."""
    import asyncio

    class Hangs(ScriptedStore):
        async def decide(
            self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
        ) -> GcraOutcome:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    quota = Quota(100.0, 20, store=Hangs(ManualClock(), timeout=0.02), events=EventHub())
    async with asyncio.timeout(1.0):
        with brownout.deadline(0.02):
            d = await quota.check("a")
            left = brownout.remaining()
        assert d.backend == "fallback" and left is not None and left > 0.005
        d = await quota.check("a")  # the store's full timeout
    assert d.backend == "fallback" and quota.fallback_active


async def test_stats_sink_shows_the_fallback_as_a_gauge() -> None:
    clock = ManualClock(1000.0)
    store = ScriptedStore(clock)
    events = EventHub()
    stats = events.subscribe(Stats())
    quota = Quota(rate=100.0, burst=20, store=store, clock=clock, events=events)
    store.up = False
    await quota.check("a")
    assert stats.quota_fallback == {"quota": True}


async def test_for_edge_adapts_the_quota_to_a_classification() -> None:
    class Classification:
        caller = "tenant-7"
        operation = "export"

    quota = Quota(rate=1.0, burst=2, store=InMemoryQuotaStore(clock=ManualClock()))
    per_caller = quota.for_edge(key=lambda c: c.caller)
    assert (await per_caller(Classification())).allowed
    per_op = quota.for_edge(key=lambda c: f"{c.caller}:{c.operation}", cost=lambda c: 2)
    d = await per_op(Classification())
    assert d.allowed and d.remaining == 0
    assert not (await per_op(Classification())).allowed
    assert (await per_caller(Classification())).remaining == 0


def test_for_edge_has_no_default_caller_and_declares_it_needs_a_classifier() -> None:
    """Issue 24: ``for_edge()`` keyed every request by its classified caller, which is
    ``"unknown"`` for all of them without a classifier: one caller's burst got every other
    caller a 429. The key is now an explicit part of building the hook, and a per-caller hook
    says that it needs a classifier (the edge refuses it without one)."""
    quota = Quota(rate=1.0, burst=2, store=InMemoryQuotaStore(clock=ManualClock()))
    with pytest.raises(TypeError):
        quota.for_edge()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        quota.for_edge(key="caller")  # type: ignore[arg-type]
    assert quota.for_edge(key=lambda c: c.caller).requires_classifier
    shared = quota.for_edge(key=lambda c: c.operation, per_caller=False)
    assert not shared.requires_classifier


@pytest.mark.parametrize(
    "kwargs",
    [
        {"on_store_failure": "maybe"},
        {"expected_instances": 0},
        {"probe_backoff": 0.0},
        {"probe_backoff": 5.0, "max_probe_backoff": 1.0},
        {"name": 'a"b'},
        {"name": ""},
    ],
)
def test_invalid_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Quota(1.0, 1, **kwargs)  # type: ignore[arg-type]


async def test_bounded_the_fail_open_fallback_store_under_100k_keys() -> None:
    """While the shared store is down, every key is decided by the local fallback store:
    bounded by ``fallback_max_keys`` however many distinct keys arrive."""
    clock = ManualClock(1000.0)
    store = ScriptedStore(clock)
    store.up = False
    quota = Quota(
        rate=0.001, burst=1, store=store, fallback_max_keys=500, clock=clock, events=EventHub()
    )
    for i in range(100_000):
        assert (await quota.check(f"tenant-{i}")).allowed
        clock.advance(1e-5)
    assert quota.fallback_active
    assert len(quota._fallback) <= 500  # private: keys held in memory show nowhere public
    assert len(store.inner) == 0
