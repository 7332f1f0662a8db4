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
import math
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from ._clock import current_task_of as _current_task
from ._clock import default_clock, loop_or_none
from ._deadline import Deadline, DeadlineBuilder, new_deadline
from ._deadline import call_budget as _budget_within
from ._errors import DeadlineExceeded
from ._priority import Priority

__all__ = [
    "NO_REQUEST",
    "DeadlineScope",
    "RequestContext",
    "attach",
    "bind",
    "call_budget",
    "check_deadline",
    "current",
    "current_deadline",
    "deadline",
    "detach",
    "get_current",
    "inbound_context",
    "make_context",
    "remaining",
    "request",
    "reset_current",
    "set_current",
    "statement_timeout_ms",
]

P = ParamSpec("P")
R = TypeVar("R")

_CLOCK = default_clock()
_NEW = object.__new__


def _origin_of(parent: Deadline | None) -> str:
    return "local" if parent is None else parent.origin


class _ContextSlots:
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


class RequestContext(_ContextSlots):
    """What brownout knows about the work in progress. Immutable; use `replace`."""

    __slots__ = ()

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
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"RequestContext has no field {min(unknown)!r}")
        deadline = self.deadline
        new_deadline = changes.get("deadline")
        if new_deadline is not None:
            deadline = new_deadline.earliest(deadline)
        get = changes.get
        return make_context(
            deadline,
            get("priority", self.priority),
            get("caller", self.caller),
            get("operation", self.operation),
            get("attempt", self.attempt),
            get("idempotency_key", self.idempotency_key),
            get("in_progress", self.in_progress),
            get("started_at", self.started_at),
        )

    def _with_deadline(self, deadline: Deadline | None) -> RequestContext:
        # The hot path of every deadline scope: a copy with only the deadline changed.
        return make_context(
            deadline,
            self.priority,
            self.caller,
            self.operation,
            self.attempt,
            self.idempotency_key,
            self.in_progress,
            self.started_at,
        )

    def remaining(self) -> float | None:
        """Seconds left on the deadline, or ``None`` when there is none."""
        return None if self.deadline is None else self.deadline.remaining()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("RequestContext is immutable; use replace()")

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in _ContextSlots.__slots__)
        return f"RequestContext({inner})"


class _ContextBuilder(_ContextSlots):
    __slots__ = ()


_FIELDS = frozenset(_ContextSlots.__slots__)


def make_context(
    deadline: Deadline | None,
    priority: Priority,
    caller: str,
    operation: str,
    attempt: int,
    idempotency_key: str | None,
    in_progress: bool,
    started_at: float | None,
) -> RequestContext:
    """Build a RequestContext on the hot path (scopes, the edge, retries), unchecked.

    Filling a layout-identical mutable twin and then switching its class is cheaper than
    ``object.__setattr__`` per field; the result is an ordinary, immutable RequestContext.
    """
    new = _NEW(_ContextBuilder)
    new.deadline = deadline
    new.priority = priority
    new.caller = caller
    new.operation = operation
    new.attempt = attempt
    new.idempotency_key = idempotency_key
    new.in_progress = in_progress
    new.started_at = started_at
    new.__class__ = RequestContext  # type: ignore[assignment]
    return new  # type: ignore[return-value]


def inbound_context(
    at: float,
    priority: Priority,
    caller: str,
    operation: str,
    in_progress: bool,
    started_at: float,
    origin: str = "default",
) -> RequestContext:
    """A new inbound request's context, unchecked: a fresh `Deadline` at ``at`` on the default
    clock, first attempt, no idempotency key. One call for what `new_deadline` and
    `make_context` build (the edge's express path; ``ctx.deadline`` is the deadline)."""
    d = _NEW(DeadlineBuilder)
    d.at = at
    d.clock = _CLOCK
    d.origin = origin
    d.__class__ = Deadline  # type: ignore[assignment]
    new = _NEW(_ContextBuilder)
    new.deadline = d  # type: ignore[assignment]  # (a Deadline once its class is set)
    new.priority = priority
    new.caller = caller
    new.operation = operation
    new.attempt = 1
    new.idempotency_key = None
    new.in_progress = in_progress
    new.started_at = started_at
    new.__class__ = RequestContext  # type: ignore[assignment]
    return new  # type: ignore[return-value]


NO_REQUEST = RequestContext()
_current: contextvars.ContextVar[RequestContext] = contextvars.ContextVar(
    "brownout_request", default=NO_REQUEST
)
# The variable's methods, bound once, for other modules' hot paths. CPython 3.11 compiles
# ``name.method()`` on an imported ``name`` as a module attribute lookup, which a ContextVar
# defeats: each call would look the method up and build a bound method.
get_current = _current.get
set_current = _current.set
reset_current = _current.reset


def attach(ctx: RequestContext) -> contextvars.Token[RequestContext]:
    """Make ``ctx`` the current request context; returns a token for `detach`.

    Low level, for adapters and retry loops on hot paths; application code uses the scopes.
    Unlike a scope, this does not enforce the deadline.
    """
    return _current.set(ctx)


