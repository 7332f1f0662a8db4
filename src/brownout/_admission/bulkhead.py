"""`Bulkhead`: a concurrency budget for one dependency or class of work (A1, A2, S1).

A bulkhead enforces a `Limit` (how many may run), with a bounded `WaitQueue` (who may wait,
how long, in which order), priorities (S3), per-caller fairness (S5) and deadline checks (D7).
It decides before the expensive resource is taken (A2) and refuses with a reason
(`brownout.Rejected`). Every decision is an event on the hub (O1).

Outcomes feed the limit (Netflix's Limit / Limiter / Listener split): in ``async with
bulkhead.admit():``

- normal exit: success, the rtt is a sample for the limit and the latency estimator;
- `TimeoutError` (including `brownout.DeadlineExceeded`) or `asyncio.CancelledError`:
  *dropped*, the limit backs off and the rtt is not used (a timeout is a drop);
- `brownout.Rejected` raised inside (a downstream refusal): *ignored*, the sample says nothing
  about this bulkhead's capacity;
- any other exception: a success *for the limit* (the work used the slot for a real rtt), but
  the event is `RequestFailed`, not `RequestCompleted`.

Single event-loop thread, no locks: every state change happens synchronously between awaits.
The uncontended path is O(1): one permit object, a few comparisons, no clock read unless an
adaptive limit, an estimator, a deadline or an event sink needs one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Literal, ParamSpec, Protocol, TypeVar

from .._clock import Clock, default_clock, running_loop
from .._context import get_current
from .._deadline import Deadline
from .._errors import Reason, Rejected
from .._priority import Priority
from .._tally_buffer import (
    ADMITTED,
    COMPLETED,
    FAST,
    LATE,
    MAX_SAMPLES,
    OFFERED,
    OTHER,
    WAITED,
    Index,
    Ledger,
)
from ..events import (
    EventHub,
    LimitChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
)
from ..events import hub as default_hub
from .estimator import LatencyEstimator
from .limits import Limit
from .loop_lag import LoopLag
from .loop_lag import loop_lag as _shared_loop_lag
from .permit import ADMITTED as _ADMITTED
from .permit import DONE as _DONE
from .permit import DROPPED as _DROPPED
from .permit import IGNORED as _IGNORED
from .permit import NEW as _NEW
from .permit import QUEUED as _QUEUED
from .permit import SUCCESS as _SUCCESS
from .permit import UNTIMED as _UNTIMED
from .permit import Permit, Untracked
from .queues import (
    CRITICAL_PLUS_RANK,
    RANKS,
    PriorityCoDelQueue,
    WaitQueue,
    priority_of_rank,
    rank_of,
)

__all__ = ["Bulkhead", "OverloadState", "Permit", "Untracked"]

P = ParamSpec("P")
R = TypeVar("R")

_INF = math.inf
_new = object.__new__
_UNTIMED_SHARED = -1e300  # untimed, but must take the full release path (share accounting)
_CRITICAL_PLUS = Priority.CRITICAL_PLUS
_MAX_SAMPLES = MAX_SAMPLES
_FAST, _OFFERED, _ADMITTED_NOW, _COMPLETED, _LATE = FAST, OFFERED, ADMITTED, COMPLETED, LATE
_CAPACITY_REASONS = frozenset(
    {Reason.QUEUE_FULL, Reason.QUEUE_TIMEOUT, Reason.OVERLOADED, Reason.FAIR_SHARE}
)
_FORCEABLE = frozenset({Reason.QUEUE_FULL, Reason.QUEUE_TIMEOUT, Reason.OVERLOADED})
_FORCED_DETAIL = {
    Reason.QUEUE_FULL: "the wait queue is full (forced full)",
    Reason.QUEUE_TIMEOUT: "waited the longest the queue allows (forced full)",
    Reason.OVERLOADED: "at the concurrency limit (forced full)",
}


class OverloadState(Protocol):
    """What a bulkhead reads from an overload manager: shed priorities below ``shed_below``."""

    @property
    def shed_below(self) -> int: ...


def _as_waiter(p: Permit, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``fn`` in the context of ``p``'s waiter (see `Permit._context`), if it has one."""
    ctx = p._context
    if ctx is None:
        return fn(*args, **kwargs)
    return ctx.run(fn, *args, **kwargs)


