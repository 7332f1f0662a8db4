"""`ThreadBulkhead`: the `Bulkhead` for threads (A1, A2, S1).

The same limits, priorities, shares, bounded queue (size and age), deadline checks, events and
ledger as the asyncio `Bulkhead`, decided by the same code: this class only adds a lock around
every state change and a blocking wait. ``with bulkhead.admit():`` blocks the calling thread
while its permit waits in the queue, and raises `brownout.Rejected` when refused.

A waiter blocks on its own `concurrent.futures.Future` (granted or refused by whichever thread
frees a slot), with a timeout of its deadline or the queue's next age bound, whichever comes
first. A waiter that wakes on that timeout runs the age sweep and the deadline expiries itself,
under the lock: no timer thread. Event sinks run under the bulkhead's lock: a sink must not
call back into the same bulkhead.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import TracebackType
from typing import ParamSpec, TypeVar, cast

from .._clock import Clock, MonotonicClock
from .._deadline import Deadline
from .._errors import Reason, Rejected
from .._priority import Priority
from ..events import EventHub, RequestQueued
from .bulkhead import Bulkhead, OverloadState
from .estimator import LatencyEstimator
from .limits import Gradient2Limit, Limit
from .permit import ADMITTED, QUEUED, Permit, Untracked
from .queues import FifoQueue, WaitQueue
from .thread_split import split_threads

__all__ = ["ThreadBulkhead", "ThreadPermit"]

P = ParamSpec("P")
R = TypeVar("R")

_MIN_WAIT = 1e-4  # a bound due "now" that rounding kept in the queue: recheck soon, do not spin


class ThreadPermit(Permit):
    """A `Permit` of a `ThreadBulkhead`: settling it takes the bulkhead's lock.

    ``with bulkhead.admit() as permit:`` blocks until admitted; leaving the block settles it
    as ``async with`` does (a `TimeoutError`, `brownout.DeadlineExceeded` included, is a drop;
    a downstream `brownout.Rejected` is ignored; any other exception failed). ``async with``
    works too, from an event loop sharing the bulkhead with threads.
    """

    __slots__ = ()

    _bulkhead: ThreadBulkhead

    def success(self) -> None:
        with self._bulkhead._lock:
            Permit.success(self)

    def dropped(self) -> None:
        with self._bulkhead._lock:
            Permit.dropped(self)

    def ignore(self) -> None:
        with self._bulkhead._lock:
            Permit.ignore(self)

    def failed(self, error: str = "error") -> None:
        with self._bulkhead._lock:
            Permit.failed(self, error)

    def settle_raised(self, exc_type: type[BaseException]) -> None:
        with self._bulkhead._lock:
            Permit.settle_raised(self, exc_type)

    def __enter__(self) -> ThreadPermit:
        self._bulkhead._enter(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != ADMITTED:  # settled inside the block, or never admitted
            return
        with self._bulkhead._lock:
            if exc_type is None:
                Permit.success(self)
            else:
                Permit.settle_raised(self, exc_type)

    async def __aenter__(self) -> ThreadPermit:
        await self._bulkhead._enter_async(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class _ThreadUntracked(Untracked):
    """`Untracked` for a `ThreadBulkhead`: freeing the slot takes the lock."""

    __slots__ = ()

    _bulkhead: ThreadBulkhead

    def success(self) -> None:
        with self._bulkhead._lock:
            Untracked.success(self)


class ThreadBulkhead(Bulkhead):
    """A concurrency budget shared by threads: `Bulkhead`'s decisions, a blocking wait.

    Takes `Bulkhead`'s arguments but ``loop_lag`` and ``shed_lag`` (threads have no event
    loop to lag); the default clock is ``time.monotonic()`` (`MonotonicClock`).

    - ``with bulkhead.admit(...) as permit:`` blocks while queued; `brownout.Rejected` when
      refused. Fields not given come from the request context, as in `Bulkhead.admit`.
    - ``bulkhead.try_admit(...)``: a permit now or `brownout.Rejected`; settle it yourself.
    - ``@bulkhead`` on a plain function: each call runs under a permit.
    - ``async with bulkhead.admit():`` from an event loop waits without blocking the loop.

    Every wait is bounded by the queue's age bound and the waiter's deadline. A request
    served by a pool of threads holds its thread while it waits: `for_threads` sizes the
    limit and the queue to leave threads free to refuse.
    """

    @classmethod
    def for_threads(
        cls,
        name: str,
        threads: int,
        *,
        spare: int | None = None,
        queued: int | None = None,
        max_wait: float = 0.1,
        initial: int | None = None,
        clock: Clock | None = None,
        events: EventHub | None = None,
    ) -> ThreadBulkhead:
        """A bulkhead for requests each served on one of ``threads`` threads.

        Its limit is a `Gradient2Limit` capped at the threads left running, starting at
        ``initial`` (default: that cap, which the threads bound anyway; lower, the limit
        refuses load the threads could serve until it has grown); its queue a `FifoQueue` of the
        threads left queued, each waiting at most ``max_wait`` seconds; ``spare`` threads are
        never held, so the excess is refused at once (sizes: `split_threads`; defaults: half
        the threads spare, a quarter of the rest queued). A queue holds at least one place:
        with ``queued`` 0 (fewer than 4 threads left) one spare thread may wait ``max_wait``.
        """
        split = split_threads(threads, spare, queued)
        start = split.running if initial is None else initial
        if not 1 <= start <= split.running:
            raise ValueError(f"initial must be in [1, {split.running}]: got {start}")
        return cls(
            name,
            Gradient2Limit(start, min_limit=1, max_limit=split.running),
            FifoQueue(max_size=max(1, split.queued), max_wait=max_wait),
            clock=clock,
            events=events,
        )

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
    ) -> None:
        super().__init__(
            name,
            limit,
            queue,
            reserve=reserve,
            clock=clock if clock is not None else MonotonicClock(),
            events=events,
            estimator=estimator,
            overload=overload,
            deadline_aware=deadline_aware,
            estimate_every=estimate_every,
            shares=shares,
            loop_lag=None,
        )
        self._lock = threading.Lock()
        self._untracked = _ThreadUntracked(self)
        self._waiting: set[ThreadPermit] = set()

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
    ) -> ThreadPermit:
        """``with bulkhead.admit(): ...`` runs the block under a permit (see the class)."""
        with self._lock:  # a tallying hub's ledger rows are made here
            p = Bulkhead.admit(
                self,
                priority=priority,
                caller=caller,
                operation=operation,
                deadline=deadline,
                in_progress=in_progress,
                retry=retry,
            )
        p.__class__ = ThreadPermit
        return cast(ThreadPermit, p)

    def try_admit(
        self,
        *,
        priority: Priority | None = None,
        caller: str | None = None,
        operation: str | None = None,
        deadline: Deadline | None = None,
        in_progress: bool | None = None,
        retry: bool | None = None,
    ) -> ThreadPermit:
        """A permit now, or `brownout.Rejected` (never waits). Settle the permit yourself."""
        p = self.admit(
            priority=priority,
            caller=caller,
            operation=operation,
            deadline=deadline,
            in_progress=in_progress,
            retry=retry,
        )
        with self._lock:
            self._admit_or_refuse(p)
        return p

    def admit_uncontended(
        self,
        priority: Priority,
        caller: str,
        operation: str,
        now: float,
        budget: float,
    ) -> Permit | Untracked | None:
        """`Bulkhead.admit_uncontended`, under the lock; the result settles under it too."""
        with self._lock:
            p = Bulkhead.admit_uncontended(self, priority, caller, operation, now, budget)
        if p is not None and type(p) is Permit:
            p.__class__ = ThreadPermit
        return p

    def force_full(self, on: bool = True, *, reason: Reason = Reason.QUEUE_FULL) -> None:
        """`Bulkhead.force_full`, under the lock."""
        with self._lock:
            Bulkhead.force_full(self, on, reason=reason)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorate a plain function: each call runs under a permit of this bulkhead."""

        @functools.wraps(fn)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.admit():
                return fn(*args, **kwargs)

        return guarded

    def sweep(self) -> None:
        """Refuse the waiters past the queue's age bound or their deadline, now.

        Waiters do this themselves when their wait times out; call it after moving a
        `ManualClock` (tests on virtual time), where real timeouts do not follow the clock.
        """
        with self._lock:
            self._sweep_due(self._clock.now())

    # -- waiting ---------------------------------------------------------------------------
    def _enter(self, p: ThreadPermit) -> None:
        with self._lock:
            if self._admit_now(p):
                return
            fut, since, timeout = self._queue_waiter(p)
        try:
            while True:
                try:
                    fut.result(timeout)  # returns once granted; raises Rejected once refused
                    return
                except TimeoutError:
                    pass
                timeout = self._on_timeout(p, fut)
        except Rejected:
            raise
        except BaseException:  # interrupted while waiting: leave the queue, or the slot
            with self._lock:
                self._waiter_gone(p, since)
            raise
        finally:
            with self._lock:
                self._waiting.discard(p)

    async def _enter_async(self, p: ThreadPermit) -> None:
        with self._lock:
            if self._admit_now(p):
                return
            fut, since, timeout = self._queue_waiter(p)
        waiter = asyncio.wrap_future(fut)
        try:
            while True:
                done, _ = await asyncio.wait((waiter,), timeout=timeout)
                if done:
                    waiter.result()
                    return
                timeout = self._on_timeout(p, fut)
        except Rejected:
            raise
        except BaseException:  # cancelled while waiting: leave the queue, or the slot
            with self._lock:
                self._waiter_gone(p, since)
            raise
        finally:
            with self._lock:
                self._waiting.discard(p)

    def _queue_waiter(self, p: ThreadPermit) -> tuple[Future[None], float, float | None]:
        """Queue ``p`` (the lock held): its future, when it queued, and its first timeout."""
        now = self._enqueue(p)
        fut: Future[None] = Future()
        p._future = fut  # type: ignore[assignment]
        p._timer = None
        self._waiting.add(p)
        events = self._events
        if events.enabled:
            p._context = contextvars.copy_context()
            events.emit(
                RequestQueued(now, self.name, p.operation, p.priority, p.caller, self._queue.size)
            )
        else:
            p._context = None
        return fut, now, self._timeout(p, now)

    def _on_timeout(self, p: ThreadPermit, fut: Future[None]) -> float | None:
        """A waiter's wait timed out: sweep, and how long to wait next."""
        with self._lock:
            if fut.done():
                return 0.0
            now = self._clock.now()
            self._sweep_due(now)
            return 0.0 if fut.done() else self._timeout(p, now)

    def _timeout(self, p: ThreadPermit, now: float) -> float | None:
        """Until the waiter's deadline or the queue's next age bound (None: neither)."""
        at = p.deadline_at
        due = self._queue.next_expiry(now)
        if due is not None and due < at:
            at = due
        if at == float("inf"):
            return None
        return max(_MIN_WAIT, at - now)

    def _sweep_due(self, now: float) -> None:
        self._expire_aged(now)
        for p in [w for w in self._waiting if w._state == QUEUED and w.deadline_at <= now]:
            self._expire(p)