def detach(token: contextvars.Token[RequestContext]) -> None:
    """Restore the request context that was current before `attach`."""
    _current.reset(token)


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

    The async form enforces the deadline the way ``asyncio.Timeout`` does (one loop timer that
    cancels the task, and the task's cancel counter to tell our expiry apart from an outer
    cancellation), without wrapping a ``Timeout`` object: that halves the cost of a scope.
    """

    __slots__ = ("_cancelling", "_changes", "_expired", "_handle", "_seconds", "_task", "_token")

    def __init__(self, seconds: float | Deadline | None, changes: dict[str, Any] | None) -> None:
        self._seconds = seconds
        self._changes = changes
        self._token: contextvars.Token[RequestContext] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._expired = False

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
            # (instants on another clock are not comparable with ours: compare what is left)
            keep = old is not None and (
                old.at <= at if old.clock is _CLOCK else old.remaining() <= seconds
            )
            # A shortened request deadline keeps its origin: the budget still came from there.
            new_deadline = old if keep else Deadline(at, origin=_origin_of(old))
        if self._changes:
            ctx = parent.replace(**self._changes)
            if new_deadline is not ctx.deadline:
                ctx = ctx.replace(deadline=new_deadline)
        elif new_deadline is parent.deadline:
            ctx = parent
        else:
            ctx = parent._with_deadline(new_deadline)
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
        loop = loop_or_none()
        seconds = self._seconds
        if self._changes is None and loop is not None and type(seconds) in (float, int):
            # Fast path of `async with brownout.deadline(s)`: one clock read, no helpers.
            if seconds != seconds:
                raise ValueError("a deadline cannot be NaN")
            parent = _current.get()
            now = loop.time()
            at = now + seconds  # type: ignore[operator]
            d = parent.deadline
            if d is None or (d.at > at if d.clock is _CLOCK else d.remaining() > at - now):
                d = new_deadline(at, "local" if d is None else d.origin)
                ctx = parent._with_deadline(d)
            else:
                ctx = parent
            if d.clock is _CLOCK:
                if d.at <= now:
                    raise DeadlineExceeded("the deadline expired before the work started")
                task = _current_task(loop)
                if task is None:
                    raise RuntimeError("async with brownout.deadline() must run inside a task")
                self._token = _current.set(ctx)
                self._task = task
                self._cancelling = task.cancelling()
                self._handle = loop.call_at(d.at, self._on_expiry)
                return ctx
            self._token = _current.set(ctx)
        else:
            ctx = self._enter()
            d = ctx.deadline
            if d is None:
                return ctx
        left = d.at - d.clock.now()
        if left <= 0.0:
            self.__exit__(None, None, None)
            raise DeadlineExceeded("the deadline expired before the work started")
        self._arm(loop or asyncio.get_running_loop(), d.at if d.clock is _CLOCK else None, left)
        return ctx

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float | None, delay: float | None) -> None:
        task = _current_task(loop)
        if task is None:
            self.__exit__(None, None, None)
            raise RuntimeError("async with brownout.deadline() must run inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        if at is not None:
            self._handle = loop.call_at(at, self._on_expiry)
        else:  # a foreign clock: translate the remaining time onto the loop's clock
            self._handle = loop.call_later(delay or 0.0, self._on_expiry)

    def _on_expiry(self) -> None:
        self._handle = None
        self._expired = True
        if self._task is not None:
            self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        if self._expired:
            task = self._task
            self._task = None
            # Only our own expiry becomes DeadlineExceeded; a cancellation requested by anyone
            # else (an outer timeout, task.cancel(), TaskGroup shutdown) keeps propagating.
            if (
                task is not None
                and task.uncancel() <= self._cancelling
                and exc_type is not None
                and issubclass(exc_type, asyncio.CancelledError)
            ):
                raise DeadlineExceeded("the deadline expired; the work was cancelled") from exc
        self._task = None


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
        # A fresh copy per call: a Context can be entered by one thread at a time (a bound
        # callable may run in several workers at once), and one call's changes must not
        # leak into the next.
        return ctx.copy().run(fn, *args, **kwargs)

    return run


def statement_timeout_ms(
    normal_timeout: float, *, reserve: float = 0.0, min_useful: float = 0.0
) -> int:
    """`call_budget` in whole milliseconds, rounded up and at least 1, for a database's
    statement timeout (PostgreSQL's ``SET LOCAL statement_timeout``): there 0 means *no*
    timeout, which a budget under half a millisecond must not round to. Refuses as
    `call_budget` does (expired, or below ``min_useful``)."""
    budget = call_budget(normal_timeout, reserve=reserve, min_useful=min_useful)
    return max(1, math.ceil(budget * 1000.0))


def call_budget(
    normal_timeout: float,
    *,
    reserve: float = 0.0,
    min_useful: float = 0.0,
    deadline: Deadline | None = None,
) -> float:
    """How long a dependency call may take (D4): ``min(normal_timeout, remaining - reserve)``.

    ``reserve`` is kept back for the response path and local cleanup. When what is left is
    below ``min_useful`` (what the call normally needs, e.g. a latency estimate per operation,
    D7) the call is refused *before it starts* with ``Rejected(Reason.DEADLINE_TOO_SHORT)``:
    with 40 ms left, a call that needs 150 ms is not worth sending. An already expired deadline
    raises ``Rejected(Reason.DEADLINE_EXPIRED)``. ``deadline`` defaults to the current
    request's; without one the normal timeout applies.
    """
    return _budget_within(
        normal_timeout,
        reserve=reserve,
        min_useful=min_useful,
        deadline=_current.get().deadline if deadline is None else deadline,
    )
