"""The request context: one contextvar carrying what every decision needs.

`RequestContext` holds the deadline, priority, caller, operation, attempt number and
idempotency key of the work being done. It lives in a `contextvars.ContextVar`, so it follows
the work across ``await``, into tasks (which copy the context when created) and into
``asyncio.to_thread`` (which copies it too). ``loop.run_in_executor`` and raw threads do *not*
copy it: wrap the callable with `bind` first.

Scopes (`deadline`, `request`) can only shorten a deadline, never extend it. In async code a
scope also *enforces* the deadline: at expiry the enclosed work (and its `TaskGroup` children)
is cancelled and `DeadlineExceeded` is raised. Sync code cannot be interrupted; it should call
`check_deadline` between steps.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from .clock import default_clock
from .deadline import Deadline
from .errors import DeadlineExceeded
from .priority import Priority

__all__ = [
    "DeadlineScope",
    "RequestContext",
    "bind",
    "check_deadline",
    "current",
    "current_deadline",
    "deadline",
    "remaining",
    "request",
]

P = ParamSpec("P")
R = TypeVar("R")

_CLOCK = default_clock()
_UNSET: Any = object()


class RequestContext:
    """What brownout knows about the work in progress. Immutable; use `replace`."""

    __slots__ = (
        "attempt",
        "caller",
        "deadline",
        "idempotency_key",
        "in_progress",
        "operation",
        "priority",
        "started_at",
    )

    deadline: Deadline | None
    priority: Priority
    caller: str
    operation: str
    attempt: int
    idempotency_key: str | None
    in_progress: bool
    """A continuation of work already started (a later page, an ``end()`` after ``start()``):
    it beats new work of the same priority (S3)."""
    started_at: float | None
    """When the stopwatch started for this request (monotonic), if it is a request."""

    def __init__(
        self,
        *,
        deadline: Deadline | None = None,
        priority: Priority = Priority.CRITICAL,
        caller: str = "unknown",
        operation: str = "unknown",
        attempt: int = 1,
        idempotency_key: str | None = None,
        in_progress: bool = False,
        started_at: float | None = None,
    ) -> None:
        s = object.__setattr__
        s(self, "deadline", deadline)
        s(self, "priority", priority)
        s(self, "caller", caller)
        s(self, "operation", operation)
        s(self, "attempt", attempt)
        s(self, "idempotency_key", idempotency_key)
        s(self, "in_progress", in_progress)
        s(self, "started_at", started_at)

    def replace(self, **changes: Any) -> RequestContext:
        """A copy with some fields changed. A new ``deadline`` can only shorten the current one."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        if "deadline" in changes:
            new = changes.pop("deadline")
            old = self.deadline
            changes["deadline"] = old if new is None else new.earliest(old)
        fields.update(changes)
        return RequestContext(**fields)

    def remaining(self) -> float | None:
        """Seconds left on the deadline, or ``None`` when there is none."""
        return None if self.deadline is None else self.deadline.remaining()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("RequestContext is immutable; use replace()")

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"RequestContext({inner})"


_EMPTY = RequestContext()
_current: contextvars.ContextVar[RequestContext] = contextvars.ContextVar(
    "brownout_request", default=_EMPTY
)


def current() -> RequestContext:
    """The request context of the running code (an empty one outside any request)."""
    return _current.get()


def current_deadline() -> Deadline | None:
    """The current deadline, or ``None``."""
    return _current.get().deadline


def remaining() -> float | None:
    """Seconds left on the current deadline, or ``None`` when no deadline is set."""
    d = _current.get().deadline
    return None if d is None else d.remaining()


def check_deadline() -> None:
    """Raise `DeadlineExceeded` if the current deadline has passed (for sync code)."""
    d = _current.get().deadline
    if d is not None and d.clock.now() >= d.at:
        raise DeadlineExceeded("the deadline expired")


