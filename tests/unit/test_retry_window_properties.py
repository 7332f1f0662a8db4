"""Property tests of the windowed retry primitives, on virtual time (`ManualClock`, no sleeps).

* `SlidingCounters`: its sums equal a brute-force recount of what was added in the last
  ``window`` seconds at its bucket resolution, and a jump past the window leaves nothing.
* `CircuitBreaker(window_type="time")`: a reference model of the documented rules (minimum
  calls, failure and slow-call rates, jittered open period, limited half-open probes, stale
  releases ignored) is run side by side with the breaker, step by step.
* `ClientThrottle`: every decision uses ``max(0, (requests - K * accepts) / (requests + 1))``
  over a brute-force recount of the window, and the probability stays within [0, 1].
* `GrpcRetryThrottle`: token arithmetic against gRFC A6 in exact thousandths.
* `DecorrelatedJitterBackoff` and `ExponentialBackoff`: bounds and determinism with a seeded
  random source.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout import (
    BreakerState,
    CircuitBreaker,
    ClientThrottle,
    DecorrelatedJitterBackoff,
    ExponentialBackoff,
    GrpcRetryThrottle,
    Reason,
    Rejected,
)
from brownout._retry.window import SlidingCounters
from brownout.events import EventHub
from brownout.testing import ManualClock

QUIET = EventHub()  # no subscribers: decisions are checked through the objects themselves

# Time steps: none, sub-slice, around a slice, across a window, and hours.
STEPS = st.one_of(
    st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 1.0]),
    st.floats(0.0, 15.0),
    st.sampled_from([3599.5, 3600.0, 7200.0, 86_400.0]),
)


T = TypeVar("T")


def attempt(fn: Callable[[], T]) -> tuple[T | None, Rejected | None]:
    """``fn()``'s result, or the `Rejected` it raised."""
    try:
        return fn(), None
    except Rejected as refused:
        return None, refused


# -- SlidingCounters ------------------------------------------------------------------------


