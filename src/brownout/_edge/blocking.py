"""The edge for thread-per-request servers (WSGI, sync Django): `EdgePolicy`'s decisions on
a worker thread, with a blocking admission.

A thread cannot be cancelled, so the deadline is enforced where it can be: refused before the
work starts (a spent budget, a bulkhead that cannot meet it), and checked when the handler
returns. A handler that returns after its deadline has its answer replaced by the expiry's
refusal (504 problem+json) and is counted as expired (`HandlerOverran`): the work did run to
its end, holding its slot until then, and the caller hears that it was too late.

The steps are `serve`'s (trust, budget, classification, idempotency, the request context,
admission through the route's bulkhead, the settle rule, refusals), split in two because a
WSGI response outlives the call that made it: `begin` admits and sets the context,
`Held.returned` checks the deadline when the handler returns, `Held.finish` settles when
the response body is done (a streaming body holds its permit while it streams).

What this path cannot do is refused when the adapter is built (`check_blocking`): the quota
hook is a coroutine function, and `SlowedRejections` would hold a worker thread per held
refusal, the capacity a refusal exists to save.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from .._admission.bulkhead import Bulkhead
from .._admission.protocols import AdmitsWorkBlocking
from .._admission.thread_bulkhead import ThreadBulkhead
from .._clock import now as _now
from .._context import get_current, make_context, reset_current, set_current
from .._deadline import Deadline, new_deadline
from .._degrade.markers import served_by_fallback
from .._errors import Reason, Rejected
from .._propagation import HeaderGetter
from .flight import Flight
from .policy import EdgePolicy
from .refusals import Refusal
from .routes import ResolvedRoute

__all__ = [
    "Held",
    "begin",
    "check_async",
    "check_blocking",
    "is_blocking",
    "serve_blocking",
]

T = TypeVar("T")


def _no_header(name: str) -> None:
    return None


def check_blocking(policy: EdgePolicy) -> None:
    """Raise `TypeError` when ``policy`` needs what a worker thread cannot give it."""
    if policy.quota is not None:
        raise TypeError(
            "EdgePolicy(quota=...) is an async hook: the WSGI/sync edge cannot await it. "
            "Check quotas in the application, or serve it under ASGI"
        )
    if policy.slowed is not None:
        raise TypeError(
            "EdgePolicy(slowed=...) holds refusals on an event loop; on the WSGI/sync edge "
            "it would hold a worker thread per refusal. Leave slowed unset here"
        )


def is_blocking(bulkhead: Any) -> bool:
    """True for an admission that blocks the calling thread (``with admit()``), false for an
    asyncio one (``async with admit()``, `brownout.Bulkhead`)."""
    if isinstance(bulkhead, ThreadBulkhead):
        return True
    return not isinstance(bulkhead, Bulkhead) and isinstance(bulkhead, AdmitsWorkBlocking)


def check_async(route: ResolvedRoute) -> None:
    """Raise `TypeError` when ``route``'s bulkhead can only block (a `ThreadBulkhead` also
    admits with ``async with``, and may be shared by threads and a loop)."""
    bulkhead = route.bulkhead
    if bulkhead is not None and not isinstance(bulkhead, Bulkhead) and is_blocking(bulkhead):
        raise TypeError(
            f"route {route.template!r}: under ASGI the edge needs an asyncio bulkhead "
            f"(brownout.Bulkhead or ThreadBulkhead), not {type(bulkhead).__name__}"
        )


def _blocking_admission(route: ResolvedRoute) -> AdmitsWorkBlocking | None:
    bulkhead = route.bulkhead
    if bulkhead is None:
        return None
    if not is_blocking(bulkhead):
        raise TypeError(
            f"route {route.template!r}: the WSGI/sync edge needs a blocking bulkhead "
            f"(brownout.ThreadBulkhead), not {type(bulkhead).__name__}"
        )
    blocking: AdmitsWorkBlocking = bulkhead  # type: ignore[assignment]  # checked above
    return blocking


class Held:
    """One admitted request on the blocking path: its context is set on this thread until
    `returned` (or `raised`), its permit (if any) held until `finish`."""

    __slots__ = ("_cm", "_done", "_marks", "_marks_token", "_token", "flight", "permit", "policy")

    def __init__(
        self,
        policy: EdgePolicy,
        flight: Flight,
        cm: AbstractContextManager[Any] | None,
        permit: Any,
        token: Any,
        marks: list[str] | None,
        marks_token: Any,
    ) -> None:
        self.policy = policy
        self.flight = flight
        self._cm = cm
        self.permit = permit
        self._token = token
        self._marks = marks
        self._marks_token = marks_token
        self._done = False

    @property
    def marks(self) -> Sequence[str] | None:
        """The degraded modes whose fallback answered this request, if any."""
        return self._marks

    def _leave(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            reset_current(token)
            if self._marks_token is not None:
                served_by_fallback.reset(self._marks_token)

    def returned(self) -> Refusal | None:
        """The handler returned (``flight.status`` set): the expiry's refusal when it
        returned after its deadline (its answer is to be discarded), else ``None``."""
        self._leave()
        flight = self.flight
        deadline = flight.deadline
        if deadline is not None and _now() > deadline.at and not flight.response_started:
            flight.expired = flight.answered = True
            return self.policy.refusal(Reason.DEADLINE_EXPIRED)
        return None

    def raised(self, e: BaseException) -> Refusal | None:
        """The handler raised ``e``: settle by it and give the answer `serve` would give (a
        `Refusal`), or ``None`` to let ``e`` propagate (always, for a `BaseException` that is
        not an `Exception`: the thread is being stopped). Nothing is left to `finish`."""
        self._leave()
        self._done = True
        flight = self.flight
        if not isinstance(e, Exception):
            self._release(type(e))
            return None
        deadline = flight.deadline
        if deadline is not None and _now() > deadline.at:
            flight.expired = True
        self._release(TimeoutError if flight.expired else type(e))
        if flight.expired and not flight.response_started:
            flight.answered = True
            self.policy.overran(flight, on_thread=True)
            return self.policy.refusal(Reason.DEADLINE_EXPIRED)
        return self.policy.answer_raised(e, flight, None)  # type: ignore[arg-type, return-value]

    def _release(self, raised: type[BaseException] | None) -> None:
        permit, cm = self.permit, self._cm
        self.permit = self._cm = None
        if permit is None:
            return
        try:
            if raised is not None:
                permit.settle_raised(raised)
            elif self.flight.expired:  # `settle`'s first rule, told it ran on a thread
                permit.settle_raised(TimeoutError)
                self.policy.overran(self.flight, on_thread=True)
            else:
                self.policy.settle(permit, self.flight, self._marks)
        finally:
            if cm is not None:
                cm.__exit__(None, None, None)

    def finish(self) -> None:
        """The response is done (its body exhausted or closed): settle by ``flight.status``
        (`EdgePolicy.settle`; a handler that overran its deadline is counted as expired)
        and count it when the edge reports this route. Idempotent."""
        if self._done:
            return
        self._done = True
        flight = self.flight
        if self.permit is not None:
            self._release(None)
        elif flight.expired:
            self.policy.overran(flight, on_thread=True)
        elif flight.reports:
            finished(self.policy, flight)


def finished(policy: EdgePolicy, flight: Flight) -> None:
    """Count an unguarded request's end (the edge reports its lifecycle): completed or
    failed by its status."""
    cls = flight.classification
    deadline = flight.deadline
    if cls is not None and deadline is not None:
        policy._finished(flight, cls, deadline)


def begin(
    policy: EdgePolicy,
    request: Any,
    flight: Flight,
    *,
    route: ResolvedRoute,
    get: HeaderGetter = _no_header,
) -> Held | Refusal:
    """Classify and admit a request on this thread (blocking while the bulkhead queues it),
    and set its context. A `Refusal` to write, or the `Held` request to run."""
    trust = policy.trust_of(request)
    seconds, origin, _ = route.deadline.resolve(get, trust)
    cls = policy.classify(request, route, route.template, trust, get)
    flight.classification = cls
    admission = _blocking_admission(route)
    flight.reports = admission is None
    parent = get_current()
    attempt, key = policy.idempotency(
        get, trust, cls.caller, parent.attempt, parent.idempotency_key
    )
    at = flight.started + seconds
    deadline = parent.deadline
    if deadline is None or not deadline.at <= at:
        deadline = new_deadline(at, origin) if at == at else Deadline(at, origin=origin)
    flight.deadline = deadline
    ctx = make_context(
        deadline,
        cls.priority,
        cls.caller,
        cls.operation,
        attempt,
        key,
        cls.in_progress,
        flight.started,
    )
    token = set_current(ctx)
    marks: list[str] | None = None
    marks_token = None
    if policy.degraded is not None:
        marks = []
        marks_token = served_by_fallback.set(marks)
    cm: AbstractContextManager[Any] | None = None
    permit: Any = None
    try:
        if admission is None:
            if deadline.at <= _now():
                if policy.events.enabled:
                    policy._emit_refused(cls, Reason.DEADLINE_EXPIRED)
                raise Rejected(Reason.DEADLINE_EXPIRED)
            if policy.events.enabled:
                policy._emit_unguarded_admission(cls, deadline)
        else:
            cm = admission.admit()
            permit = cm.__enter__()
    except Rejected as e:
        reset_current(token)
        if marks_token is not None:
            served_by_fallback.reset(marks_token)
        return policy.refusal(e.reason, e.retry_after)
    except BaseException:
        reset_current(token)
        if marks_token is not None:
            served_by_fallback.reset(marks_token)
        raise
    flight.admitted = True
    return Held(policy, flight, cm, permit, token, marks, marks_token)


def serve_blocking(
    policy: EdgePolicy,
    request: Any,
    call: Callable[[], T],
    flight: Flight,
    *,
    route: ResolvedRoute,
    get: HeaderGetter = _no_header,
) -> T | Refusal:
    """`begin`, run ``call`` (which sets ``flight.status``), and settle: for answers that are
    complete when ``call`` returns (a Django response). Returns what ``call`` returned, or a
    `Refusal` to write instead (refused, or 504: it returned after its deadline).
    Exceptions of ``call`` propagate, counted as failures, unless the policy answers them
    (`EdgePolicy.answer_raised`: a `Rejected` from a dependency is a 503)."""
    held = begin(policy, request, flight, route=route, get=get)
    if isinstance(held, Refusal):
        return held
    try:
        result = call()
    except BaseException as e:  # settled whatever it is; only an Exception is answered
        answer = held.raised(e)
        if answer is None:
            raise
        return answer
    late = held.returned()
    held.finish()
    return result if late is None else late
