"""`Permit`: one admission to a `Bulkhead` and the report of how its work ended.

A permit is the bulkhead's friend: settling it releases the slot through the bulkhead's own
(private) release path, so the two modules change together. `Untracked` is the shared permit
of an admission nothing learns from (`Bulkhead.admit_uncontended`).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from types import TracebackType
from typing import TYPE_CHECKING

from .._errors import Rejected
from .._priority import Priority
from .._tally_buffer import COMPLETED, FAST
from .queues import QueueItem

if TYPE_CHECKING:
    from .bulkhead import Bulkhead

__all__ = [
    "ADMITTED",
    "DONE",
    "DROPPED",
    "FAILED",
    "IGNORED",
    "NEW",
    "QUEUED",
    "SUCCESS",
    "UNTIMED",
    "Permit",
    "Untracked",
]

# A permit's state.
NEW, QUEUED, ADMITTED, DONE = 0, 1, 2, 3
# How its work ended, as the bulkhead's release path takes it.
SUCCESS, FAILED, DROPPED, IGNORED = 0, 1, 2, 3
UNTIMED = -math.inf
"""`Permit.admitted_at` of a permit the bulkhead did not time."""


class Permit(QueueItem):
    """The right to run one unit of work in a bulkhead, and its outcome report.

    Settle it exactly once with `success`, `dropped` or `ignore` (later calls are no-ops); it
    releases the slot and feeds the limit. Also the async context manager returned by
    `Bulkhead.admit`, which settles it from the way the block exits.
    """

    __slots__ = (
        "_bulkhead",
        "_context",
        "_future",
        "_row",
        "_state",
        "_timer",
        "admitted_at",
        "in_flight_at_admit",
        "queue_wait",
    )

    _future: asyncio.Future[None]
    _context: contextvars.Context | None
    """The waiter's context, copied when it queued (while anyone listens), so that what is
    decided for it while it waits is emitted there: a sink reading the current span or
    request sees the waiter's, not those of the task that freed the slot."""
    _row: list[int] | None
    """This permit's row in the bulkhead's `Ledger` while the hub tallies, else None."""
    _timer: asyncio.TimerHandle | None
    """Deadline timer, only when the deadline comes before the queue's age bound."""
    in_flight_at_admit: int
    admitted_at: float
    """When the permit was granted (``-inf`` when the bulkhead did not time this one)."""
    queue_wait: float
    """Seconds spent waiting in the queue before the grant (0.0 on the fast path)."""
    """How many permits were held right after this one was granted (itself included)."""

    def __init__(
        self,
        bulkhead: Bulkhead,
        priority: Priority,
        caller: str,
        operation: str,
        deadline_at: float,
        in_progress: bool,
        retry: bool = False,
    ) -> None:
        self._bulkhead = bulkhead
        self.priority = priority
        self.caller = caller
        self.operation = operation
        self.deadline_at = deadline_at
        self.in_progress = in_progress
        self.retry = retry
        self._state = NEW
        self._row = None
        # queued, queue_wait, admitted_at are set when they become meaningful (hot path).

    # -- outcome reports -------------------------------------------------------------------
    def success(self) -> None:
        """The work completed: release the slot; its rtt is a sample for the limit."""
        if self.admitted_at == UNTIMED and self._row is None and self._state == ADMITTED:
            # Untimed and untallied (see `__aexit__`): nothing to learn, nothing to count.
            self._state = DONE
            b = self._bulkhead
            b._in_flight -= 1
            if b._queue.size:
                b._drain()
            return
        self._bulkhead._release(self, SUCCESS, None)

    def dropped(self) -> None:
        """The work was dropped, timed out or cancelled: release; the limit backs off."""
        self._bulkhead._release(self, DROPPED, None)

    def ignore(self) -> None:
        """Release without teaching the limit anything (the work never really ran)."""
        self._bulkhead._release(self, IGNORED, None)

    def failed(self, error: str = "error") -> None:
        """The work ran and failed: release; a success for the limit, `RequestFailed` event."""
        self._bulkhead._release(self, FAILED, error)

    @property
    def settled(self) -> bool:
        """True once the permit was released (or refused)."""
        return self._state == DONE

    # -- async context manager -------------------------------------------------------------
    async def __aenter__(self) -> Permit:
        b = self._bulkhead
        n = b._in_flight
        # Fast path, inlined: a plain bulkhead (no adaptive limit, no overload manager) with
        # room and nothing queued, and either nobody listening or every sink taking tallies.
        if n < b._limit_value and b._plain and not b._queue.size:
            d_at = self.deadline_at
            row = self._row
            if row is not None:
                # Tallied (see `admit`): count, build no event. With a deadline, the full
                # path times the work (within the deadline or late is decided at release).
                fast = d_at == math.inf
            else:
                # With a deadline, only work that clearly fits stays on the fast path;
                # refusals (expired, too short) take the full path below, which reports them.
                fast = not b._events.enabled and (d_at == math.inf or b._fits(self.operation, d_at))
            if fast:
                if row is not None:
                    row[FAST] += 1
                n += 1
                b._in_flight = n
                self.in_flight_at_admit = n
                self.queue_wait = 0.0
                self._state = ADMITTED
                tick = b._tick - 1
                if tick:
                    b._tick = tick
                    self.admitted_at = UNTIMED
                else:
                    b._time_sample(self)
                return self
        if not b._admit_now(self):
            b._refuse_if_lagging(self)
            await b._wait(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != ADMITTED:
            return
        if exc_type is None:
            if self.admitted_at == UNTIMED:  # fast path: nothing to learn, nothing to emit
                self._state = DONE
                b = self._bulkhead
                b._in_flight -= 1
                row = self._row
                if row is not None:  # tallied, no deadline (those are timed): goodput
                    row[COMPLETED] += 1
                if b._queue.size:
                    b._drain()
                return
            self._bulkhead._release(self, SUCCESS, None)
        else:
            self.settle_raised(exc_type)

    def settle_raised(self, exc_type: type[BaseException]) -> None:
        """Settle by the exception the work raised, as ``async with`` does: a timeout or a
        cancellation is a drop, a downstream `brownout.Rejected` is ignored, anything else
        failed (for adapters that hold a permit without the context manager)."""
        if issubclass(exc_type, (TimeoutError, asyncio.CancelledError)):
            self._bulkhead._release(self, DROPPED, exc_type.__name__)
        elif issubclass(exc_type, Rejected):
            self._bulkhead._release(self, IGNORED, exc_type.__name__)
        else:
            self._bulkhead._release(self, FAILED, exc_type.__name__)

    def __repr__(self) -> str:
        state = ("new", "queued", "admitted", "done")[self._state]
        return f"<Permit {self._bulkhead.name} {self.priority.label} {state}>"


class Untracked:
    """An admission nothing learns from (`Bulkhead.admit_uncontended`): settling it only
    frees the slot. One per bulkhead, shared by every such admission; the caller settles
    each admission exactly once (nothing here can tell two apart)."""

    __slots__ = ("_bulkhead",)

    def __init__(self, bulkhead: Bulkhead) -> None:
        self._bulkhead = bulkhead

    def success(self) -> None:
        b = self._bulkhead
        b._in_flight -= 1
        if b._queue.size:
            b._drain()

    def failed(self, error: str = "error") -> None:
        # Untracked only while nobody listens (the hub was off): nothing to report.
        self.success()

    def ignore(self) -> None:
        self.success()

    def settle_raised(self, exc_type: type[BaseException]) -> None:
        self.success()
