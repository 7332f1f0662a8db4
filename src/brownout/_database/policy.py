"""`DatabasePolicy`: what brownout applies to one database, whatever its driver.

- **The pool is admission** (A1, A3): a `Bulkhead` as large as the connection pool holds the
  waiters, in priority order, for at most what their deadline allows and at most the queue's
  age bound; refusals are the bulkhead's (`Rejected`: ``queue_timeout``, ``queue_full``,
  ``deadline_too_short``, ...) and so are its events and gauges. A request whose deadline
  leaves less than ``min_useful`` is refused before it waits (D4).
- **The deadline reaches the statement** (D4, D5): each statement runs with
  `statement_budget` (the remaining deadline less the reserve, capped at ``timeout``); the
  driver adapter hands it to the driver, which sends the server a cancel request when it runs
  out (or when the request's deadline cancels the task).
- **A lost COMMIT is an unknown outcome** (D6): a timeout, a cancellation or a dropped
  connection while ``COMMIT`` was on the wire raises `UnknownOutcome` with the transaction's
  idempotency key, recorded in the ``ledger`` when one is given.

Adapters (`brownout.integrations.asyncpg`) only translate: they pass the driver's calls in as
``run(budget)`` callables and say which driver errors mean a lost connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TypeVar

from .._admission.bulkhead import Bulkhead
from .._admission.limits import FixedLimit
from .._admission.permit import Permit, Untracked
from .._admission.queues import FifoQueue
from .._clock import Clock, default_clock
from .._context import current, current_deadline
from .._errors import DeadlineExceeded, Reason, Rejected, UnknownOutcome
from .._overload.signals import InFlight, QueueAge, Signal
from .._retry.idempotency import OutcomeLedger, ledger_name, record_shielded
from .._retry.outbound import ATTEMPT_EDGE, attempt_budget
from ..events import (
    EventHub,
    LedgerWriteFailed,
    OutcomeUnknown,
    RequestOffered,
    RequestShed,
    StatementCancelled,
)
from ..events import hub as default_hub
from .keys import IdempotencyTable
from .watchdog import Watchdog

__all__ = ["DatabasePolicy"]

T = TypeVar("T")
E = TypeVar("E", bound=Exception)

_REFUSED = -1.0  # `DatabasePolicy._budget`: refused (a budget is never negative)
_log = logging.getLogger("brownout.database")


class DatabasePolicy:
    """Admission, statement budgets and the commit rule for one database (driver-free).

    ``max_size`` is the connection pool's size: the bulkhead's fixed limit, so no request
    waits inside the driver's pool. ``max_wait`` bounds a waiter's queue age (seconds) and
    ``max_queue`` the waiters (default four per connection). ``timeout`` is a statement's
    normal timeout (``None``: only the deadline bounds it), ``reserve`` is kept back from the
    deadline for the answer, and a statement with less than ``min_useful`` left is refused
    before it is sent. ``bulkhead`` replaces the default one (its limit should not exceed
    the pool). ``table`` names the idempotency-key table; ``ledger`` records unknown commits.
    """

    __slots__ = (
        "_cap",
        "_clock",
        "_edge",
        "_events",
        "bulkhead",
        "ledger",
        "max_wait",
        "min_useful",
        "name",
        "reserve",
        "table",
        "timeout",
        "watchdog",
    )

    def __init__(
        self,
        name: str,
        *,
        max_size: int,
        max_wait: float = 0.5,
        max_queue: int | None = None,
        timeout: float | None = None,
        reserve: float = 0.0,
        min_useful: float = 0.0,
        bulkhead: Bulkhead | None = None,
        ledger: OutcomeLedger | None = None,
        table: IdempotencyTable | None = None,
        clock: Clock | None = None,
        events: EventHub = default_hub,
    ) -> None:
        if not isinstance(max_size, int) or max_size < 1:
            raise ValueError("max_size must be an int >= 1 (the connection pool's size)")
        if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 1):
            # The bulkhead's queues hold one at least; a short max_wait is how not to wait.
            raise ValueError(
                "max_queue must be an int >= 1 (the waiters; or None: 4 per connection)"
            )
        if not 0.0 < max_wait < math.inf:  # NaN too: a queue is bounded in age (A3)
            raise ValueError("max_wait must be positive and finite")
        if timeout is not None and not 0.0 < timeout < math.inf:
            raise ValueError("timeout must be positive and finite (or None)")
        if not (0.0 <= reserve < math.inf and 0.0 <= min_useful < math.inf):
            # A negative reserve would let a statement outlive its request's deadline.
            raise ValueError("reserve and min_useful must be finite and >= 0")
        if timeout is not None and timeout < min_useful:
            raise ValueError("timeout must be >= min_useful")
        self.name = name
        self.timeout = timeout
        self.reserve = reserve
        self.min_useful = min_useful
        # `attempt_budget`'s bounds, worked out once: every statement reads them.
        self._cap = math.inf if timeout is None else timeout
        self._edge = reserve if reserve > ATTEMPT_EDGE else ATTEMPT_EDGE
        self.max_wait = max_wait
        self.ledger = ledger
        self.table = table if table is not None else IdempotencyTable()
        self._clock = clock if clock is not None else default_clock()
        self._events = events
        if bulkhead is None:
            queue = FifoQueue(max_queue if max_queue is not None else 4 * max_size, max_wait)
            # No CRITICAL_PLUS reserve: above the pool's size there is no connection to give.
            bulkhead = Bulkhead(
                name, FixedLimit(max_size), queue, reserve=0, clock=clock, events=events
            )
        self.bulkhead = bulkhead
        # One timer for every running statement's budget (adapters that cancel themselves).
        self.watchdog = Watchdog()

    # -- admission --------------------------------------------------------------------------

    def admit(self) -> Permit:
        """``async with policy.admit():`` holds one of the pool's places (waiting for it in
        priority order, bounded by the deadline and ``max_wait``), or raises `Rejected`.
        Too little time left for a statement refuses here, before waiting (D4)."""
        self.check_time_left()
        return self.bulkhead.admit()

    def admit_now(self) -> tuple[Permit | Untracked, float | None] | None:
        """Admission at once and the first statement's budget, when nothing stands in the way
        (`Bulkhead.admit_uncontended`: room, nobody waiting, no shedding); else ``None`` with
        nothing counted, and the caller takes `admit`. One read of the deadline for both.
        Too little time left raises `Rejected` as `admit` does (D4). The permit is settled
        exactly once (``success`` or ``settle_raised``)."""
        ctx = current()
        deadline = ctx.deadline
        bulkhead = self.bulkhead
        if deadline is None:
            budget = self.timeout
            left = math.inf
            now = bulkhead.clock.now()
        else:
            clock = bulkhead.clock
            now = clock.now()
            left = deadline.at - (now if deadline.clock is clock else deadline.clock.now())
            budget = self._budget(left, self.min_useful)
            if budget == _REFUSED:
                self.check_time_left()  # refuses, reported as offered and shed
                budget = self.statement_budget()
        permit = bulkhead.admit_uncontended(ctx.priority, ctx.caller, ctx.operation, now, left)
        return None if permit is None else (permit, budget)

    def check_time_left(self) -> None:
        """Before admission: too little time left for a statement raises `Rejected`
        (``deadline_too_short`` or ``deadline_expired``) before the request waits (D4),
        reported as offered and shed (the bulkhead never saw it)."""
        deadline = current_deadline()
        if deadline is None:
            return
        try:
            attempt_budget(
                self.timeout, reserve=self.reserve, min_useful=self.min_useful, deadline=deadline
            )
        except Rejected as refused:
            raise self._refuse(refused.reason, f"{self.name}: {refused.detail}") from None

    # -- statements -------------------------------------------------------------------------

    def statement_budget(self) -> float | None:
        """How long the next statement may run (D4): ``timeout`` capped at the remaining
        deadline less the reserve; ``None`` for no bound. Too little left raises `Rejected`
        (``deadline_too_short`` or ``deadline_expired``) before anything is sent, with no
        event of its own: the admission holding the connection reports how the request ended."""
        deadline = current_deadline()
        if deadline is None:
            return self.timeout
        budget = self._budget(deadline.at - deadline.clock.now(), self.min_useful)
        if budget != _REFUSED:
            return budget
        try:
            return attempt_budget(
                self.timeout, reserve=self.reserve, min_useful=self.min_useful, deadline=deadline
            )
        except Rejected as refused:
            raise Rejected(refused.reason, f"{self.name}: {refused.detail}") from None

    def _budget(self, left: float, floor: float) -> float | None:
        """`attempt_budget`'s answer with ``left`` seconds to the deadline, worked out inline
        while it fits (every statement's path); `_REFUSED` when it refuses, and the caller
        asks `attempt_budget` itself for the refusal."""
        budget = left - self._edge
        if budget > self._cap:
            budget = self._cap
        if left > 0.0 and budget > 0.0 and budget >= floor:
            return None if budget == math.inf else budget
        return _REFUSED

    async def statement(self, run: Callable[[float | None], Awaitable[T]]) -> T:
        """Await ``run(budget)``, the driver's statement with its timeout set to the budget.

        The driver's `TimeoutError` (its cancel request sent) becomes `DeadlineExceeded`; a
        cancellation passes through. Both are reported as `StatementCancelled`."""
        budget = self.statement_budget()
        started = self.started()
        try:
            return await run(budget)
        except asyncio.CancelledError:
            self.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise self.timed_out(error, budget, started) from error

    def started(self) -> float:
        """When a statement starts, for the event of a stopped one (read only when an event
        will need it)."""
        return self._clock.now() if self._events.enabled else 0.0

    def cancelled(self, budget: float | None, started: float) -> None:
        """The task running a statement was cancelled (the driver sent the server its cancel
        request): reported as `StatementCancelled`, the cancellation goes on."""
        self._cancelled(started, budget, self._why_cancelled())

    def timed_out(self, error: TimeoutError, budget: float | None, started: float) -> TimeoutError:
        """What to raise for a statement the driver stopped at its budget (its cancel request
        sent): `DeadlineExceeded`, reported as `StatementCancelled`. Adapters that call the
        driver inline (no `statement` frame) raise what this returns."""
        if isinstance(error, DeadlineExceeded):
            return error
        self._cancelled(started, budget, "timeout")
        return DeadlineExceeded(
            f"{self.name}: statement stopped at its budget"
            + ("" if budget is None else f" of {budget * 1000:.0f} ms")
        )

    def connect_timed_out(self, error: E, budget: float | None) -> E | DeadlineExceeded:
        """What to raise when no connection came in time (a pool's wait or a connect that
        timed out): with ``budget`` the bound the adapter set from `statement_budget`, the
        deadline's: `DeadlineExceeded`, caused by ``error`` (the admission holding the place
        reports how the request ended). With ``None`` the bound was the driver's or the
        caller's own, and ``error`` is raised as it is."""
        if budget is None or isinstance(error, DeadlineExceeded):
            return error
        exceeded = DeadlineExceeded(
            f"{self.name}: no connection within the statement budget of {budget * 1000:.0f} ms"
        )
        exceeded.__cause__ = error
        return exceeded

    # -- commits ----------------------------------------------------------------------------

    def commit_budget(self) -> float | None:
        """How long ``COMMIT`` may take: the statement budget without ``min_useful`` (the
        work is done; only an expired deadline refuses, and then nothing was committed)."""
        deadline = current_deadline()
        if deadline is None:
            return self.timeout
        budget = self._budget(deadline.at - deadline.clock.now(), 0.0)
        if budget != _REFUSED:
            return budget
        try:
            return attempt_budget(
                self.timeout, reserve=self.reserve, min_useful=0.0, deadline=deadline
            )
        except Rejected as refused:  # admitted: the admission reports how it ended
            raise Rejected(refused.reason, f"{self.name}: {refused.detail}") from None

    async def commit(
        self,
        run: Callable[[float | None], Awaitable[T]],
        key: str | None,
        *,
        lost: Callable[[BaseException], bool],
    ) -> T:
        """Await ``run(budget)``, the driver's ``COMMIT`` (D6).

        Raises `Rejected` (nothing sent: the caller rolls back) when the deadline has
        passed. When the answer is lost (a `TimeoutError`, a cancellation, or an error
        ``lost`` says is a dropped connection) the transaction may or may not have committed:
        `UnknownOutcome` with ``key`` (a cancellation is re-raised after it is recorded).
        Any other error is the server's answer (not committed) and passes through."""
        budget = self.commit_budget()
        started = self.started()
        try:
            return await run(budget)
        except asyncio.CancelledError as cancelled:
            self._cancelled(started, budget, self._why_cancelled())
            await self._unknown(key, cancelled)
            raise
        except Exception as error:
            if not (isinstance(error, TimeoutError) or lost(error)):
                raise
            if isinstance(error, TimeoutError):
                self._cancelled(started, budget, "timeout")
            raise await self._unknown(key, error) from error

    async def _unknown(self, key: str | None, cause: BaseException) -> UnknownOutcome:
        unknown = UnknownOutcome(
            key,
            f"{self.name}: the answer to COMMIT was lost ({type(cause).__name__});"
            f" reconcile idempotency key {key!r}",
        )
        unknown.__cause__ = cause
        if self._events.enabled:
            ctx = current()
            self._events.emit(
                OutcomeUnknown(
                    self._clock.now(), self.name, ctx.operation, ctx.priority, ctx.caller, key
                )
            )
        if self.ledger is not None and key is not None:
            # Shielded: a cancelled caller must not cut off the only record of the commit.
            await record_shielded(
                self.ledger, key, unknown, source=self.name, failed=self._ledger_failed
            )
        return unknown

    def _ledger_failed(self, ledger: OutcomeLedger, key: str, error: BaseException) -> None:
        name = ledger_name(ledger)
        _log.error(
            "%s: could not record the unknown commit of idempotency key %r in ledger %s",
            self.name,
            key,
            name,
            exc_info=error,
        )
        if self._events.enabled:
            self._events.emit(
                LedgerWriteFailed(self._clock.now(), self.name, name, key, type(error).__name__)
            )

    # -- observability ----------------------------------------------------------------------

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Connections in use (``in_flight``), the pool's size (``limit``), waiters
        (``queue_depth``) and the oldest wait (``queue_oldest_age``), labelled with the
        database's name (`brownout.Stats.watch`)."""
        yield from self.bulkhead.gauges()

    def signals(self, *, max_wait: float | None = None) -> list[Signal]:
        """Overload signals for an `OverloadManager`: pool saturation (connections in use
        over the pool's size) and pool wait (the oldest waiter's age over ``max_wait``,
        default the queue's bound)."""
        bound = self.max_wait if max_wait is None else max_wait
        return [InFlight(self.bulkhead), QueueAge(self.bulkhead, bound)]

    # -- helpers ----------------------------------------------------------------------------

    def _why_cancelled(self) -> str:
        deadline = current_deadline()
        return "deadline" if deadline is not None and deadline.expired else "cancelled"

    def _cancelled(self, started: float, budget: float | None, stage: str) -> None:
        if self._events.enabled:
            ctx = current()
            now = self._clock.now()
            self._events.emit(
                StatementCancelled(
                    now,
                    self.name,
                    ctx.operation,
                    ctx.priority,
                    ctx.caller,
                    stage,
                    budget,
                    now - started,
                )
            )

    def _refuse(self, reason: Reason, detail: str) -> Rejected:
        """A request refused before the bulkhead saw it: offered and shed, as the bulkhead
        reports its own refusals (offered = admitted + shed + left the queue)."""
        if self._events.enabled:
            ctx = current()
            now = self._clock.now()
            remaining = ctx.remaining()
            self._events.emit(
                RequestOffered(now, self.name, ctx.operation, ctx.priority, ctx.caller, remaining)
            )
            self._events.emit(
                RequestShed(
                    now, self.name, ctx.operation, ctx.priority, ctx.caller, reason, remaining, 0.0
                )
            )
        return Rejected(reason, detail)

    def __repr__(self) -> str:
        return (
            f"DatabasePolicy({self.name!r}, max_size={self.bulkhead.limit},"
            f" timeout={self.timeout}, reserve={self.reserve})"
        )
