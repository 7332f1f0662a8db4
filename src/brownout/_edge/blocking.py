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

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from .._admission.bulkhead import Bulkhead
from .._admission.protocols import AdmitsWorkBlocking
from .._admission.thread_bulkhead import ThreadBulkhead
from .._clock import now as _now
from .._context import (
    NO_REQUEST,
    RequestContext,
    get_current,
    inbound_context,
    make_context,
    reset_current,
    set_current,
)
from .._deadline import Deadline, new_deadline
from .._degrade.markers import served_by_fallback
from .._errors import Reason, Rejected
from .._propagation import ENVOY_TIMEOUT_HEADER, HeaderGetter
from .express import EXPRESS_HEADERS, Express
from .flight import Flight
from .policy import EdgePolicy
from .refusals import Refusal
from .routes import ResolvedRoute

__all__ = [
    "Held",
    "begin",
    "begin_express",
    "check_async",
    "check_blocking",
    "claims_nothing",
    "is_blocking",
    "serve_blocking",
]

T = TypeVar("T")


def _no_header(name: str) -> None:
    return None


_CLAIM_KEYS = frozenset(
    "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
    for name in (*EXPRESS_HEADERS, ENVOY_TIMEOUT_HEADER.encode("latin-1"))
)
"""The WSGI environ keys of the request headers the edge has a decision to make about."""


def claims_nothing(environ: Mapping[str, Any]) -> bool:
    """True when a WSGI environ carries none of the headers only `begin` decides about (a
    budget, a priority claim, an idempotency key or attempt, Envoy's timeout)."""
    return not any(map(environ.__contains__, _CLAIM_KEYS))  # six lookups, in C


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
    `returned` (or `raised`), and again around each step of its body (`advance`), its permit
    (if any) held until `finish`."""

    __slots__ = (
        "_cm",
        "_done",
        "_marks",
        "_marks_token",
        "_token",
        "context",
        "flight",
        "permit",
        "policy",
    )

    def __init__(
        self,
        policy: EdgePolicy,
        flight: Flight,
        cm: AbstractContextManager[Any] | None,
        permit: Any,
        context: RequestContext,
        marks: list[str] | None,
    ) -> None:
        self.policy = policy
        self.flight = flight
        self._cm = cm
        self.permit = permit
        self.context = context
        """The request context, set on this thread while the handler and its body run."""
        self._token: Any = set_current(context)
        self._marks = marks
        self._marks_token = None if marks is None else served_by_fallback.set(marks)
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

    def advance(self, body: Iterator[T]) -> T:
        """``next(body)`` inside the request context (its deadline, its fallback marks): a
        streamed body runs code of the application after the handler returned."""
        token = set_current(self.context)
        marks = self._marks
        if marks is None:
            try:
                return next(body)
            finally:
                reset_current(token)
        marks_token = served_by_fallback.set(marks)
        try:
            return next(body)
        finally:
            served_by_fallback.reset(marks_token)
            reset_current(token)

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
        if flight.expired:
            # Raised after its deadline: counted as every overrun is, whatever it raised.
            if not flight.response_started:
                flight.answered = True
            self.policy.overran(flight, on_thread=True)
            if flight.answered:
                return self.policy.refusal(Reason.DEADLINE_EXPIRED)
            return None  # its response had started: the server cuts it short
        return self.policy.answer_raised(e, flight, None)  # type: ignore[arg-type, return-value]

    def broke(self) -> None:
        """The response body raised while it was read: settle as failed, or as expired
        (`HandlerOverran`) when its deadline had passed. Idempotent with `finish`."""
        flight = self.flight
        deadline = flight.deadline
        if deadline is not None and _now() > deadline.at:
            flight.expired = True
        else:
            flight.status = 500  # the body broke mid-way: the service failed
        self.finish()

    def abandon(self) -> None:
        """The server closed the body before it was read to its end: the client went away
        mid-response. Settle as abandoned (O1), as the async edge counts a disconnect."""
        if not self._done:
            self.flight.abandoned = True
            self.finish()

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
        (`EdgePolicy.settle`; a handler that overran its deadline is counted as expired, a
        body abandoned by its client as abandoned) and count it when the edge reports this
        route. Idempotent."""
        if self._done:
            return
        self._done = True
        flight = self.flight
        if self.permit is not None:
            self._release(None)
        elif flight.expired:
            self.policy.overran(flight, on_thread=True)
        elif flight.abandoned:
            self.policy.record_abandoned(flight)
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
    cm: AbstractContextManager[Any] | None = None
    permit: Any = None
    held = Held(policy, flight, None, None, ctx, [] if policy.degraded is not None else None)
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
        held._leave()
        return policy.refusal(e.reason, e.retry_after)
    except BaseException:
        held._leave()
        raise
    held._cm = cm
    held.permit = permit
    flight.admitted = True
    return held


def begin_express(
    policy: EdgePolicy, express: Express, request: Any, flight: Flight
) -> Held | None:
    """`begin` for a request with nothing to decide (no brownout header: `claims_nothing`;
    no enclosing request; an uncontended bulkhead: `Bulkhead.admit_uncontended`), with the
    same counts: the `Held` request, or ``None`` (nothing counted) for `begin` to serve."""
    if get_current() is not NO_REQUEST:
        return None
    cls = express.classification
    if express.classifier is not None:
        cls = express.classifier(request, cls)
    started = flight.started
    seconds = express.seconds
    permit = express.bulkhead.admit_uncontended(
        cls.priority, cls.caller, cls.operation, started, seconds
    )
    if permit is None:
        return None
    ctx = inbound_context(
        started + seconds, cls.priority, cls.caller, cls.operation, cls.in_progress, started
    )
    flight.classification = cls
    flight.deadline = ctx.deadline
    flight.reports = False  # the bulkhead reports the lifecycle
    flight.admitted = True
    return Held(policy, flight, None, permit, ctx, [] if express.degraded is not None else None)


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