class DeadlineScope:
    """A scope that shortens the deadline and sets request fields; see `deadline`/`request`.

    Usable as ``with`` (sets the context only) and ``async with`` (also cancels the enclosed
    work at expiry and raises `DeadlineExceeded`). Not reentrant: make a new one per use.
    """

    __slots__ = ("_changes", "_seconds", "_timeout", "_token")

    def __init__(self, seconds: float | Deadline | None, changes: dict[str, Any] | None) -> None:
        self._seconds = seconds
        self._changes = changes
        self._token: contextvars.Token[RequestContext] | None = None
        self._timeout: asyncio.Timeout | None = None

    def _enter(self) -> RequestContext:
        parent = _current.get()
        seconds = self._seconds
        if seconds is None:
            new_deadline = parent.deadline
        elif isinstance(seconds, Deadline):
            new_deadline = seconds.earliest(parent.deadline)
        else:
            if seconds != seconds:  # NaN
                raise ValueError("a deadline cannot be NaN")
            at = _CLOCK.now() + seconds
            old = parent.deadline
            new_deadline = old if old is not None and old.at <= at else Deadline(at)
        if self._changes:
            ctx = parent.replace(**self._changes)
            if new_deadline is not ctx.deadline:
                ctx = ctx.replace(deadline=new_deadline)
        elif new_deadline is parent.deadline:
            ctx = parent
        else:
            ctx = RequestContext(
                deadline=new_deadline,
                priority=parent.priority,
                caller=parent.caller,
                operation=parent.operation,
                attempt=parent.attempt,
                idempotency_key=parent.idempotency_key,
                in_progress=parent.in_progress,
                started_at=parent.started_at,
            )
        self._token = _current.set(ctx)
        return ctx

    def __enter__(self) -> RequestContext:
        return self._enter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    async def __aenter__(self) -> RequestContext:
        ctx = self._enter()
        d = ctx.deadline
        if d is not None:
            if d.clock.now() >= d.at:
                self.__exit__(None, None, None)
                raise DeadlineExceeded("the deadline expired before the work started")
            if d.clock is _CLOCK:
                self._timeout = asyncio.timeout_at(d.at)
            else:  # a foreign clock: translate the remaining time onto the loop's clock
                self._timeout = asyncio.timeout(d.remaining())
            await self._timeout.__aenter__()
        return ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        timeout = self._timeout
        if timeout is None:
            return
        self._timeout = None
        try:
            await timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as e:
            # Only our own expiry becomes DeadlineExceeded; an outer cancellation propagates.
            raise DeadlineExceeded("the deadline expired; the work was cancelled") from e


def deadline(seconds: float | Deadline | None) -> DeadlineScope:
    """Open a scope whose deadline is at most ``seconds`` from now (D1).

    Nested scopes only shorten: ``deadline(5)`` inside ``deadline(1)`` still ends after 1 s.
    ``async with`` cancels the enclosed work at expiry and raises `DeadlineExceeded`
    (a `TimeoutError`); ``with`` only sets the context for sync code.
    """
    return DeadlineScope(seconds, None)


def request(
    *,
    deadline: float | Deadline | None = None,
    priority: Priority | None = None,
    caller: str | None = None,
    operation: str | None = None,
    attempt: int | None = None,
    idempotency_key: str | None = None,
    in_progress: bool | None = None,
    started_at: float | None = None,
) -> DeadlineScope:
    """Open a scope that sets request fields, and optionally shortens the deadline."""
    changes: dict[str, Any] = {}
    if priority is not None:
        changes["priority"] = priority
    if caller is not None:
        changes["caller"] = caller
    if operation is not None:
        changes["operation"] = operation
    if attempt is not None:
        changes["attempt"] = attempt
    if idempotency_key is not None:
        changes["idempotency_key"] = idempotency_key
    if in_progress is not None:
        changes["in_progress"] = in_progress
    if started_at is not None:
        changes["started_at"] = started_at
    return DeadlineScope(deadline, changes)


def bind(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` to run in a copy of the *current* context (for executors and threads).

    ``asyncio.to_thread`` already copies the context; ``loop.run_in_executor`` and
    ``threading.Thread`` do not, so pass ``bind(fn)`` to them.
    """
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return ctx.run(fn, *args, **kwargs)

    return run