def recount(
    log: list[tuple[float, int, int]], now: float, width: int, window: float, buckets: int
) -> list[int]:
    """What the window should hold: additions whose slice is one of the last ``buckets``,
    except a slice whose newest addition was a whole window old (``t + window``, which
    ``now // slice`` can miss by a rounding) at a later addition or now: it is forgotten."""
    slice_ = window / buckets
    alive: dict[int, list[tuple[int, int]]] = {}  # slice -> (index, amount)
    newest: dict[int, float] = {}

    def forget(at: float) -> None:
        for k in [k for k, t in newest.items() if at >= t + window]:
            del alive[k], newest[k]

    for t, index, amount in log:
        forget(t)
        k = int(t // slice_)
        alive.setdefault(k, []).append((index, amount))
        newest[k] = t
    forget(now)
    head = int(now // slice_)
    sums = [0] * width
    for k, entries in alive.items():
        if head - k < buckets:
            for index, amount in entries:
                sums[index] += amount
    return sums


@settings(max_examples=200, deadline=None)
@given(
    width=st.integers(1, 3),
    window=st.sampled_from([0.5, 1.0, 3.0, 10.0, 120.0]) | st.floats(0.01, 200.0),
    buckets=st.integers(1, 12),
    start=st.sampled_from([0.0, 12345.678]) | st.floats(0.0, 1e6),
    ops=st.lists(
        st.tuples(
            # in slices: within one, onto an edge, a few, about a window, or hours (scaled)
            st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0]) | st.floats(0.0, 14.0) | st.just(1e5),
            st.integers(0, 2),
            st.integers(-3, 5),
            st.booleans(),
        ),
        min_size=5,
        max_size=60,
    ),
)
# A count a whole window old by the clock (100 + 1/3 + 1/3) that ``now // slice`` keeps.
@example(
    width=1,
    window=1 / 3,
    buckets=1,
    start=100.0,
    ops=[
        (1.0, 0, 1, False),
        (1.0, 0, 0, True),
        (0.0, 0, 0, True),
        (0.5, 0, 2, False),
        (0.5, 0, 0, True),
    ],
)
def test_sliding_counters_equal_a_recount_of_the_last_window(
    width: int,
    window: float,
    buckets: int,
    start: float,
    ops: list[tuple[float, int, int, bool]],
) -> None:
    """The sums are the additions of the last ``buckets`` slices, current one included; so
    nothing older than ``window`` seconds and everything younger than ``window - slice``
    seconds is in them (the class docstring), however time moves (hours at a time too)."""
    clock = ManualClock(start)
    counters = SlidingCounters(width, window=window, buckets=buckets, clock=clock)
    slice_ = window / buckets
    log: list[tuple[float, int, int]] = []
    for steps, index, amount, read_only in ops:
        clock.advance(steps * slice_)
        now = clock.now()
        if not read_only:
            index %= width
            counters.add(index, amount)
            log.append((now, index, amount))
        sums = counters.sums()
        assert sums == recount(log, now, width, window, buckets), (now, log)
        assert counters.totals == sums
        # The recount's resolution is the documented one, in seconds (a hair of float
        # slack at the slice edges): what is younger than ``window - slice`` is counted,
        # what is ``window`` old or older is not.
        eps = 1e-9 * max(1.0, abs(now))
        head = int(now // slice_)
        for t, _, _ in log:
            counted = head - int(t // slice_) < buckets
            if now - t < window - slice_ - eps:
                assert counted
            if now - t >= window + eps:
                assert not counted


@settings(max_examples=200, deadline=None)
@given(
    window=st.sampled_from([1.0, 10.0, 120.0]) | st.floats(0.01, 100.0),
    buckets=st.integers(1, 12),
    history=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(-3, 5)), max_size=30),
    jump=st.floats(0.0, 3.0) | st.sampled_from([3600.0, 10 * 3600.0]),
    fresh=st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(-3, 5)), max_size=20),
)
# Found by Hypothesis: 100 + 1/3 + 1/3 rounds so that ``now // slice`` is still the index of
# the slice the count went into, although the clock moved a whole window since.
@example(window=1 / 3, buckets=1, history=[(1 / 3, 1)], jump=0.0, fresh=[])
# The same with several slices: ``now // slice`` moves one slice short of a whole window.
@example(window=1 / 3, buckets=3, history=[(1 / 3, 1)], jump=0.0, fresh=[])
def test_sliding_counters_forget_everything_after_a_jump_past_the_window(
    window: float,
    buckets: int,
    history: list[tuple[float, int]],
    jump: float,
    fresh: list[tuple[float, int]],
) -> None:
    """After time moves on by a whole window (or hours) the counters behave exactly like new
    ones created at that moment: no stale slice survives to be counted later."""
    clock = ManualClock(100.0)
    old = SlidingCounters(1, window=window, buckets=buckets, clock=clock)
    for dt, amount in history:
        clock.advance(dt)
        old.add(0, amount)
    clock.advance(window + jump)
    assert old.sums() == [0]
    new = SlidingCounters(1, window=window, buckets=buckets, clock=clock)
    for dt, amount in fresh:
        clock.advance(dt)
        old.add(0, amount)
        new.add(0, amount)
        assert old.sums() == new.sums()


# -- CircuitBreaker, time window: a reference model -----------------------------------------

OUTCOMES = {
    # name: (failed, duration)
    "ok": (False, 0.0),
    "fail": (True, 0.0),
    "slow": (False, 1.5),
    "slow_fail": (True, 1.5),
    "ignored": (None, 0.0),
}


