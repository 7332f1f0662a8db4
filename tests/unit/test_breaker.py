"""CircuitBreaker (R6): rates over count/time windows, jittered opening, limited probes."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import BreakerState, CircuitBreaker, Reason, Rejected, ResponseError
from brownout.events import BreakerStateChanged, Event, EventHub
from brownout.testing import ManualClock
from brownout.wire import default_is_failure


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


def run(b: CircuitBreaker, failed: bool, duration: float = 0.0) -> None:
    b.release(b.acquire(), failed=failed, duration=duration)


def test_opens_at_the_failure_rate_once_minimum_calls_are_seen() -> None:
    clock = ManualClock()
    b = CircuitBreaker(failure_rate=0.5, window=10, minimum_calls=10, clock=clock, open_jitter=0.0)
    for _ in range(9):
        run(b, failed=True)
    assert b.state is BreakerState.CLOSED  # 9 < minimum_calls
    run(b, failed=True)
    assert b.state is BreakerState.OPEN


def test_stays_closed_below_the_rate_and_the_count_window_forgets_old_calls() -> None:
    b = CircuitBreaker(failure_rate=0.5, window=10, minimum_calls=10, clock=ManualClock())
    for i in range(100):
        run(b, failed=i % 3 == 0)  # 33% failures
    assert b.state is BreakerState.CLOSED
    for _ in range(5):
        if b.state is BreakerState.CLOSED:
            run(b, failed=True)
    assert b.state is BreakerState.OPEN  # the last 10 hold >= 5 failures


def test_time_window_counts_only_recent_seconds() -> None:
    clock = ManualClock()
    b = CircuitBreaker(
        failure_rate=0.5, window=10, window_type="time", minimum_calls=4, clock=clock
    )
    for _ in range(4):
        run(b, failed=True)
        clock.advance(3.0)  # failures spread so each falls out before the rate builds
        for _ in range(4):
            run(b, failed=False)
    assert b.state is BreakerState.CLOSED
    clock.advance(10.0)  # the successes age out: a few fresh failures are the whole window
    for _ in range(4):
        run(b, failed=True)
    assert b.state is BreakerState.OPEN


def test_slow_calls_open_it_too() -> None:
    b = CircuitBreaker(
        failure_rate=1.0,
        slow_call_rate=0.5,
        slow_call_duration=1.0,
        window=4,
        minimum_calls=4,
        clock=ManualClock(),
    )
    for d in (0.1, 2.0, 0.1, 2.0):
        run(b, failed=False, duration=d)
    assert b.state is BreakerState.OPEN


def test_open_refuses_with_retry_after_until_half_open() -> None:
    clock = ManualClock()
    b = CircuitBreaker(open_for=5.0, open_jitter=0.0, clock=clock)
    b.force_open()
    clock.advance(2.0)
    with pytest.raises(Rejected) as info:
        b.acquire()
    assert info.value.reason is Reason.BREAKER_OPEN
    assert info.value.retry_after == pytest.approx(3.0)


def test_half_open_admits_only_a_few_probes_and_closes_after_they_succeed() -> None:
    clock = ManualClock()
    hub = EventHub()
    rec = hub.subscribe(Recorder())
    b = CircuitBreaker(open_for=1.0, open_jitter=0.0, half_open_probes=2, clock=clock, events=hub)
    b.force_open()
    clock.advance(1.0)
    t1 = b.acquire()
    t2 = b.acquire()
    assert b.state is BreakerState.HALF_OPEN
    with pytest.raises(Rejected):
        b.acquire()  # no wave: only 2 probes in flight
    b.release(t1, failed=False)
    with pytest.raises(Rejected):
        b.acquire()  # a success does not free a probe slot; the budget is per half-open spell
    b.release(t2, failed=False)
    assert b.state is BreakerState.CLOSED
    transitions = [(e.old, e.new) for e in rec.events if isinstance(e, BreakerStateChanged)]
    assert transitions == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_a_failed_probe_reopens() -> None:
    clock = ManualClock()
    b = CircuitBreaker(open_for=1.0, open_jitter=0.0, clock=clock)
    b.force_open()
    clock.advance(1.0)
    run(b, failed=True)
    assert b.state is BreakerState.OPEN


def test_ignored_probe_frees_its_slot() -> None:
    clock = ManualClock()
    b = CircuitBreaker(open_for=1.0, open_jitter=0.0, half_open_probes=1, clock=clock)
    b.force_open()
    clock.advance(1.0)
    probe = b.acquire()
    b.release(probe, failed=None)
    again = b.acquire()  # refused (BREAKER_OPEN) if the ignored probe still held the only slot
    assert again == probe  # the same half-open spell: the ignored probe decided nothing
    assert b.state is BreakerState.HALF_OPEN
    with pytest.raises(Rejected) as info:
        b.acquire()  # the freed slot was the only one, and it is taken again
    assert info.value.reason is Reason.BREAKER_OPEN
    b.release(again, failed=False)
    assert b.state is BreakerState.CLOSED  # the one probe that counted closed it


def test_stale_releases_from_before_a_transition_are_ignored() -> None:
    b = CircuitBreaker(window=2, minimum_calls=2, clock=ManualClock())
    old = b.acquire()
    run(b, failed=True)
    run(b, failed=True)
    assert b.state is BreakerState.OPEN
    b.release(old, failed=False)  # a call from the closed era must not count as a probe
    assert b.state is BreakerState.OPEN


def test_open_durations_are_jittered_per_instance() -> None:
    """R6: clients that opened together must not probe together."""
    clock = ManualClock()
    rng = random.Random(5)
    untils = []
    for _ in range(50):
        b = CircuitBreaker(open_for=10.0, open_jitter=0.2, clock=clock, rng=rng)
        b.force_open()
        untils.append(b.retry_after())
    assert all(8.0 <= u <= 12.0 for u in untils if u is not None)
    assert len({round(u or 0, 3) for u in untils}) > 40
    # the probes of 50 instances spread over ~4 s instead of arriving in one instant
    assert max(u or 0 for u in untils) - min(u or 0 for u in untils) > 3.0


async def test_call_uses_the_fallback_when_open() -> None:
    async def fallback(refused: Rejected) -> str:
        return f"cached ({refused.reason})"

    async def fn() -> str:
        return "live"

    b = CircuitBreaker(fallback=fallback, clock=ManualClock())
    assert await b.call(fn) == "live"
    b.force_open()
    assert await b.call(fn) == "cached (breaker_open)"


async def test_call_counts_only_failures_that_implicate_the_dependency() -> None:
    b = CircuitBreaker(window=4, minimum_calls=4, clock=ManualClock())

    async def bad_request() -> None:
        raise ResponseError(400)

    for _ in range(10):
        with pytest.raises(ResponseError):
            await b.call(bad_request)
    assert b.state is BreakerState.CLOSED  # validation errors mean the dependency is fine

    async def unavailable() -> None:
        raise ResponseError(503)

    for _ in range(2):  # 2 of the last 4 = the 50% failure rate
        with pytest.raises(ResponseError):
            await b.call(unavailable)
    assert b.state is BreakerState.OPEN


def test_default_is_failure() -> None:
    assert default_is_failure(ResponseError(503)) is True
    assert default_is_failure(TimeoutError()) is True
    assert default_is_failure(ResponseError(422)) is False
    assert default_is_failure(Rejected(Reason.QUEUE_FULL)) is None
    assert default_is_failure(Rejected(Reason.DO_NOT_RETRY)) is True


@settings(max_examples=100, deadline=None)
@given(
    outcomes=st.lists(st.tuples(st.booleans(), st.floats(0, 2)), max_size=200),
    probes=st.integers(1, 5),
)
def test_property_half_open_never_has_more_than_the_probe_limit_in_flight(
    outcomes: list[tuple[bool, float]], probes: int
) -> None:
    clock = ManualClock()
    b = CircuitBreaker(
        window=5, minimum_calls=5, open_for=1.0, half_open_probes=probes, clock=clock
    )
    in_flight: list[int] = []
    for failed, dt in outcomes:
        clock.advance(dt)
        try:
            in_flight.append(b.acquire())
        except Rejected:
            pass
        if b.state is BreakerState.HALF_OPEN:
            # private: which tokens are this half-open period's probes (tokens are opaque)
            assert sum(1 for t in in_flight if t == b._generation) <= probes
        if (len(in_flight) > 3 or failed) and in_flight:
            b.release(in_flight.pop(0), failed=failed)


def _fleet_largest_jump(open_jitter: float) -> int:
    """50 clients x 10 calls/s each, all breakers opened together by an outage that is over
    by the time they probe. Returns the largest rise, from one 100 ms slot to the next, of the
    calls reaching the dependency: how abruptly load comes back."""
    clock = ManualClock()
    rng = random.Random(11)
    fleet = [
        CircuitBreaker(
            open_for=5.0, open_jitter=open_jitter, half_open_probes=2, clock=clock, rng=rng
        )
        for _ in range(50)
    ]
    for b in fleet:
        b.force_open()
    slots = [0] * 150
    for tick in range(1, 1500):  # 15 s in 10 ms steps; each client calls every 100 ms
        clock.advance(0.01)
        for i, b in enumerate(fleet):
            if (tick + i) % 10:
                continue
            try:
                token = b.acquire()
            except Rejected:
                continue
            slots[tick // 10] += 1
            b.release(token, failed=False)
    assert slots[-2] == 50  # everyone is back to steady state by the end
    return max(b - a for a, b in itertools.pairwise(slots))


def test_fleet_recovery_is_spread_not_a_synchronized_wave() -> None:
    """R6 / T3: jittered open periods spread the fleet's return over seconds; without jitter
    every instance probes in the same instant and load jumps from nothing to full."""
    assert _fleet_largest_jump(open_jitter=0.0) >= 40
    assert _fleet_largest_jump(open_jitter=0.2) <= 8  # ~50 clients over ~40 slots


def test_server_errors_count_as_failures_but_validation_errors_do_not() -> None:
    from brownout import ResponseError
    from brownout.wire import default_is_failure

    assert default_is_failure(ResponseError(status=500)) is True
    assert default_is_failure(ResponseError(status=503)) is True
    assert default_is_failure(ResponseError(grpc_code="INTERNAL")) is True
    assert default_is_failure(ResponseError(status=404)) is False
    assert default_is_failure(ResponseError(status=422)) is False
    assert default_is_failure(ResponseError(grpc_code="FAILED_PRECONDITION")) is False


# -- R6: breaker configuration ---------------------------------------------------------------


@pytest.mark.looptime
def test_count_breaker_with_minimum_calls_above_its_window_still_opens() -> None:
    breaker = CircuitBreaker(window=5, minimum_calls=10, clock=ManualClock())
    for _ in range(50):
        if breaker.state is BreakerState.OPEN:
            break
        breaker.release(breaker.acquire(), failed=True)
    assert breaker.state is BreakerState.OPEN


def test_the_name_comes_first_and_settings_by_keyword() -> None:
    # CircuitBreaker("inventory") failed with a TypeError from a comparison: the first
    # parameter was failure_rate. Now it is the name, as in Bulkhead and Dependency.
    assert CircuitBreaker("inventory").name == "inventory"
    with pytest.raises(TypeError, match="first argument is its name"):
        CircuitBreaker(0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="failure_rate must be a number"):
        CircuitBreaker("inventory", failure_rate="half")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CircuitBreaker("inventory", 0.5)  # type: ignore[misc]
