"""`CircuitBreaker`: stop calling a dependency that is failing or slow, and recover gently (R6).

Closed: outcomes are recorded in a sliding window, either the last ``window`` calls
(``window_type="count"``) or the last ``window`` seconds (``"time"``, one-second slices). Once
the window holds at least ``minimum_calls`` outcomes, the breaker opens when the failure rate
reaches ``failure_rate`` or the rate of calls slower than ``slow_call_duration`` reaches
``slow_call_rate``.

Open: calls are refused at once with ``Rejected(Reason.BREAKER_OPEN, retry_after=...)`` (or
answered by the ``fallback``). The open period is ``open_for`` stretched by a random factor in
``[1 - open_jitter, 1 + open_jitter]``, drawn per opening, so a fleet of clients that opened
together does not probe together.

Half-open: at most ``half_open_probes`` calls are let through; the first failure reopens
(with a new jittered period), ``half_open_probes`` successes close it. An ignored probe
(``failed=None``: refused locally, or cancelled) frees its place, so at most that many are
in flight at once. The limited probe count and the per-instance jitter are what keep recovery
from being a synchronized wave.

Hot path (closed): ``acquire`` reads the state; ``release`` updates O(1) counters under a
lock, so threads calling through one blocking `Dependency` share a breaker (a half-open one
lets exactly ``half_open_probes`` through). A fast success into a count window full of fast
successes changes nothing and takes no lock: the healthy case costs no more than on one
event loop. Events are emitted after the lock is let go.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from enum import StrEnum
from typing import Any, TypeVar

from .._checks import name_arg, number_arg
from .._clock import Clock, default_clock
from .._context import current
from .._errors import Reason, Rejected
from ..events import BreakerStateChanged, EventHub, RequestShed, hub
from .classify import ResponseError, classify
from .window import SlidingCounters

__all__ = ["BreakerState", "CircuitBreaker", "default_is_failure"]

T = TypeVar("T")

_CALLS, _FAILURES, _SLOW = 0, 1, 2


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_SERVER_FAULT_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})


def default_is_failure(error: BaseException) -> bool | None:
    """Does ``error`` count against the dependency? ``None``: ignore it entirely.

    Transient failures, server errors (HTTP 5xx; gRPC INTERNAL, UNKNOWN, DATA_LOSS) and anything
    unrecognised count; answers that show the dependency is healthy (validation errors, 404,
    FAILED_PRECONDITION) count as successes; local refusals (`Rejected`, other than a lower
    layer's do-not-retry) never reached it and are ignored.
    """
    if isinstance(error, Rejected) and error.reason is not Reason.DO_NOT_RETRY:
        return None
    if isinstance(error, ResponseError) and (
        (error.status is not None and error.status >= 500) or error.grpc_code in _SERVER_FAULT_CODES
    ):
        return True  # answered, but the dependency is broken: not retryable, still a failure
    failure = classify(error)
    if failure.transient or failure.do_not_retry:
        return True
    return not failure.answered


class _CountWindow:
    """The last ``size`` outcomes in a ring, with running sums."""

    __slots__ = ("_i", "_ring", "totals")

    def __init__(self, size: int) -> None:
        self._ring = [0] * size  # bit 0: failed, bit 1: slow, 4: present
        self._i = 0
        self.totals = [0, 0, 0]

    def add(self, failed: bool, slow: bool) -> None:
        ring, i, totals = self._ring, self._i, self.totals
        old = ring[i]
        if old:
            totals[_CALLS] -= 1
            totals[_FAILURES] -= old & 1
            totals[_SLOW] -= (old >> 1) & 1
        ring[i] = 4 | (2 if slow else 0) | (1 if failed else 0)
        totals[_CALLS] += 1
        totals[_FAILURES] += failed
        totals[_SLOW] += slow
        self._i = (i + 1) % len(ring)

    def sums(self) -> list[int]:
        return self.totals

    def clear(self) -> None:
        # In place: the breaker's lock-free success path holds ``totals`` itself.
        ring = self._ring
        ring[:] = [0] * len(ring)
        self._i = 0
        self.totals[:] = (0, 0, 0)


class _TimeWindow:
    """Outcomes of the last ``seconds`` seconds in one-second slices."""

    __slots__ = ("_clock", "_counters", "_seconds")

    def __init__(self, seconds: int, clock: Clock) -> None:
        self._seconds = seconds
        self._clock = clock
        self._counters = SlidingCounters(3, window=float(seconds), buckets=seconds, clock=clock)

    def add(self, failed: bool, slow: bool) -> None:
        counters = self._counters
        slot = counters.advance()
        totals = counters.totals
        slot[_CALLS] += 1
        totals[_CALLS] += 1
        if failed:
            slot[_FAILURES] += 1
            totals[_FAILURES] += 1
        if slow:
            slot[_SLOW] += 1
            totals[_SLOW] += 1

    def sums(self) -> list[int]:
        return self._counters.sums()

    def clear(self) -> None:
        self._counters = SlidingCounters(
            3, window=float(self._seconds), buckets=self._seconds, clock=self._clock
        )


class CircuitBreaker:
    """Failure-rate and slow-call-rate circuit breaker with jittered opening and few probes.

    Use ``await breaker.call(fn, *args)``, or the two-step ``token = breaker.acquire()`` then
    ``breaker.release(token, failed=..., duration=...)`` (what `Dependency` does).
    ``is_failure(error)`` decides what counts (see `default_is_failure`).
    """

    __slots__ = (
        "_clock",
        "_counts",
        "_events",
        "_generation",
        "_lock",
        "_opened_until",
        "_probe_successes",
        "_probes_in_flight",
        "_quiet",
        "_window",
        "failure_rate",
        "fallback",
        "half_open_probes",
        "is_failure",
        "minimum_calls",
        "name",
        "open_for",
        "open_jitter",
        "rng",
        "slow_call_duration",
        "slow_call_rate",
        "state",
    )

    def __init__(
        self,
        name: str = "breaker",
        *,
        failure_rate: float = 0.5,
        window: int = 20,
        window_type: str = "count",
        minimum_calls: int | None = None,
        slow_call_rate: float = 1.0,
        slow_call_duration: float | None = None,
        open_for: float = 5.0,
        open_jitter: float = 0.2,
        half_open_probes: int = 3,
        fallback: Callable[[Rejected], Awaitable[Any]] | None = None,
        is_failure: Callable[[BaseException], bool | None] = default_is_failure,
        rng: random.Random | None = None,
        clock: Clock | None = None,
        events: EventHub = hub,
    ) -> None:
        name_arg("CircuitBreaker", name)
        for field, value in (
            ("failure_rate", failure_rate),
            ("slow_call_rate", slow_call_rate),
            ("window", window),
            ("open_for", open_for),
            ("open_jitter", open_jitter),
            ("half_open_probes", half_open_probes),
        ):
            number_arg("CircuitBreaker", field, value)
        if not 0.0 < failure_rate <= 1.0 or not 0.0 < slow_call_rate <= 1.0:
            raise ValueError("rates must be within (0, 1]")
        # Written as "not (valid)" so NaN is refused too: a NaN open_for or window would
        # compare false everywhere and leave the breaker stuck or blind.
        if not (
            window >= 1
            and half_open_probes >= 1
            and 0 <= open_for < math.inf
            and 0 <= open_jitter < 1
        ):
            raise ValueError("window, half_open_probes >= 1; 0 <= open_for < inf; 0 <= jitter < 1")
        if slow_call_duration is not None and not 0 <= slow_call_duration < math.inf:
            raise ValueError("slow_call_duration must be None or within [0, inf)")
        self.failure_rate = failure_rate
        self.slow_call_rate = slow_call_rate
        self.slow_call_duration = slow_call_duration
        self.minimum_calls = minimum_calls if minimum_calls is not None else min(window, 10)
        self.open_for = open_for
        self.open_jitter = open_jitter
        self.half_open_probes = half_open_probes
        self.fallback = fallback
        self.is_failure = is_failure
        self.name = name
        self.rng = rng or random.Random()
        self._clock = clock or default_clock()
        self._events = events
        # A count window's totals when it holds nothing but fast successes (``None``: a time
        # window, whose successes always count): the lock-free case of `release`.
        self._quiet: list[int] | None = None
        self._counts: list[int] | None = None
        if window_type == "count":
            ring = _CountWindow(window)
            self._window: _CountWindow | _TimeWindow = ring
            self._quiet = [window, 0, 0]
            self._counts = ring.totals
            # A ring of ``window`` outcomes never holds more: a larger minimum would never be
            # reached and the breaker would never open (Resilience4j caps it the same way).
            self.minimum_calls = min(self.minimum_calls, window)
        elif window_type == "time":
            self._window = _TimeWindow(window, self._clock)
        else:
            raise ValueError("window_type must be 'count' or 'time'")
        self.state = BreakerState.CLOSED
        self._opened_until = 0.0
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._generation = 0  # bumps on each transition; stale releases are ignored
        self._lock = threading.Lock()

    # -- admission ------------------------------------------------------------------------

    def acquire(self) -> int:
        """Ask to send one call; returns a token for `release`, or raises BREAKER_OPEN."""
        if self.state is BreakerState.CLOSED:
            return self._generation  # (a racing transition: the call counts as sent before it)
        with self._lock:
            state: BreakerState = self.state  # (again: it may have closed meanwhile)
            if state is BreakerState.CLOSED:
                return self._generation
            now = self._clock.now()
            changed = None
            wait = None
            admitted = False
            if state is BreakerState.OPEN and now < self._opened_until:
                wait = self._opened_until - now
            else:
                if state is BreakerState.OPEN:
                    changed = self._transition(BreakerState.HALF_OPEN, now)
                admitted = self._probes_in_flight + self._probe_successes < self.half_open_probes
                if admitted:
                    self._probes_in_flight += 1
            token = self._generation
        if changed is not None:
            self._emit(changed)
        if not admitted:
            raise self._refuse(wait)
        return token

    def release(self, token: int, *, failed: bool | None, duration: float = 0.0) -> None:
        """Report the outcome of an acquired call (``failed=None``: ignore it, free its slot)."""
        if token != self._generation:
            return  # the breaker moved on since this call started
        if self.state is BreakerState.CLOSED:
            if failed is None:
                return  # nothing to record
            if (
                not failed
                and self._quiet is not None
                and self._quiet == self._counts
                and (self.slow_call_duration is None or duration < self.slow_call_duration)
            ):
                # A full ring of fast successes stays one after another: nothing to change,
                # so no lock (read mid-update, the success counts as before that update).
                return
        lock = self._lock
        lock.acquire()
        try:
            changed = self._settle(token, failed, duration)
        finally:
            lock.release()
        if changed is not None:
            self._emit(changed)

    def _settle(
        self, token: int, failed: bool | None, duration: float
    ) -> BreakerStateChanged | None:
        """`release` under the lock; returns the transition to emit, if any."""
        if token != self._generation:
            return None
        if self.state is BreakerState.CLOSED:
            if failed is None:
                return None
            slow = self.slow_call_duration is not None and duration >= self.slow_call_duration
            window = self._window
            window.add(failed, slow)
            totals = window.sums()
            calls = totals[_CALLS]
            # Rates are compared as quotients: ``rate * calls`` can round up past the count
            # that reaches the rate (0.07 * 100 = 7.000000000000001, one failure late). Both
            # rates are checked on every outcome: a fast call that brings the window to
            # ``minimum_calls``, or one recorded after older fast calls left a time window,
            # can be the one that finds the slow-call rate reached, as a success can for the
            # failure rate.
            if calls >= self.minimum_calls and (
                totals[_FAILURES] / calls >= self.failure_rate
                or totals[_SLOW] / calls >= self.slow_call_rate
            ):
                return self._open()
            return None
        # half-open: a probe came back
        self._probes_in_flight -= 1
        if failed is None:
            return None
        slow = self.slow_call_duration is not None and duration >= self.slow_call_duration
        if failed or slow:
            return self._open()
        self._probe_successes += 1
        if self._probe_successes >= self.half_open_probes:
            return self._transition(BreakerState.CLOSED, self._clock.now())
        return None

    def record_error(self, token: int, error: BaseException, duration: float = 0.0) -> None:
        """`release` with the outcome decided by ``is_failure(error)``."""
        self.release(token, failed=self.is_failure(error), duration=duration)

    # -- convenience ----------------------------------------------------------------------

    def gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """One ``breaker_state`` gauge per state (1 for the current one), for exporters."""
        for state in BreakerState:
            yield (
                "breaker_state",
                {"source": self.name, "state": state.value},
                1.0 if self.state is state else 0.0,
            )

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Await ``fn(*args, **kwargs)`` through the breaker (fallback when open, if set)."""
        try:
            token = self.acquire()
        except Rejected as refused:
            if self.fallback is not None:
                result: T = await self.fallback(refused)
                return result
            raise
        clock = self._clock
        timed = self.slow_call_duration is not None
        started = clock.now() if timed else 0.0
        try:
            result = await fn(*args, **kwargs)
        except Exception as error:
            duration = clock.now() - started if timed else 0.0
            self.release(token, failed=self.is_failure(error), duration=duration)
            raise
        except BaseException:  # cancelled: says nothing about the dependency
            self.release(token, failed=None)
            raise
        self.release(token, failed=False, duration=clock.now() - started if timed else 0.0)
        return result

    def retry_after(self) -> float | None:
        """Seconds until the breaker will try half-open, when it is open."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self._opened_until - self._clock.now())
        return None

    # -- transitions ----------------------------------------------------------------------

    def _open(self) -> BreakerStateChanged | None:
        now = self._clock.now()
        spread = self.open_jitter
        factor = 1.0 + self.rng.uniform(-spread, spread) if spread else 1.0
        self._opened_until = now + self.open_for * factor
        return self._transition(BreakerState.OPEN, now)

    def _transition(self, new: BreakerState, now: float) -> BreakerStateChanged | None:
        """Move to ``new`` (under the lock); the event to emit once it is let go."""
        old = self.state
        self.state = new
        self._generation += 1
        self._probes_in_flight = 0
        self._probe_successes = 0
        if new is BreakerState.CLOSED:
            self._window.clear()
        if self._events.enabled:
            return BreakerStateChanged(now, self.name, old.value, new.value)
        return None

    def _emit(self, event: BreakerStateChanged) -> None:
        self._events.emit(event)

    def _refuse(self, retry_after: float | None) -> Rejected:
        if self._events.enabled:
            ctx = current()
            self._events.emit(
                RequestShed(
                    self._clock.now(),
                    self.name,
                    ctx.operation,
                    ctx.priority,
                    ctx.caller,
                    Reason.BREAKER_OPEN,
                    ctx.remaining(),
                    0.0,
                )
            )
        return Rejected(
            Reason.BREAKER_OPEN, f"{self.name} is {self.state.value}", retry_after=retry_after
        )

    def force_open(self) -> None:
        """Open now (operator action or tests)."""
        with self._lock:
            changed = self._open()
        if changed is not None:
            self._emit(changed)

    def reset(self) -> None:
        """Close now and forget history."""
        with self._lock:
            changed = self._transition(BreakerState.CLOSED, self._clock.now())
        if changed is not None:
            self._emit(changed)

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, state={self.state.value})"