@dataclass
class BreakerModel:
    """The rules of the `CircuitBreaker` docstring, written out with exact rates."""

    window: int
    minimum_calls: int
    failure_rate: Fraction
    slow_call_rate: Fraction
    slow_call_duration: float | None
    open_for: float
    open_jitter: float
    probes: int
    rng: random.Random
    state: BreakerState = BreakerState.CLOSED
    epoch: int = 0
    until: float = 0.0
    in_flight: int = 0
    successes: int = 0
    outcomes: list[tuple[float, bool, bool]] = field(default_factory=list)

    def in_window(self, now: float) -> list[tuple[float, bool, bool]]:
        """Outcomes in the last ``window`` one-second slices (the current one included)."""
        return [o for o in self.outcomes if math.floor(now) - math.floor(o[0]) < self.window]

    def transition(self, new: BreakerState) -> None:
        self.state = new
        self.epoch += 1
        self.in_flight = 0
        self.successes = 0
        if new is BreakerState.CLOSED:
            self.outcomes = []

    def open(self, now: float) -> None:
        j = self.open_jitter
        factor = 1.0 + self.rng.uniform(-j, j) if j else 1.0
        assert 1.0 - j <= factor <= 1.0 + j
        self.until = now + self.open_for * factor
        self.transition(BreakerState.OPEN)

    def acquire(self, now: float) -> tuple[int | None, float | None]:
        """(token, None) when admitted, else (None, retry_after)."""
        if self.state is BreakerState.CLOSED:
            return self.epoch, None
        if self.state is BreakerState.OPEN:
            if now < self.until:
                return None, self.until - now
            self.transition(BreakerState.HALF_OPEN)
        if self.in_flight + self.successes >= self.probes:
            return None, None
        self.in_flight += 1
        return self.epoch, None

    def release(self, now: float, token: int, failed: bool | None, duration: float) -> None:
        if token != self.epoch:
            return
        slow = self.slow_call_duration is not None and duration >= self.slow_call_duration
        if self.state is BreakerState.CLOSED:
            if failed is None:
                return
            self.outcomes.append((now, failed, slow))
            seen = self.in_window(now)
            calls = len(seen)
            failures = sum(1 for o in seen if o[1])
            slows = sum(1 for o in seen if o[2])
            if calls >= self.minimum_calls and (
                Fraction(failures, calls) >= self.failure_rate
                or Fraction(slows, calls) >= self.slow_call_rate
            ):
                self.open(now)
            return
        self.in_flight -= 1
        if failed is None:
            return
        if failed or slow:
            self.open(now)
            return
        self.successes += 1
        if self.successes >= self.probes:
            self.transition(BreakerState.CLOSED)


@st.composite
def breaker_configs(draw: st.DrawFn) -> dict[str, object]:
    return {
        "window": draw(st.integers(1, 10)),
        "minimum_calls": draw(st.integers(0, 12)),
        "failure_pct": draw(st.sampled_from([50, 100]) | st.integers(1, 100)),
        "slow_pct": draw(st.sampled_from([50, 100]) | st.integers(1, 100)),
        "slow_call_duration": draw(st.sampled_from([None, 1.0])),
        "open_for": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.0, 30.0)),
        "open_jitter": draw(st.sampled_from([0.0, 0.2]) | st.floats(0.0, 0.9)),
        "probes": draw(st.integers(1, 4)),
        "seed": draw(st.integers(0, 2**16)),
        "start": draw(st.sampled_from([0.0, 0.5, 1e5 + 0.75])),
    }


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("tick"), STEPS),
        st.tuples(st.just("acquire"), st.just(0.0)),
        # release the outstanding token at this index (mod their number) with this outcome
        st.tuples(st.sampled_from(sorted(OUTCOMES)), st.integers(0, 7).map(float)),
        # acquire and, when admitted, release at once with this outcome
        st.tuples(st.sampled_from(sorted(OUTCOMES)), st.just(-1.0)),
        st.tuples(st.sampled_from(["reset", "force_open"]), st.just(0.0)),
    ),
    min_size=10,
    max_size=100,
)


