"""The request context a message's handler runs in, with its deadline enforced the way
``async with brownout.request(...)`` enforces it, but without a loop timer per message.

Most messages end long before their deadline, so a timer armed and cancelled for each one is
wasted work. `MessageScope` arms its timer at once only when the deadline is near (within
two sweep periods); the others wait in a `MessageSweeper`, one loop timer per runner that
arms the timers of the messages still running after a sweep period, always before their
deadline. At expiry the handler's task is cancelled and `DeadlineExceeded` raised, exactly as
by the request scope.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from .._clock import current_task_of, default_clock, loop_or_none
from .._context import RequestContext, get_current, make_context, reset_current, set_current
from .._deadline import new_deadline
from .._errors import DeadlineExceeded
from .envelope import Envelope

__all__ = ["SWEEP_PERIOD", "MessageScope", "MessageSweeper"]

SWEEP_PERIOD = 1.0
"""Seconds between sweeps; a deadline within two periods gets its timer at once."""
_CLOCK = default_clock()


class MessageSweeper:
    """One loop timer for the messages of one runner (per event loop): every ``period``
    seconds it arms the deadline timers of the messages running for longer than ``period``.
    A message costs a dictionary insert and delete."""

    __slots__ = ("loop", "pending", "period", "timer")

    def __init__(self, period: float = SWEEP_PERIOD) -> None:
        self.period = period
        self.pending: dict[MessageScope, float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, scope: MessageScope, started: float, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self.loop:  # another loop (tests, a restart): start afresh
            if self.timer is not None:
                self.timer.cancel()
            self.pending.clear()
            self.timer = None
            self.loop = loop
        self.pending[scope] = started
        if self.timer is None:
            self.timer = loop.call_later(self.period, self._sweep)

    def _sweep(self) -> None:
        self.timer = None
        pending = self.pending
        loop = self.loop
        if not pending or loop is None:
            return
        cutoff = loop.time() - self.period
        for scope, started in list(pending.items()):
            if started > cutoff:
                break  # insertion order is start order: the rest are younger
            del pending[scope]
            scope.arm(loop)
        if pending:
            self.timer = loop.call_later(self.period, self._sweep)


class MessageScope:
    """The handler's request context (deadline, priority, caller, operation, attempt,
    idempotency key), set by `enter` and restored by `exit`. Fields left ``None`` keep the
    enclosing context's, and the deadline only shortens it, as with `brownout.request`."""

    __slots__ = ("_at", "_cancelling", "_expired", "_handle", "_sweeper", "_task", "_token")

    def __init__(self) -> None:
        self._at = 0.0
        self._cancelling = 0
        self._expired = False
        self._handle: asyncio.TimerHandle | None = None
        self._sweeper: MessageSweeper | None = None
        self._task: asyncio.Task[Any] | None = None
        self._token: contextvars.Token[RequestContext] | None = None

    def enter(
        self, budget: float | None, envelope: Envelope, attempt: int, sweeper: MessageSweeper
    ) -> RequestContext:
        """Set the context for a message with ``budget`` seconds (``None``: no bound of its
        own). Raises `DeadlineExceeded` when the deadline already passed."""
        parent = get_current()
        deadline = parent.deadline
        loop = loop_or_none() or asyncio.get_running_loop()
        now = loop.time()
        if budget is not None:
            at = now + budget
            if deadline is None:
                deadline = new_deadline(at)
            elif deadline.clock is _CLOCK:
                if at < deadline.at:
                    deadline = new_deadline(at, deadline.origin)
            elif deadline.remaining() > budget:
                deadline = new_deadline(at, deadline.origin)
        key = envelope.idempotency_key
        ctx = make_context(
            deadline,
            envelope.priority,
            envelope.caller,
            envelope.operation,
            attempt,
            parent.idempotency_key if key is None else key,
            parent.in_progress,
            parent.started_at,
        )
        if deadline is None:
            self._token = set_current(ctx)
            return ctx
        if deadline.clock is _CLOCK:
            at, left = deadline.at, deadline.at - now
        else:  # a foreign clock: translate the remaining time onto the loop's clock
            left = deadline.remaining()
            at = now + left
        if left <= 0.0:
            raise DeadlineExceeded("the deadline expired before the work started")
        task = current_task_of(loop)
        if task is None:
            raise RuntimeError("a message's scope must run inside a task")
        self._token = set_current(ctx)
        self._task = task
        self._cancelling = task.cancelling()
        self._at = at
        if left <= 2 * sweeper.period:
            self._handle = loop.call_at(at, self._on_expiry)
        else:
            self._sweeper = sweeper
            sweeper.add(self, now, loop)
        return ctx

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The sweeper's call: the message outlived a sweep period, so it gets its timer."""
        if self._task is not None and self._handle is None:
            self._handle = loop.call_at(self._at, self._on_expiry)

    def _on_expiry(self) -> None:
        self._handle = None
        self._expired = True
        if self._task is not None:
            self._task.cancel()

    def exit(self, error: BaseException | None) -> None:
        """Restore the context. Raises `DeadlineExceeded` (from ``error``) when the handler
        was cancelled at this deadline; any other cancellation keeps propagating."""
        if self._token is not None:
            reset_current(self._token)
            self._token = None
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        sweeper = self._sweeper
        if sweeper is not None:
            sweeper.pending.pop(self, None)
            self._sweeper = None
        task = self._task
        self._task = None
        if (
            self._expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and isinstance(error, asyncio.CancelledError)
        ):
            raise DeadlineExceeded("the deadline expired; the work was cancelled") from error