class Bulkhead:
    """A concurrency budget for one dependency or class of work (A1).

    - ``limit``: a `Limit` (``FixedLimit(8)``, or an adaptive one that learns from outcomes).
    - ``queue``: a `WaitQueue`. Default: a `PriorityCoDelQueue` (CoDel and adaptive LIFO per
      priority class: 5 ms target, 100 ms interval, 1 s ``max_wait``) as long as the limit,
      that *follows* the limit: when an adaptive limit moves, the queue's ``max_size`` moves
      with it (one round trip of waiting by depth; CoDel bounds it by age). A probe that pins
      the limit low to re-measure the no-load rtt does not shrink it (the limit's ``estimate``).
      A queue you pass is used as given.
    - ``reserve``: slots above the limit that only CRITICAL_PLUS work (health checks, control
      traffic) may use, so it is admitted while lower work saturates the bulkhead (default 1).
    - ``shares``: optional per-priority fractions of the limit, e.g.
      ``{Priority.SHEDDABLE: 0.5}``. A priority at its share may *borrow* beyond it only while
      no higher priority holds permits or waits (the capacity is idle); otherwise it waits
      and the slot is kept for higher work. Priorities not named have share 1.0.
    - ``estimator``: a `LatencyEstimator` for deadline-aware refusals (D7). With
      ``deadline_aware=True`` (default) the bulkhead makes a private one when none is given;
      it samples one admission in ``estimate_every`` (16) to keep clock reads off the hot
      path.
    - ``overload``: an `OverloadManager` (anything with ``shed_below``): priorities below it
      are refused with `Reason.OVERLOADED`.
    - ``loop_lag``: how late the event loop runs due callbacks (`LoopLag`). ``"auto"``
      (default): the running loop's shared probe when the bulkhead keeps the loop's own clock,
      none with another clock (virtual time: pass a `LoopLag` and drive it). With it, an
      adaptive limit learns from each request's latency *less the loop's lag* (the loop's
      delay is not queueing downstream, and cutting the limit for it only idles the slots);
      and while the lag's mean is at least ``shed_lag`` (20 ms), work that cannot start at
      once is refused at once (`Reason.OVERLOADED`) instead of queued: waiting on a lagging
      loop costs a future and a timer and outlasts the queue's bound.
    - ``clock`` (default the loop's clock) and ``events`` (default ``brownout.hub``).
    """

    def __init__(
        self,
        name: str,
        limit: Limit,
        queue: WaitQueue | None = None,
        *,
        reserve: int = 1,
        clock: Clock | None = None,
        events: EventHub | None = None,
        estimator: LatencyEstimator | None = None,
        overload: OverloadState | None = None,
        deadline_aware: bool = True,
        estimate_every: int = 16,
        shares: Mapping[Priority, float] | None = None,
        loop_lag: LoopLag | Literal["auto"] | None = "auto",
        shed_lag: float = 0.020,
    ) -> None:
        if reserve < 0:
            raise ValueError("reserve must be >= 0")
        if shares and not all(0.0 < v <= 1.0 for v in shares.values()):
            raise ValueError("shares must be fractions of the limit in (0, 1]")
        self._shares = [shares.get(p, 1.0) for p in Priority] if shares else None
        self._held: list[int] | None = [0] * len(Priority) if shares else None
        self.name = name
        self._limit = limit
        self._limit_value = max(1, int(limit.limit))
        self._adaptive = bool(limit.adaptive)
        self._queue_follows_limit = queue is None
        self._queue = (
            queue
            if queue is not None
            else PriorityCoDelQueue(max_size=self._queue_size_for(self._limit_value))
        )
        self._reserve = reserve
        if not 0 < shed_lag <= math.inf:  # NaN too; inf: never refuse for lag
            raise ValueError("shed_lag must be positive (inf: never)")
        self._shed_lag = shed_lag
        self._lag: LoopLag | None = None if loop_lag == "auto" else loop_lag
        self._lag_auto = loop_lag == "auto" and clock is None
        self._clock = clock if clock is not None else default_clock()
        self._events = events if events is not None else default_hub
        if estimator is None and deadline_aware:
            estimator = LatencyEstimator()
        self._estimator = estimator
        self._overload = overload
        self._forced: Reason | None = None
        self._plain = overload is None and not self._adaptive and self._held is None
        if estimate_every < 1:
            raise ValueError("estimate_every must be at least 1")
        # One admission in ``estimate_every`` is timed: for the estimator, and for the latency
        # sample of a tallying hub (`_time_sample` skips the clock when neither needs it).
        self._sample_every = estimate_every
        self._tick = 1
        self._ledger: Ledger | None = None
        self._ledger_index: Index | None = None
        self._in_flight = 0
        self._untracked = Untracked(self)
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_loop: asyncio.AbstractEventLoop | None = None
        self._sweep_at = _INF  # when the armed sweep fires (this bulkhead's clock)

    # -- public state ----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Permits currently held."""
        return self._in_flight

    @property
    def limit(self) -> int:
        """The current concurrency limit."""
        return self._limit_value

    @property
    def limit_algorithm(self) -> Limit:
        return self._limit

    @property
    def queue(self) -> WaitQueue:
        return self._queue

    @property
    def queue_depth(self) -> int:
        """Work waiting for a permit now."""
        return self._queue.size

    @property
    def clock(self) -> Clock:
        """The clock this bulkhead measures waits and deadlines on (read-only)."""
        return self._clock

    @property
    def estimator(self) -> LatencyEstimator | None:
        return self._estimator

    @property
    def overload(self) -> OverloadState | None:
        return self._overload

    @overload.setter
    def overload(self, value: OverloadState | None) -> None:
        self._overload = value
        self._plain = (
            value is None and not self._adaptive and self._held is None and self._forced is None
        )

    @property
    def forced_full(self) -> Reason | None:
        """The reason new work is refused while `force_full` holds the bulkhead full, else None."""
        return self._forced

    def force_full(self, on: bool = True, *, reason: Reason = Reason.QUEUE_FULL) -> None:
        """Refuse new work as if every slot and the whole queue were taken (drills, tests).

        An operator switch (Envoy's runtime "force shed"): while on, `admit` refuses with
        ``reason`` (`Reason.QUEUE_FULL`, `Reason.QUEUE_TIMEOUT` or `Reason.OVERLOADED`) and
        `try_admit` with `Reason.OVERLOADED`, each a real `brownout.Rejected` and
        `RequestShed` event, never counted as a false positive. The checks a full bulkhead
        makes first still apply (overload manager, expired or too short deadline, loop lag).
        CRITICAL_PLUS work keeps the reserve, as above a full limit: it is admitted while
        fewer than ``reserve`` permits are held. Work already admitted runs on; waiters get no
        slot until ``force_full(False)``. Free when off: the switch takes the bulkhead off its
        uncontended fast path only while on.
        """
        if reason not in _FORCEABLE:
            raise ValueError(
                f"a forced-full bulkhead refuses with QUEUE_FULL, QUEUE_TIMEOUT or OVERLOADED, "
                f"not {reason!r}"
            )
        self._forced = reason if on else None
        self.overload = self._overload  # recompute the fast-path flag
        if not on and self._queue.size:
            self._drain()

    def oldest_queue_age(self) -> float:
        """Seconds the oldest waiter has waited (0.0 when none) (O2, O5)."""
        return self._queue.oldest_age(self._clock.now())

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Live state for exporters (`brownout.Stats.watch`): in-flight, limit, queue depth
        and the age of the oldest waiter, labelled with this bulkhead's name (O2, O5)."""
        labels = {"source": self.name}
        yield ("in_flight", labels, float(self._in_flight))
        yield ("limit", labels, float(self._limit_value))
        yield ("queue_depth", labels, float(self._queue.size))
        # Read-only (exporters may call this from another thread): no tidying of the queue.
        oldest = self._queue.peek_oldest_enqueued()
        yield ("queue_oldest_age", labels, 0.0 if oldest is None else self._clock.now() - oldest)

    def utilization(self) -> float:
        """In-flight over limit (may exceed 1.0 with the CRITICAL_PLUS reserve)."""
        return self._in_flight / self._limit_value

    # -- admission -------------------------------------------------------------------------
    def admit(
        self,
        *,
        priority: Priority | None = None,
        caller: str | None = None,
        operation: str | None = None,
        deadline: Deadline | None = None,
        in_progress: bool | None = None,
        retry: bool | None = None,
    ) -> Permit:
        """``async with bulkhead.admit(): ...`` runs the block under a permit.

        Fields not given come from the request context (`brownout.current()`; ``retry``: its
        attempt number is above 1). Waits in the queue when the bulkhead is full; raises
        `brownout.Rejected` when refused. A retry ranks below a first attempt of the same
        priority: it waits behind it, and is the first evicted when the queue is full (I3).
        """
        ctx = get_current()
        # Built field by field rather than through Permit.__init__: one frame less on the
        # hot path.
        p: Permit = _new(Permit)
        p._bulkhead = self
        p.priority = priority = ctx.priority if priority is None else priority
        p.caller = caller = ctx.caller if caller is None else caller
        p.operation = operation = ctx.operation if operation is None else operation
        if self._events.tallying:
            # Every sink accepts tallies: this permit's outcomes are counted in its row.
            # (`_ledger_row`, inlined: this is the measured hot path of a tallying hub.)
            index = self._ledger_index
            if index is None:
                index = self._new_ledger().index
            try:
                row = index[caller][operation][priority]
            except KeyError:
                row = None
            if row is None:
                ledger = self._ledger
                assert ledger is not None
                row = ledger.row(operation, priority, caller)
            p._row = row
        else:
            p._row = None
        if deadline is None:
            deadline = ctx.deadline
        if deadline is None:
            p.deadline_at = _INF
        elif deadline.clock is self._clock:
            p.deadline_at = deadline.at
        else:
            p.deadline_at = self._deadline_at(deadline)
        p.in_progress = ctx.in_progress if in_progress is None else in_progress
        p.retry = ctx.attempt > 1 if retry is None else retry
        p._state = _NEW
        return p

    def try_admit(
        self,
        *,
        priority: Priority | None = None,
        caller: str | None = None,
        operation: str | None = None,
        deadline: Deadline | None = None,
        in_progress: bool | None = None,
        retry: bool | None = None,
    ) -> Permit:
        """A permit now, or `brownout.Rejected` (never waits). Settle the permit yourself."""
        permit = self.admit(
            priority=priority,
            caller=caller,
            operation=operation,
            deadline=deadline,
            in_progress=in_progress,
            retry=retry,
        )
        self._admit_or_refuse(permit)
        return permit

    def _admit_or_refuse(self, permit: Permit) -> None:
        """`try_admit`'s decision: admit ``permit`` now or raise `brownout.Rejected`."""
        if self._admit_now(permit):
            return
        if self._forced is not None:
            raise self._refuse(
                permit,
                Reason.OVERLOADED,
                "at the concurrency limit (forced full)",
                0.0,
                justified=True,
            )
        if self._held is not None and self._share_blocks(permit.priority):
            # capacity kept for higher priorities is not free capacity: not a false positive
            raise self._refuse(
                permit, Reason.OVERLOADED, "this priority holds its share", 0.0, justified=True
            )
        raise self._refuse(permit, Reason.OVERLOADED, "at the concurrency limit", 0.0)

    def admit_uncontended(
        self,
        priority: Priority,
        caller: str,
        operation: str,
        now: float,
        budget: float,
    ) -> Permit | Untracked | None:
        """Admission at once when nothing stands in the way, else ``None`` with nothing
        counted (the caller then takes `admit`, which decides and reports everything else).

        For adapters' fast paths (the ASGI edge): work arriving at ``now`` (this bulkhead's
        clock) with ``budget`` seconds (> 0) to its deadline, while
        the bulkhead has room, nobody waits, no share or overload rule applies, the deadline
        leaves the expected service time, and the hub is off or tallies. It is counted as
        offered and admitted exactly as `admit` would.

        The result is settled exactly once, by `success`, `failed` or `settle_raised`. It is
        a `Permit` timed from ``now`` when something learns from this admission (a tallying
        hub, an adaptive limit, the estimator's one sample in ``estimate_every``), else the
        bulkhead's shared `Untracked`, which only frees the slot: nothing to allocate.
        """
        n = self._in_flight
        if n >= self._limit_value or self._queue.size:
            return None
        if not self._plain:  # shares, an overload manager, an adaptive limit or forced full
            if self._held is not None or self._forced is not None:
                return None
            ov = self._overload
            if ov is not None and priority < ov.shed_below:
                return None
        est = self._estimator
        if est is not None:
            need = est.estimates.get(operation)
            if need is not None and budget < need:
                return None
        if self._events.enabled:
            return self._admit_tallied(priority, caller, operation, now, budget, n)
        if not self._adaptive:
            tick = self._tick - 1
            if tick or est is None:
                # Nobody counts late work and the estimator skips this one: untimed.
                self._tick = tick or self._sample_every
                self._in_flight = n + 1
                return self._untracked
            self._tick = self._sample_every
        return self._timed_permit(priority, caller, operation, now + budget, now, n, None)

    def _admit_tallied(
        self,
        priority: Priority,
        caller: str,
        operation: str,
        now: float,
        budget: float,
        n: int,
    ) -> Permit | None:
        if not self._events.tallying:
            return None
        row = self._ledger_row(caller, operation, priority)
        row[_OFFERED] += 1
        row[_ADMITTED_NOW] += 1
        ledger = self._ledger
        assert ledger is not None
        # The budget itself, not ``deadline - now``: a 100 ms budget is 0.1, not 0.1 + 1e-13.
        ledger.sample_remaining(budget)
        # Timed: within the deadline or late is decided at release.
        return self._timed_permit(priority, caller, operation, now + budget, now, n, row)

    def _ledger_row(self, caller: str, operation: str, priority: Priority) -> list[int]:
        """This key's row in the bulkhead's ledger (made on first use)."""
        index = self._ledger_index
        if index is None:
            index = self._new_ledger().index
        try:
            row = index[caller][operation][priority]
        except KeyError:
            row = None
        if row is None:
            ledger = self._ledger
            assert ledger is not None
            row = ledger.row(operation, priority, caller)
        return row

    def _timed_permit(
        self,
        priority: Priority,
        caller: str,
        operation: str,
        deadline_at: float,
        now: float,
        n: int,
        row: list[int] | None,
    ) -> Permit:
        # Built field by field, as in `admit`.
        p: Permit = _new(Permit)
        p._bulkhead = self
        p.priority = priority
        p.caller = caller
        p.operation = operation
        p.deadline_at = deadline_at
        p.in_progress = False
        p.retry = False
        p._row = row
        n += 1
        self._in_flight = n
        p.in_flight_at_admit = n
        p.queue_wait = 0.0
        p._state = _ADMITTED
        p.admitted_at = now
        return p

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        """Decorate an async function: each call runs under a permit of this bulkhead."""

        @functools.wraps(fn)
        async def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self.admit():
                return await fn(*args, **kwargs)

        return guarded

    def _fits(self, operation: str, deadline_at: float) -> bool:
        """The deadline has not passed and leaves at least the expected service time."""
        left = deadline_at - self._clock.now()
        if left <= 0.0:
            return False
        est = self._estimator
        if est is None:
            return True
        need = est.estimates.get(operation)
        return need is None or left >= need

    def _deadline_at(self, deadline: Deadline) -> float:
        if deadline.clock is self._clock:
            return deadline.at
        return self._clock.now() + (deadline.at - deadline.clock.now())

    def _admit_now(self, p: Permit) -> bool:
        """Entry checks and the fast path. True: admitted; False: should wait; or raises."""
        events = self._events
        d_at = p.deadline_at
        now: float | None = None
        if events.enabled:
            row = p._row
            if row is not None:  # tallied (see `admit`)
                row[_OFFERED] += 1
                if d_at != _INF:
                    now = self._clock.now()
                    ledger = self._ledger
                    assert ledger is not None
                    ledger.sample_remaining(max(0.0, d_at - now))
            else:
                now = self._clock.now()
                events.emit(
                    RequestOffered(
                        now,
                        self.name,
                        p.operation,
                        p.priority,
                        p.caller,
                        None if d_at == _INF else max(0.0, d_at - now),
                    )
                )
        ov = self._overload
        if ov is not None and p.priority < ov.shed_below:
            raise self._refuse(
                p, Reason.OVERLOADED, "shedding this priority under overload", 0.0, justified=True
            )
        if d_at != _INF:
            if now is None:
                now = self._clock.now()
            left = d_at - now
            if left <= 0.0:
                raise self._refuse(p, Reason.DEADLINE_EXPIRED, "the deadline already passed", 0.0)
            est = self._estimator
            if est is not None:
                need = est.estimates.get(p.operation)
                if need is not None and left < need:
                    raise self._refuse(
                        p,
                        Reason.DEADLINE_TOO_SHORT,
                        f"{left * 1000:.0f} ms left, the work needs {need * 1000:.0f} ms",
                        0.0,
                    )
        n = self._in_flight
        if self._held is not None and self._share_blocks(p.priority):
            return False
        if self._forced is not None:
            # Forced full: the limit is taken; CRITICAL_PLUS still has the reserve above it.
            if p.priority is _CRITICAL_PLUS and n < self._reserve:
                self._grant(p, n, 0.0, now, False)
                return True
            return False
        if n < self._limit_value and (
            self._queue.size == 0
            # waiters held back by their share keep slots free for work that outranks them
            or self._queue.peek_rank() < rank_of(p.priority, p.in_progress, p.retry)
        ):
            self._grant(p, n, 0.0, now, False)
            return True
        if p.priority is _CRITICAL_PLUS and n < self._limit_value + self._reserve:
            self._grant(p, n, 0.0, now, False)
            return True
        return False

    def _share_blocks(self, priority: int) -> bool:
        """True when ``priority`` holds its share and may not borrow: a higher priority is
        active (holds permits or waits), so the capacity above the share is not idle."""
        held = self._held
        shares = self._shares
        assert held is not None
        assert shares is not None
        if held[priority] < shares[priority] * self._limit_value:
            return False
        for higher in range(priority + 1, len(held)):
            if held[higher]:
                return True
        return priority_of_rank(self._queue.peek_rank()) > priority

    def _grant(self, p: Permit, n: int, queue_wait: float, now: float | None, queued: bool) -> None:
        """Give ``p`` a slot. ``now``: a clock reading already taken, if any."""
        n += 1
        self._in_flight = n
        p.in_flight_at_admit = n
        p.queue_wait = queue_wait
        p._state = _ADMITTED
        events = self._events
        row = p._row
        if row is not None:
            # Tallied: count a plain admission; one that waited is news (its queue wait).
            if queued:
                # While it waited it held no count in its row, which a ledger compaction
                # may have forgotten: count the rest in the row the ledger reports (O1).
                ledger = self._ledger
                assert ledger is not None
                row = p._row = ledger.row(p.operation, p.priority, p.caller)
                row[WAITED] += 1
                if now is None:
                    now = self._clock.now()
                _as_waiter(
                    p,
                    events.emit,
                    RequestAdmitted(now, self.name, p.operation, p.priority, p.caller, queue_wait),
                )
            else:
                row[_ADMITTED_NOW] += 1
            if p.deadline_at != _INF or self._adaptive or queued:
                # Timed: a deadline needs a clock reading at release anyway (within it or
                # late?), and this one was taken at admission.
                p.admitted_at = self._clock.now() if now is None else now
            else:
                tick = self._tick - 1
                if tick:
                    self._tick = tick
                    p.admitted_at = _UNTIMED
                else:
                    self._time_sample(p)
        elif events.enabled:
            if now is None:
                now = self._clock.now()
            p.admitted_at = now
            event = RequestAdmitted(now, self.name, p.operation, p.priority, p.caller, queue_wait)
            if queued:
                _as_waiter(p, events.emit, event)
            else:
                events.emit(event)
        elif self._adaptive:
            p.admitted_at = self._clock.now() if now is None else now
        else:
            tick = self._tick - 1
            if tick:
                self._tick = tick
                p.admitted_at = _UNTIMED
            else:
                self._time_sample(p)
        held = self._held
        if held is not None:
            held[p.priority] += 1
            if p.admitted_at == _UNTIMED:
                p.admitted_at = _UNTIMED_SHARED

    def _time_sample(self, p: Permit) -> None:
        # The estimator and the latency sample of a tallying hub need a sample now and then,
        # not every request: timing one admission in ``estimate_every`` keeps two clock reads
        # off most fast paths.
        self._tick = self._sample_every
        if self._estimator is None and p._row is None:
            p.admitted_at = _UNTIMED
        else:
            p.admitted_at = self._clock.now()

    def _new_ledger(self) -> Ledger:
        ledger = self._ledger = Ledger(self.name, self._events, self._clock)
        self._ledger_index = ledger.index  # the same dict for the ledger's life
        # A bulkhead discarded between two flushes took its uncounted requests with it: its
        # hub now keeps the ledger until the next flush emits them (O1).
        weakref.finalize(self, self._events.adopt, ledger).atexit = False
        return ledger

    @property
    def ledger(self) -> Ledger | None:
        """Routine outcomes counted while the hub tallies (`brownout._tally_buffer`), else None."""
        return self._ledger

    def _refuse_if_lagging(self, p: Permit) -> None:
        """Refuse work that would queue while the loop lags (see the class docstring)."""
        lag = self._lag
        if lag is None:
            if not self._lag_auto:
                return
            lag = self._lag = _shared_loop_lag()
        late = lag.mean
        if late >= self._shed_lag:
            raise self._refuse(
                p,
                Reason.OVERLOADED,
                f"not queued: the event loop runs {late * 1000:.0f} ms late",
                0.0,
                justified=True,
            )

    async def _wait(self, p: Permit) -> None:
        now = self._enqueue(p)
        q = self._queue
        d_at = p.deadline_at
        loop = running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        p._future = fut
        # Age bounds are enforced by one sweep timer for the whole queue; only a deadline
        # that comes first needs a timer of its own.
        if d_at < now + q.wait_bound(now, rank_of(p.priority, p.in_progress, p.retry)):
            p._timer = loop.call_later(max(0.0, d_at - now), self._expire, p)
        else:
            p._timer = None
        if self._sweep is None or self._sweep_loop is not loop:
            # (a bulkhead outliving its loop, e.g. across asyncio.run calls, re-arms here)
            self._schedule_sweep(loop, now)
        else:
            # A waiter may be due before the armed sweep: a class that continues a standing
            # period gets CoDel's short bound at once (PriorityCoDelQueue), not the interval.
            at = q.next_expiry(now)
            if at is not None and at < self._sweep_at:
                self._schedule_sweep(loop, now)
        events = self._events
        if events.enabled:
            p._context = contextvars.copy_context()
            events.emit(RequestQueued(now, self.name, p.operation, p.priority, p.caller, q.size))
        else:
            p._context = None
        try:
            await fut
        except asyncio.CancelledError:
            self._waiter_gone(p, now)
            raise

    def _waiter_gone(self, p: Permit, since: float) -> None:
        """The waiter queued at ``since`` stopped waiting (cancelled, interrupted): take it
        off the queue, or give back the slot it was granted but never used."""
        if p._state == _QUEUED:
            if p._timer is not None:
                p._timer.cancel()
            p._state = _DONE
            later = self._clock.now()
            self._queue.remove(p, later)
            self._left_queue(p, later, later - since, later >= p.deadline_at)
            self._refill()
        elif p._state == _ADMITTED:  # granted, but cancelled before it could run
            self._release(p, _IGNORED, None)  # it never ran: nothing for the limit
            if self._events.enabled:  # admitted, so it ends: abandoned, or expired (O1)
                self._emit_outcome(p, _DROPPED, "CancelledError", self._clock.now(), 0.0)

    def _enqueue(self, p: Permit) -> float:
        """The decisions of queueing ``p``: refuse it (forced full, a deadline too short for
        the expected wait, a full queue) or push it, evicting lower work. Returns when it was
        queued; the caller makes the waiter's future before anything can settle it."""
        forced = self._forced
        if forced is not None:
            raise self._refuse(p, forced, _FORCED_DETAIL[forced], 0.0, justified=True)
        q = self._queue
        now = self._clock.now()
        est = self._estimator
        d_at = p.deadline_at
        rank = rank_of(p.priority, p.in_progress, p.retry)
        if d_at != _INF and est is not None:
            service = est.estimates.get(p.operation)
            if service is not None:
                # only work served before it delays it (S3): lower classes wait behind it
                ahead = q.size
                if ahead:
                    ahead = sum(q.class_depth(r) for r in range(rank, RANKS))
                wait = (ahead + 1) * service / self._limit_value
                if d_at - now < wait + service:
                    raise self._refuse(
                        p,
                        Reason.DEADLINE_TOO_SHORT,
                        f"{(d_at - now) * 1000:.0f} ms left, expected wait {wait * 1000:.0f} ms"
                        f" + service {service * 1000:.0f} ms",
                        0.0,
                    )
        reason, victim = q.push(p, now)
        if reason is not None:
            raise self._refuse(
                p,
                reason,
                "the wait queue is full"
                if reason is Reason.QUEUE_FULL
                else "this caller holds its share of the queue",
                0.0,
            )
        if victim is not None:
            self._settle_refused(victim, Reason.QUEUE_FULL, now)  # type: ignore[arg-type]
        p._state = _QUEUED
        return now

    def _schedule_sweep(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_loop = loop
        at = self._queue.next_expiry(now)
        if at is None:
            self._sweep = None
            self._sweep_at = _INF
            return
        # at least a microsecond: a bound that changes at ``at`` (CoDel's interval ending)
        # may compare a rounding error short when the timer fires exactly then
        self._sweep_at = at
        self._sweep = loop.call_later(max(1e-6, at - now), self._run_sweep, loop)

    def _run_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Timer: refuse every waiter older than the queue's age bound (QUEUE_TIMEOUT)."""
        now = self._clock.now()
        self._expire_aged(now)
        self._schedule_sweep(loop, now)

    def _expire_aged(self, now: float) -> None:
        """Refuse every waiter older than the queue's age bound (QUEUE_TIMEOUT)."""
        for item in self._queue.expire_old(now):
            p: Permit = item  # type: ignore[assignment]
            if p._state == _QUEUED:
                self._settle_refused(p, Reason.QUEUE_TIMEOUT, now)
        self._refill()

    def _expire(self, p: Permit) -> None:
        """Timer: the waiter's deadline passed while it was still queued."""
        if p._state != _QUEUED:
            return
        p._timer = None
        now = self._clock.now()
        self._queue.remove(p, now, Reason.DEADLINE_EXPIRED)
        self._settle_refused(p, Reason.DEADLINE_EXPIRED, now)
        self._refill()

    def _refill(self) -> None:
        """A waiter left the queue without a grant (aged out, expired, its caller gone). If
        it was held back by its share, it kept a free slot from the waiters behind it: hand
        that slot on now, not at the next release (S8: no waiter while a slot is free)."""
        if self._queue.size and self._in_flight < self._limit_value + self._reserve:
            self._drain()

    def _settle_refused(self, p: Permit, reason: Reason, now: float) -> None:
        p._state = _DONE
        timer = p._timer
        if timer is not None:
            timer.cancel()
        waited = now - p.enqueued_at
        p.queue_wait = waited
        fut = p._future
        if fut.done():  # its task was cancelled; the waiter cleans up nothing more (O1)
            expired = reason is Reason.DEADLINE_EXPIRED or now >= p.deadline_at
            _as_waiter(p, self._left_queue, p, now, waited, expired)
            return
        if reason is Reason.DEADLINE_EXPIRED:
            events = self._events
            if events.enabled:
                _as_waiter(
                    p,
                    events.emit,
                    RequestExpired(
                        now, self.name, p.operation, p.priority, p.caller, "queue", waited
                    ),
                )
            fut.set_exception(
                Rejected(reason, f"the deadline passed after {waited * 1000:.0f} ms in queue")
            )
            return
        detail = {
            Reason.QUEUE_TIMEOUT: "waited the longest the queue allows",
            Reason.QUEUE_FULL: "evicted by higher-priority work",
            Reason.OVERLOADED: "shedding this priority under overload",
            Reason.DEADLINE_TOO_SHORT: "too little time left to run after queueing",
        }.get(reason, reason.value)
        fut.set_exception(_as_waiter(p, self._refuse, p, reason, detail, waited, justified=True))

    def _left_queue(self, p: Permit, now: float, waited: float, expired: bool) -> None:
        """Report a waiter whose task was cancelled while it waited: at or after its deadline
        the cancellation is the deadline's (an edge's deadline timer, ``asyncio.timeout``),
        which is an expiry in the queue, as if this bulkhead's own timer had fired first;
        before it, the caller went away (O1)."""
        events = self._events
        if not events.enabled:
            return
        if expired:
            events.emit(
                RequestExpired(now, self.name, p.operation, p.priority, p.caller, "queue", waited)
            )
        else:
            events.emit(RequestAbandoned(now, self.name, p.operation, p.priority, p.caller, waited))

    def _drain(self) -> None:
        """Hand freed slots to waiters, best class first, dropping dead work at the head."""
        q = self._queue
        now = self._clock.now()
        est = self._estimator
        ov = self._overload
        while q.size:
            n = self._in_flight
            if self._forced is not None and not (
                n < self._reserve and q.peek_rank() >= CRITICAL_PLUS_RANK
            ):
                return  # forced full: no slot for waiters (CRITICAL_PLUS has the reserve)
            if n >= self._limit_value and not (
                n < self._limit_value + self._reserve and q.peek_rank() >= CRITICAL_PLUS_RANK
            ):
                return
            if self._held is not None and self._share_blocks(priority_of_rank(q.peek_rank())):
                return  # the best waiter holds its share and may not borrow: keep the slot
            item, reason = q.pop(now)
            p: Permit = item  # type: ignore[assignment]
            if p._state != _QUEUED:  # pragma: no cover - defensive
                continue
            if p._future.done():  # its task was cancelled; the waiter cleans up nothing more
                p._state = _DONE
                if p._timer is not None:
                    p._timer.cancel()
                if reason is None:  # counted as served by the pop: it left, it was not served
                    q.served -= 1
                    q.removed += 1
                # as the waiter reports it when it cleans up (O1)
                _as_waiter(p, self._left_queue, p, now, now - p.enqueued_at, now >= p.deadline_at)
                continue
            if reason is None:
                # D7: check again after taking work off the queue.
                if ov is not None and p.priority < ov.shed_below:
                    reason = Reason.OVERLOADED
                elif est is not None and p.deadline_at != _INF:
                    need = est.estimates.get(p.operation)
                    if need is not None and p.deadline_at - now < need:
                        reason = Reason.DEADLINE_TOO_SHORT
            if reason is not None:
                self._settle_refused(p, reason, now)
                continue
            if p._timer is not None:
                p._timer.cancel()
            self._grant(p, n, now - p.enqueued_at, now, True)
            p._future.set_result(None)

    # -- release ---------------------------------------------------------------------------
    def _release(self, p: Permit, outcome: int, error: str | None) -> None:
        if p._state != _ADMITTED:
            return
        p._state = _DONE
        self._in_flight -= 1
        events = self._events
        start = p.admitted_at
        held = self._held
        if held is not None:
            held[p.priority] -= 1
        row = p._row
        if start > _UNTIMED_SHARED:
            now = self._clock.now()
            rtt = now - start
            if self._adaptive and outcome != _IGNORED:
                lag = self._lag
                if lag is None and self._lag_auto:
                    lag = self._lag = _shared_loop_lag()
                work = rtt
                if lag is not None:
                    # The loop's delay of the wakeup that ends the work is not the work's:
                    # discounted (at most half the sample, so a lag burst cannot zero it).
                    late = lag.mean
                    work = rtt - late if late < rtt * 0.5 else rtt * 0.5
                new = self._limit.on_sample(
                    p.admitted_at, work, p.in_flight_at_admit, outcome == _DROPPED
                )
                if new != self._limit_value:
                    self._set_limit(new, now)
            est = self._estimator
            if est is not None and outcome == _SUCCESS:
                est.observe(p.operation, rtt)
                if self._queue.scales_with_service:
                    self._queue.note_service(rtt, self._limit_value)
            if row is None:
                if events.enabled:
                    self._emit_outcome(p, outcome, error, now, rtt)
            elif outcome == _SUCCESS:  # tallied (inline: one call less per timed request)
                ledger = self._ledger
                assert ledger is not None
                if now <= p.deadline_at:
                    row[_COMPLETED] += 1
                    ledger.latencies.append((p.operation, p.priority, rtt + p.queue_wait))
                else:
                    row[_LATE] += 1
                if now >= ledger.next_flush or len(ledger.latencies) >= _MAX_SAMPLES:
                    ledger.flush(now)
            else:
                row[OTHER] += 1
                self._emit_outcome(p, outcome, error, now, rtt)
        elif row is not None:
            # Tallied and untimed, so no deadline: a success is goodput. Anything else is
            # news; its latency was not measured (NaN).
            if outcome == _SUCCESS:
                row[_COMPLETED] += 1
            else:
                row[OTHER] += 1
                self._emit_outcome(p, outcome, error, self._clock.now(), math.nan)
        if self._queue.size:
            self._drain()

    def _emit_outcome(
        self, p: Permit, outcome: int, error: str | None, now: float, rtt: float
    ) -> None:
        events = self._events
        latency = rtt + p.queue_wait
        if outcome == _SUCCESS:
            events.emit(
                RequestCompleted(
                    now, self.name, p.operation, p.priority, p.caller, latency, now <= p.deadline_at
                )
            )
        elif outcome == _DROPPED and now >= p.deadline_at:
            events.emit(
                RequestExpired(
                    now, self.name, p.operation, p.priority, p.caller, "running", p.queue_wait
                )
            )
        elif outcome == _DROPPED and error == "CancelledError":
            events.emit(
                RequestAbandoned(now, self.name, p.operation, p.priority, p.caller, latency)
            )
        elif outcome != _IGNORED or error is not None:
            events.emit(
                RequestFailed(
                    now, self.name, p.operation, p.priority, p.caller, latency, error or "dropped"
                )
            )

    def _set_limit(self, new: int, now: float) -> None:
        new = max(1, int(new))
        old = self._limit_value
        if new == old:
            return
        self._limit_value = new
        if self._queue_follows_limit:
            self._queue.resize(self._queue_size_for(new))
        if self._events.enabled:
            self._events.emit(LimitChanged(now, self.name, old, new))

    def _queue_size_for(self, limit: int) -> int:
        """The default queue's depth bound: one round trip of work at the limit in force.

        Deeper, a FIFO phase (before CoDel sees a standing queue) adds more than one service
        time of waiting; shallower, a burst shorter than a round trip is refused although
        the slots it needs free within that round trip. While a probing limit pins itself
        low to re-measure the no-load rtt (`Gradient2Limit`, `VegasLimit`: ``estimate``
        stays the limit it will return to) the queue keeps that size: the probe is a
        measurement, not less capacity, and work arriving during it still fits.
        """
        estimate = getattr(self._limit, "estimate", None)
        return max(1, limit, estimate if isinstance(estimate, int) else 0)

    def _refuse(
        self, p: Permit, reason: Reason, detail: str, waited: float, *, justified: bool = False
    ) -> Rejected:
        """Build the refusal (and its event); the caller raises or delivers it.

        ``justified``: the refusal cannot be a false positive (S8) even if slots look free:
        they are kept for higher priorities (shares); or the work already waited its turn out
        (aged out or evicted from the queue; a slot freeing at that instant does not make it
        fresh); or the overload manager sheds this priority because another resource (memory,
        loop lag, file descriptors) is scarce, which concurrency headroom does not disprove.
        """
        p._state = _DONE
        retry_after: float | None = None
        est = self._estimator
        if est is not None and reason in _CAPACITY_REASONS:
            service = est.estimates.get(p.operation)
            if service is not None:
                retry_after = (self._queue.size + 1) * service / self._limit_value
        events = self._events
        if events.enabled:
            now = self._clock.now()
            d_at = p.deadline_at
            events.emit(
                RequestShed(
                    now,
                    self.name,
                    p.operation,
                    p.priority,
                    p.caller,
                    reason,
                    None if d_at == _INF else max(0.0, d_at - now),
                    waited,
                    reason in _CAPACITY_REASONS
                    and not justified
                    and self._in_flight < self._limit_value
                    and self._queue.size == 0,
                    p.retry,
                )
            )
        return Rejected(reason, detail, retry_after=retry_after)

    def __repr__(self) -> str:
        return (
            f"Bulkhead({self.name!r}, in_flight={self._in_flight}, limit={self._limit_value}, "
            f"queued={self._queue.size})"
        )