@settings(max_examples=250, deadline=None)
@given(cfg=breaker_configs(), ops=OPS)
def test_time_window_breaker_follows_its_documented_rules(
    cfg: dict[str, object], ops: list[tuple[str, float]]
) -> None:
    """Step by step the breaker agrees with the model on state, tokens, refusals and
    retry-after: it never opens before ``minimum_calls`` outcomes are in the last ``window``
    seconds, opens on the release that makes a rate reach its threshold, refuses while open,
    lets at most ``half_open_probes`` probes through, reopens on a failed or slow probe and
    closes (forgetting the window) after that many successes; stale tokens are ignored."""
    window = int(cfg["window"])  # type: ignore[call-overload]
    failure_pct = int(cfg["failure_pct"])  # type: ignore[call-overload]
    slow_pct = int(cfg["slow_pct"])  # type: ignore[call-overload]
    seed = int(cfg["seed"])  # type: ignore[call-overload]
    probes = int(cfg["probes"])  # type: ignore[call-overload]
    minimum = int(cfg["minimum_calls"])  # type: ignore[call-overload]
    open_for = float(cfg["open_for"])
    jitter = float(cfg["open_jitter"])
    slow_d = cfg["slow_call_duration"]
    assert slow_d is None or isinstance(slow_d, float)
    clock = ManualClock(float(cfg["start"]))
    breaker = CircuitBreaker(
        failure_rate=failure_pct / 100,
        window=window,
        window_type="time",
        minimum_calls=minimum,
        slow_call_rate=slow_pct / 100,
        slow_call_duration=slow_d,
        open_for=open_for,
        open_jitter=jitter,
        half_open_probes=probes,
        rng=random.Random(seed),
        clock=clock,
        events=QUIET,
    )
    model = BreakerModel(
        window,
        minimum,
        Fraction(failure_pct, 100),
        Fraction(slow_pct, 100),
        slow_d,
        open_for,
        jitter,
        probes,
        random.Random(seed),
    )
    tokens: list[int] = []
    for op, arg in ops:
        now = clock.now()
        before = breaker.state
        if op == "tick":
            clock.advance(arg)
        elif op == "reset":
            breaker.reset()
            model.transition(BreakerState.CLOSED)
        elif op == "force_open":
            breaker.force_open()
            model.open(now)
        elif op == "acquire" or arg < 0:
            expected, retry_after = model.acquire(now)
            token, refused = attempt(breaker.acquire)
            if refused is not None:
                assert expected is None, ("refused", model)
                assert refused.reason is Reason.BREAKER_OPEN
                assert refused.retry_after == retry_after
            else:
                assert token == expected, ("admitted", model)
                tokens.append(token)
                if arg < 0:  # a call: its outcome comes back at once
                    failed, duration = OUTCOMES[op]
                    model.release(now, tokens.pop(), failed, duration)
                    breaker.release(token, failed=failed, duration=duration)
        elif tokens:
            token = tokens.pop(int(arg) % len(tokens))
            failed, duration = OUTCOMES[op]
            model.release(now, token, failed, duration)
            breaker.release(token, failed=failed, duration=duration)
        if (
            op != "force_open"
            and before is BreakerState.CLOSED
            and breaker.state is BreakerState.OPEN
        ):
            # Opened by an outcome: the recount holds minimum_calls and a reached rate.
            seen = model.in_window(now)
            assert len(seen) >= minimum, (seen, minimum)
            assert 100 * sum(o[1] for o in seen) >= failure_pct * len(seen) or (
                100 * sum(o[2] for o in seen) >= slow_pct * len(seen)
            )
        assert breaker.state is model.state, (op, arg, model)
        assert breaker.retry_after() == (
            max(0.0, model.until - clock.now()) if model.state is BreakerState.OPEN else None
        )
        if model.state is BreakerState.HALF_OPEN:
            probing = sum(1 for t in tokens if t == model.epoch)
            assert probing == model.in_flight <= probes


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 10),
    minimum=st.integers(2, 6),
    start=st.floats(0.0, 1e4),
    later=st.floats(0.0, 12.0) | st.integers(0, 12).map(float),
)
def test_time_window_breaker_counts_an_outcome_for_window_one_second_slices(
    window: int, minimum: int, start: float, later: float
) -> None:
    """The window is ``window`` one-second slices: ``minimum - 1`` failures at ``start`` and
    one more ``later`` seconds on open the breaker iff they share the last ``window`` slices,
    i.e. ``floor(start + later) - floor(start) < window`` (so never after ``window`` seconds,
    always within ``window - 1``)."""
    clock = ManualClock(start)
    b = CircuitBreaker(
        failure_rate=1.0,
        window=window,
        window_type="time",
        minimum_calls=minimum,
        clock=clock,
        events=QUIET,
    )
    for _ in range(minimum - 1):
        b.release(b.acquire(), failed=True)
    clock.advance(later)
    b.release(b.acquire(), failed=True)
    together = math.floor(clock.now()) - math.floor(start) < window
    assert (b.state is BreakerState.OPEN) is together
    if clock.now() - start < window - 1:
        assert together


@settings(max_examples=100, deadline=None)
@given(
    window=st.integers(1, 10),
    minimum=st.integers(1, 15),
    history=st.lists(st.tuples(st.floats(0.0, 2.0), st.booleans()), max_size=20),
    jump=st.sampled_from([0.0, 0.999, 3600.0, 5 * 3600.0]),
    fresh=st.lists(st.tuples(st.floats(0.0, 0.3), st.booleans()), max_size=20),
)
def test_time_window_breaker_forgets_outcomes_older_than_its_window(
    window: int,
    minimum: int,
    history: list[tuple[float, bool]],
    jump: float,
    fresh: list[tuple[float, bool]],
) -> None:
    """Once the clock has moved ``window`` seconds (or hours) past the last outcome, a breaker
    that is still closed decides exactly like a new one: no stale outcome opens it later."""
    clock = ManualClock(7.25)
    make = lambda: CircuitBreaker(  # noqa: E731
        failure_rate=0.5,
        window=window,
        window_type="time",
        minimum_calls=minimum,
        clock=clock,
        events=QUIET,
    )
    old = make()
    for dt, failed in history:
        clock.advance(dt)
        if old.state is BreakerState.CLOSED:
            old.release(old.acquire(), failed=failed)
    if old.state is not BreakerState.CLOSED:
        old.reset()
    clock.advance(window + jump)
    new = make()
    for dt, failed in fresh:
        clock.advance(dt)
        for b in (old, new):
            if b.state is BreakerState.CLOSED:
                b.release(b.acquire(), failed=failed)
        assert old.state is new.state


def boundary(numerator: int, denominator: int, calls: int) -> int:
    """The fewest of ``calls`` outcomes whose share reaches ``numerator / denominator``."""
    return -(-numerator * calls // denominator)


@pytest.mark.parametrize("window_type", ["time", "count"])
def test_breaker_opens_exactly_when_the_failure_rate_is_reached(window_type: str) -> None:
    """For every two-decimal failure rate and every window of up to 60 calls, ``f``
    failures out of ``calls`` open the breaker iff ``f / calls >= rate``: not one failure
    late because ``rate * calls`` rounds up (0.28 x 25 = 7.000000000000001)."""
    clock = ManualClock()
    wrong = []
    for pct in range(1, 101):
        # Every window size for the time window (the one under test here); a third of them
        # for the count window, which shares the check (keeps the file under its time box).
        for calls in range(1, 61, 1 if window_type == "time" else 3):
            need = boundary(pct, 100, calls)
            for failures in (need - 1, need):
                if not 0 <= failures <= calls:
                    continue
                b = CircuitBreaker(
                    failure_rate=pct / 100,
                    window=calls,
                    window_type=window_type,
                    minimum_calls=calls,
                    clock=clock,
                    events=QUIET,
                )
                for i in range(calls):  # failures first: the rate peaks on the last call
                    b.release(b.acquire(), failed=i < failures)
                if (b.state is BreakerState.OPEN) != (failures >= need):
                    wrong.append((pct, calls, failures, b.state.value))
    assert wrong == []


@pytest.mark.parametrize("window_type", ["time", "count"])
def test_breaker_opens_exactly_when_the_slow_call_rate_is_reached(window_type: str) -> None:
    """Same for the slow-call rate, and also when the call that completes ``minimum_calls``
    is a fast one (the failure rate opens on a success in that case too)."""
    clock = ManualClock()
    wrong = []
    for pct in range(1, 101):
        for calls in range(1, 61, 3):
            need = boundary(pct, 100, calls)
            for slows in (need - 1, need):
                if not 0 <= slows <= calls:
                    continue
                b = CircuitBreaker(
                    failure_rate=1.0,
                    window=calls,
                    window_type=window_type,
                    minimum_calls=calls,
                    slow_call_rate=pct / 100,
                    slow_call_duration=1.0,
                    clock=clock,
                    events=QUIET,
                )
                for i in range(calls):
                    b.release(b.acquire(), failed=False, duration=2.0 if i < slows else 0.0)
                if (b.state is BreakerState.OPEN) != (slows >= need):
                    wrong.append((pct, calls, slows, b.state.value))
    assert wrong == []


# -- ClientThrottle -------------------------------------------------------------------------


class ScriptedRandom(random.Random):
    """``random()`` returns the given draws in turn (then 0.5): decisions are predictable."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0) if self.draws else 0.5


@settings(max_examples=200, deadline=None)
@given(
    k=st.sampled_from([1.0, 1.5, 2.0, 3.0]) | st.floats(1.0, 10.0),
    window=st.sampled_from([1.0, 10.0, 120.0]) | st.floats(0.05, 150.0),
    buckets=st.integers(1, 60),
    ops=st.lists(
        st.tuples(st.sampled_from(["check", "check", "accept", "tick"]), STEPS), max_size=150
    ),
    draws=st.lists(st.floats(0.0, 1.0, exclude_max=True), max_size=150),
)
def test_throttle_refuses_with_the_documented_probability_over_the_window(
    k: float, window: float, buckets: int, ops: list[tuple[str, float]], draws: list[float]
) -> None:
    """Each ``check`` refuses iff its random draw is below ``max(0, (R - K * A) / (R + 1))``
    where R and A are the requests and accepts a brute-force recount finds in the window
    before this request; ``probability()`` is that value for the next check, within [0, 1];
    refused checks count as requests; history older than the window no longer counts."""
    clock = ManualClock(50.0)
    rng = ScriptedRandom(draws)
    t = ClientThrottle(k, window=window, buckets=buckets, rng=rng, clock=clock, events=QUIET)
    slice_ = window / buckets
    log: list[tuple[float, int]] = []  # (time, 0 = request / 1 = accept)

    def counts() -> tuple[int, int]:
        head = int(clock.now() // slice_)
        seen = [kind for at, kind in log if head - int(at // slice_) < buckets]
        return seen.count(0), seen.count(1)

    for op, dt in ops:
        if op == "tick":
            clock.advance(dt)
        elif op == "accept":
            t.record_accept()
            log.append((clock.now(), 1))
        else:
            requests, accepts = counts()
            p = max(0.0, (requests - k * accepts) / (requests + 1))
            assert t.probability() == p
            draw = rng.draws[0] if rng.draws else 0.5
            _, refused = attempt(t.check)
            if refused is not None:
                assert refused.reason is Reason.THROTTLED
                assert draw < p, (draw, p)
            else:
                assert draw >= p, (draw, p)
            log.append((clock.now(), 0))
        requests, accepts = counts()
        assert (t.requests, t.accepts) == (requests, accepts)
        p = t.probability()
        assert 0.0 <= p < 1.0
        assert p == max(0.0, (requests - k * accepts) / (requests + 1))


@settings(max_examples=100, deadline=None)
@given(
    k=st.floats(1.0, 5.0),
    refused_share=st.integers(0, 50),
    later=st.sampled_from([0.0, 1.0, 3600.0]),
)
def test_throttle_history_ages_out_after_one_window(
    k: float, refused_share: int, later: float
) -> None:
    """However bad the last window was, a window later the throttle sends everything again."""
    clock = ManualClock()
    t = ClientThrottle(k, window=10.0, buckets=5, rng=random.Random(1), clock=clock, events=QUIET)
    for i in range(60):
        try:
            t.check()
        except Rejected:
            pass
        if i >= refused_share:
            continue
        t.record_accept()
    clock.advance(10.0 + later)
    assert (t.requests, t.accepts, t.probability()) == (0, 0, 0.0)
    t.check()  # p = 0: never refused


@settings(max_examples=200, deadline=None)
@given(k=st.floats(allow_nan=True, allow_infinity=True))
def test_throttle_refuses_a_k_it_cannot_use(k: float) -> None:
    """K must be finite and at least 1; NaN or inf would silently switch the throttle off
    (every comparison with NaN is false, and inf * 0 accepts is NaN), so they are refused
    like any K below 1."""
    if 1.0 <= k < math.inf:
        ClientThrottle(k, clock=ManualClock())
    else:
        with pytest.raises(ValueError):
            ClientThrottle(k, clock=ManualClock())


# -- GrpcRetryThrottle (gRFC A6) ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    max_tokens=st.integers(1, 12) | st.integers(1, 1000),
    ratio_thousandths=st.sampled_from([100, 500, 1000, 1600]) | st.integers(1, 5000),
    ops=st.lists(st.sampled_from(["success", "failure", "retry?"]), min_size=5, max_size=200),
)
def test_grpc_throttle_keeps_exact_tokens_within_zero_and_max(
    max_tokens: int, ratio_thousandths: int, ops: list[str]
) -> None:
    """token_count starts at max_tokens, a failure takes 1, a success adds token_ratio, the
    count stays within [0, max_tokens], and retries are allowed iff token_count > max / 2;
    asking about a retry costs nothing. Exact, in thousandths."""
    ratio = ratio_thousandths / 1000
    t = GrpcRetryThrottle(max_tokens, ratio)
    top = Fraction(max_tokens)
    tokens = top
    for op in ops:
        if op == "success":
            t.record_success()
            tokens = min(top, tokens + Fraction(ratio_thousandths, 1000))
        elif op == "failure":
            t.record_failure()
            tokens = max(Fraction(0), tokens - 1)
        else:
            assert t.try_acquire_retry() is (tokens > top / 2)
        assert 0.0 <= t.tokens <= t.max_tokens == max_tokens
        assert Fraction(t.tokens).limit_denominator(1000) == tokens
        assert t.retry_allowed is (tokens > top / 2)


def test_grpc_throttle_adds_every_three_decimal_ratio_exactly() -> None:
    """Every ``token_ratio`` with three decimals from 0.001 to 5 is added exactly once per
    success (``x / 1000 * 1000`` is a hair below ``x`` for some of them: 1.001, 1.003, ...)."""
    wrong = []
    for thousandths in range(1, 5001):
        t = GrpcRetryThrottle(1000, thousandths / 1000)
        for _ in range(6):
            t.record_failure()
        t.record_success()
        if round(t.tokens * 1000) != 994_000 + thousandths:
            wrong.append((thousandths, t.tokens))
    assert wrong == []


# -- Backoff --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from([0.0, 0.001, 0.05]) | st.floats(0.0, 5.0),
    spread=st.floats(0.0, 100.0),
    seed=st.integers(0, 2**32),
    retries=st.integers(1, 40),
)
def test_decorrelated_chain_stays_within_base_and_cap_and_is_reproducible(
    base: float, spread: float, seed: int, retries: int
) -> None:
    """Fed back its own delays (as the policy does, starting from 0), every delay lies in
    ``[base, min(cap, max(base, 3 * previous))]``; the same seed gives the same chain, and the
    retry number does not change the draw (the backoff is stateless)."""
    cap = base + spread
    a = DecorrelatedJitterBackoff(base, cap=cap, rng=random.Random(seed))
    b = DecorrelatedJitterBackoff(base, cap=cap, rng=random.Random(seed))
    previous = 0.0
    for n in range(1, retries + 1):
        d = a.delay(n, previous)
        assert base <= d <= cap
        high = max(base, 3.0 * previous)
        assert d <= high or math.isclose(d, high, rel_tol=1e-12), (d, high)
        assert b.delay(n + 17, previous) == d
        previous = d
    if base == cap:
        assert previous == base


@settings(max_examples=300, deadline=None)
@given(
    base=st.just(0.0) | st.floats(1e-6, 10.0),  # (subnormal bases lose the relative match)
    multiplier=st.floats(1.0, 10.0),
    cap=st.floats(0.0, 100.0),
    seed=st.integers(0, 2**32),
    retries=st.integers(1, 60),
)
def test_exponential_ceiling_grows_to_the_cap_and_bounds_every_jittered_delay(
    base: float, multiplier: float, cap: float, seed: int, retries: int
) -> None:
    """The ceiling is ``min(cap, base * multiplier ** (retry - 1))``, never decreases; a
    full-jitter delay lies in ``[0, ceiling]``, ``jitter=False`` is the ceiling itself, and a
    seeded source reproduces the sequence."""
    jittered = ExponentialBackoff(base, multiplier=multiplier, cap=cap, rng=random.Random(seed))
    again = ExponentialBackoff(base, multiplier=multiplier, cap=cap, rng=random.Random(seed))
    plain = ExponentialBackoff(base, multiplier=multiplier, cap=cap, jitter=False)
    last = 0.0
    for n in range(1, retries + 1):
        top = jittered.ceiling(n)
        exact = min(cap, base * multiplier ** (n - 1))
        assert math.isclose(top, exact, rel_tol=1e-9)
        assert last <= top <= cap
        d = jittered.delay(n)
        assert 0.0 <= d <= top
        assert again.delay(n) == d
        assert plain.delay(n) == top
        last = top


# -- arguments no primitive can use ---------------------------------------------------------

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda: ExponentialBackoff(0.0, multiplier=INF),
            id="ExponentialBackoff-0.0-multiplier=INF",
        ),  # 0 * inf: NaN delays
        pytest.param(lambda: ExponentialBackoff(NAN), id="ExponentialBackoff-NAN"),
        pytest.param(lambda: ExponentialBackoff(INF), id="ExponentialBackoff-INF"),
        pytest.param(
            lambda: ExponentialBackoff(0.1, cap=INF), id="ExponentialBackoff-0.1-cap=INF"
        ),  # a delay that could sleep forever
        pytest.param(
            lambda: ExponentialBackoff(0.1, multiplier=NAN),
            id="ExponentialBackoff-0.1-multiplier=NAN",
        ),
        pytest.param(
            lambda: DecorrelatedJitterBackoff(0.1, cap=INF),
            id="DecorrelatedJitterBackoff-0.1-cap=INF",
        ),
        pytest.param(lambda: DecorrelatedJitterBackoff(NAN), id="DecorrelatedJitterBackoff-NAN"),
        pytest.param(
            lambda: CircuitBreaker(open_for=NAN, clock=ManualClock()),
            id="CircuitBreaker-open-for=NAN",
        ),  # never reopens
        pytest.param(
            lambda: CircuitBreaker(open_for=INF, clock=ManualClock()),
            id="CircuitBreaker-open-for=INF",
        ),
        pytest.param(
            lambda: CircuitBreaker(open_jitter=NAN, clock=ManualClock()),
            id="CircuitBreaker-open-jitter=NAN",
        ),
        pytest.param(
            lambda: CircuitBreaker(slow_call_duration=NAN, clock=ManualClock()),
            id="CircuitBreaker-slow-call-duration=NAN",
        ),  # never slow
        pytest.param(
            lambda: CircuitBreaker(slow_call_duration=-1.0, clock=ManualClock()),
            id="CircuitBreaker-slow-call-duration=-1.0",
        ),
        pytest.param(
            lambda: CircuitBreaker(window_type="time", window=NAN, clock=ManualClock()),
            id="CircuitBreaker-window-type=-time-window=NAN",
        ),
        pytest.param(
            lambda: GrpcRetryThrottle(max_tokens=INF), id="GrpcRetryThrottle-max-tokens=INF"
        ),  # was OverflowError
        pytest.param(
            lambda: GrpcRetryThrottle(max_tokens=NAN), id="GrpcRetryThrottle-max-tokens=NAN"
        ),
        pytest.param(
            lambda: GrpcRetryThrottle(token_ratio=INF), id="GrpcRetryThrottle-token-ratio=INF"
        ),
    ],
)
def test_retry_primitives_refuse_nan_and_infinite_settings(build: Callable[[], object]) -> None:
    """A NaN or infinite setting compares false everywhere or overflows later; each
    constructor refuses it with ValueError, not a silent switch-off or another error type."""
    with pytest.raises(ValueError):
        build()
