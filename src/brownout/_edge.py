"""The edge: where a request enters a service (D2, D3, D5, S2, S3, S4, S6, S7, O3, O4).

`EdgePolicy` is the framework-free half of the inbound path; the adapters in
`brownout.integrations` (ASGI, grpc.aio, aiohttp) translate a framework's request into it and
its decisions back into the framework's responses. For one request the edge:

1. starts the stopwatch when it first sees the request, and resolves the budget with the route's
   `InboundDeadlinePolicy` (trusted / signed / untrusted sources, route default and maximum);
2. classifies the request (priority, caller, operation). A priority header is honoured only from
   a trusted source (S4); a user-chosen classifier, which runs after authentication, has the
   last word. The operation is the route template, never the raw path (bounded labels);
3. checks the optional quota hook (429 for ``Reason.QUOTA``; or, with
   ``on_quota_exceeded="demote"``, lets the caller use *idle* capacity at ``SHEDDABLE``, S5);
4. admits through the route's bulkhead (503 with the bulkhead's reason when refused);
5. runs the handler inside ``brownout.request(...)`` so the deadline, priority, caller and
   operation follow the work; at expiry the handler is cancelled (504 if no response started).

Refusals are cheap: the RFC 9457 problem bodies are rendered once per reason, ``Retry-After``
is sent only when there is an estimate and is jittered upwards so callers do not return
together. `SlowedRejections` optionally holds refusals until about the median success latency
(S6) with one loop timer for all of them.

Events: a `Bulkhead` reports the whole lifecycle of the work it admits (offered, queued,
admitted, shed, completed, failed, abandoned, expired), so on a route with a bulkhead the edge
adds only what the bulkhead cannot see: refusals that never reached it (quota) and that a 5xx
response was a failure (through the permit). On a route without a bulkhead the edge reports
the lifecycle itself, with latency from its own stopwatch. Health and readiness paths bypass
admission and produce no events.
"""

from __future__ import annotations

import asyncio
import heapq
import http
import json
import math
import random
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import Token
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from ._admission.bulkhead import Bulkhead, Permit, Untracked
from ._clock import current_task_of, default_clock, running_loop
from ._clock import now as _now
from ._context import (
    _get_current,
    _inbound_context,
    _make_context,
    _reset_current,
    _set_current,
)
from ._deadline import Deadline, _new_deadline
from ._degrade.markers import served_by_fallback
from ._errors import DeadlineExceeded, HeaderError, Reason, Rejected, UnknownOutcome
from ._priority import Priority, parse_priority
from ._propagation import (
    BUDGET_HEADER,
    PRIORITY_HEADER,
    SIGNED_BUDGET_HEADER,
    HeaderGetter,
    InboundDeadlinePolicy,
    Trust,
    decode_budget_ms,
)
from .events import (
    DeadlineHeaderIgnored,
    EventHub,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestShed,
    hub,
)

__all__ = [
    "ABANDONED",
    "EXPRESS_HEADERS",
    "UNMATCHED",
    "Abandoned",
    "Admission",
    "Classification",
    "Classifier",
    "DegradedModes",
    "EdgePolicy",
    "Express",
    "ExpressScope",
    "Flight",
    "QuotaCheck",
    "QuotaDecision",
    "Refusal",
    "ResolvedRoute",
    "Route",
    "SlowedRejections",
    "TrustSource",
    "announced_modes",
    "compile_template",
    "header_getter",
    "problem_body",
    "ratelimit_headers",
]

T = TypeVar("T")

UNMATCHED = "unmatched"
"""The operation label of every request that matches no known route (bounded label sets)."""


def ratelimit_headers(decision: Any) -> dict[str, str]:
    """RateLimit headers for a quota decision, without Retry-After (the edge jitters its own).

    A decision that renders its own headers (``headers()``, e.g. `brownout.QuotaDecision`: the
    IETF draft's ``RateLimit`` / ``RateLimit-Policy``) is used as is; otherwise the protocol's
    ``limit`` / ``remaining`` / ``reset`` fields become ``RateLimit-Limit/Remaining/Reset``.
    """
    render = getattr(decision, "headers", None)
    if callable(render):
        return {k: v for k, v in render().items() if k.lower() != "retry-after"}
    out: dict[str, str] = {}
    limit = getattr(decision, "limit", None)
    remaining = getattr(decision, "remaining", None)
    reset = getattr(decision, "reset", None)
    if limit is not None:
        out["RateLimit-Limit"] = str(int(limit))
    if remaining is not None:
        out["RateLimit-Remaining"] = str(max(0, int(remaining)))
    if reset is not None:
        out["RateLimit-Reset"] = str(max(0, math.ceil(reset)))
    return out


def _idle(admission: Any) -> bool:
    """True when ``admission`` has a free permit and nobody waits for one (S5: over-quota
    work may use idle capacity only). An admission that does not say (no ``in_flight``,
    ``limit`` and ``queue_depth``, as `Bulkhead` has) is left to ``try_admit``."""
    try:
        return bool(admission.in_flight < admission.limit and not admission.queue_depth)
    except AttributeError:
        return True


def announced_modes(modes: DegradedModes, marks: Sequence[str] | None) -> tuple[str, ...]:
    """The degraded modes a response names in ``brownout-degraded`` (G2), read as it leaves:
    those active now, then any whose fallback answered the request (``marks``, the
    `brownout._degrade.markers.served_by_fallback` list) and has ended since."""
    names = modes.active_names()
    if marks:
        names += tuple(m for m in dict.fromkeys(marks) if m not in names)
    return names


def _quota_reason(decision: Any) -> Reason:
    # A quota store that is down and fails closed is the service's problem (503), not the
    # caller's (429): the decision says so with its own reason.
    reason = getattr(decision, "reason", None)
    return reason if isinstance(reason, Reason) else Reason.QUOTA


# -- the protocols the edge depends on -------------------------------------------------------


@runtime_checkable
class Admission(Protocol):
    """What the edge needs from a bulkhead (`brownout.Bulkhead` satisfies it).

    ``admit()`` with no arguments reads priority, caller, operation and deadline from the
    request context, which the edge has already set; it refuses by raising `Rejected`, and
    the permit it yields may have ``failed(error)`` (called for 5xx responses).
    ``try_admit()`` never waits: it returns a permit with ``success()``, ``dropped()``,
    ``ignore()`` and ``failed(error)``, or raises `Rejected`; the edge uses it to let
    over-quota callers use idle capacity only (S5). An admission is expected to report the
    lifecycle events of the work it admits.
    """

    def admit(self) -> AbstractAsyncContextManager[Any]: ...

    def try_admit(self) -> Any: ...


@runtime_checkable
class QuotaDecision(Protocol):
    """The answer of a quota check; the RateLimit fields are optional (``None``)."""

    @property
    def allowed(self) -> bool: ...

    @property
    def retry_after(self) -> float | None: ...

    @property
    def limit(self) -> int | None: ...

    @property
    def remaining(self) -> int | None: ...

    @property
    def reset(self) -> float | None: ...


QuotaCheck = Callable[["Classification"], Awaitable[QuotaDecision]]
"""An async hook deciding whether a classified request is within its caller's quota."""


@runtime_checkable
class DegradedModes(Protocol):
    """Anything that can name the degraded modes currently active (G2)."""

    def active_names(self) -> tuple[str, ...]: ...


class Classification(NamedTuple):
    """Who is asking, for what, and how much it matters. A classifier returns a new one."""

    priority: Priority
    caller: str
    operation: str
    in_progress: bool = False


class Classifier(Protocol):
    """Maps a framework request (ASGI scope, aiohttp request, `GrpcCall`) and the edge's
    default classification to the final one. It runs after authentication, so it may trust
    what the authentication layer established (e.g. ``scope["user"]``)."""

    def __call__(self, request: Any, default: Classification, /) -> Classification: ...


TrustSource = Trust | Callable[[Any], Trust]
"""A fixed trust level, or a function of the framework request that decides it."""


# -- routes ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Route:
    """Per-route policy. ``None`` fields fall back to the `EdgePolicy`'s.

    ``default`` and ``maximum`` override the inbound deadline policy's; ``priority`` is the
    route's base priority (a classifier may still change it); ``bulkhead`` gives the route its
    own concurrency budget (A1).
    """

    priority: Priority | None = None
    default: float | None = None
    maximum: float | None = None
    bulkhead: Admission | None = None


class ResolvedRoute(NamedTuple):
    """A route with every fallback applied; computed once per route template."""

    template: str
    priority: Priority
    deadline: InboundDeadlinePolicy
    bulkhead: Admission | None


_PARAM = re.compile(r"{([a-zA-Z_][a-zA-Z0-9_]*)(?::([a-zA-Z_]+))?}")


def compile_template(template: str) -> re.Pattern[str]:
    """A regex matching the paths of a Starlette/aiohttp style template (``/a/{id}``,
    ``/files/{rest:path}``)."""
    out: list[str] = []
    pos = 0
    for m in _PARAM.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(".*" if m.group(2) == "path" else "[^/]+")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


# -- refusals ------------------------------------------------------------------------------------

_DETAILS: dict[Reason, str] = {
    Reason.QUEUE_FULL: "The service is at capacity and its wait queue is full.",
    Reason.QUEUE_TIMEOUT: "The request waited too long for capacity.",
    Reason.DEADLINE_TOO_SHORT: "Too little time was left for the request to be useful.",
    Reason.DEADLINE_EXPIRED: "The request's deadline passed before it could be answered.",
    Reason.OVERLOADED: "The service is overloaded and is shedding this priority.",
    Reason.FAIR_SHARE: "This caller already holds its share of the service's capacity.",
    Reason.QUOTA: "The caller exceeded its rate or quota.",
    Reason.BREAKER_OPEN: "A dependency's circuit breaker is open.",
    Reason.BUDGET_EXHAUSTED: "A dependency failed and the retry budget is exhausted.",
    Reason.THROTTLED: "Calls to a dependency are being throttled.",
    Reason.DEPENDENCY_UNAVAILABLE: "An authoritative dependency is unavailable.",
    Reason.DO_NOT_RETRY: "A dependency refused and asked callers not to retry.",
    Reason.OUTCOME_UNKNOWN: (
        "A change was sent to a dependency that never answered; its outcome is unknown. "
        "Reconcile by idempotency key rather than resending."
    ),
}

_DEFAULT_DO_NOT_RETRY = frozenset(
    {Reason.BUDGET_EXHAUSTED, Reason.DO_NOT_RETRY, Reason.OUTCOME_UNKNOWN}
)


class Refusal(NamedTuple):
    """A refusal ready to be written by an adapter.

    ``retry_after`` is the jittered estimate in seconds (``None``: do not send one);
    ``do_not_retry`` asks callers not to retry (``brownout-retry: never`` /
    ``grpc-retry-pushback-ms: -1``); ``body`` is the RFC 9457 problem document.
    """

    status: int
    reason: Reason
    body: bytes
    retry_after: float | None
    do_not_retry: bool
    degraded: tuple[str, ...]
    quota: QuotaDecision | None = None
    estimate: float | None = None
    """The un-jittered estimate ``retry_after`` was drawn from."""

    def retry_after_header(self) -> str | None:
        """``Retry-After`` in whole seconds: the jittered value rounded, never below the
        estimate rounded up, at least 1; ``None`` without an estimate."""
        seconds = self.retry_after_seconds()
        return None if seconds is None else str(seconds)

    def retry_after_seconds(self) -> int | None:
        """`retry_after_header` as a number (adapters that write bytes look it up)."""
        ra = self.retry_after
        if ra is None:
            return None
        estimate = self.estimate
        floor = math.ceil(estimate) if estimate is not None else 1
        seconds = round(ra)
        if seconds < floor:
            seconds = floor
        return seconds if seconds >= 1 else 1  # max(1, floor, round(ra)), without the call


def problem_body(
    reason: Reason,
    status: int,
    *,
    detail: str | None = None,
    degraded: tuple[str, ...] = (),
    do_not_retry: bool = False,
) -> bytes:
    """Render an RFC 9457 ``application/problem+json`` document naming the reason."""
    doc: dict[str, Any] = {
        "type": f"urn:brownout:reason:{reason.value}",
        "title": http.HTTPStatus(status).phrase,
        "status": status,
        "detail": detail if detail is not None else _DETAILS.get(reason, reason.value),
        "reason": reason.value,
    }
    if do_not_retry:
        doc["retry"] = "never"
    if degraded:
        doc["degraded"] = list(degraded)
    return json.dumps(doc, separators=(",", ":")).encode()


# -- slowed rejections (S6) ----------------------------------------------------------------------


class SlowedRejections:
    """Holds refusals until about the median success latency, cheaply (S6).

    Where a fast refusal invites a faster retry, answering it no sooner than a success would
    have been answered removes the incentive. Held refusals cost one future each; one loop
    timer releases them all. At most ``max_held`` are held; beyond that, refusals are answered
    at once (holding must never itself exhaust memory or file descriptors). The hold time is
    ``fraction`` x the median of the last ``window`` success latencies, within
    [``floor``, ``ceiling``] seconds; with no successes seen yet it is ``floor``.
    """

    def __init__(
        self,
        *,
        max_held: int = 1000,
        fraction: float = 1.0,
        floor: float = 0.0,
        ceiling: float = 1.0,
        window: int = 256,
    ) -> None:
        if max_held < 0 or window < 1 or not 0 <= floor <= ceiling:
            raise ValueError("need max_held >= 0, window >= 1 and 0 <= floor <= ceiling")
        self.max_held = max_held
        self.fraction = fraction
        self.floor = floor
        self.ceiling = ceiling
        self._window = window
        self._samples: list[float] = []
        self._next = 0
        self._since_sort = 0
        self._median = 0.0
        self._held: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    # the median: a ring of recent samples, re-sorted every window/8 observations
    def observe(self, latency: float) -> None:
        """Record the latency of one useful success."""
        samples = self._samples
        if len(samples) < self._window:
            samples.append(latency)
        else:
            samples[self._next] = latency
            self._next = (self._next + 1) % self._window
        self._since_sort += 1
        if self._since_sort >= max(1, self._window // 8) or len(samples) < 8:
            self._since_sort = 0
            ordered = sorted(samples)
            self._median = ordered[len(ordered) // 2]

    @property
    def median(self) -> float:
        """The current median success latency estimate (0.0 before any success)."""
        return self._median

    def hold_time(self) -> float:
        """How long the next refusal would be held."""
        t = self._median * self.fraction
        return self.floor if t < self.floor else self.ceiling if t > self.ceiling else t

    @property
    def held(self) -> int:
        """How many refusals are being held now."""
        return len(self._held)

    def hold(self) -> asyncio.Future[None] | None:
        """A future that resolves when this refusal may be answered, or ``None`` to answer
        now (nothing to wait for, or ``max_held`` reached)."""
        delay = self.hold_time()
        if delay <= 0.0 or len(self._held) >= self.max_held:
            return None
        loop = asyncio.get_running_loop()
        at = loop.time() + delay
        fut: asyncio.Future[None] = loop.create_future()
        self._seq += 1
        heapq.heappush(self._held, (at, self._seq, fut))
        if at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = at
            self._timer = loop.call_at(at, self._release)
        return fut

    def _release(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        held = self._held
        loop = asyncio.get_running_loop()
        t = loop.time()
        while held and held[0][0] <= t:
            fut = heapq.heappop(held)[2]
            if not fut.done():
                fut.set_result(None)
        if held:
            self._timer_at = held[0][0]
            self._timer = loop.call_at(self._timer_at, self._release)


# -- one request in flight ---------------------------------------------------------------------


class Flight:
    """What an adapter and the edge share about one request.

    The adapter sets ``response_started`` (and ``status``) when the first byte of a response
    leaves, and ``abandoned`` when it sees the client go away before cancelling the handler.
    ``on_old`` is the adapter's hook for requests that outlive the policy's ``sweep_period``
    (start watching for a disconnect); it returns True once it needs no further calls.
    """

    __slots__ = (
        "abandoned",
        "admitted",
        "classification",
        "deadline",
        "expired",
        "on_old",
        "quota",
        "reports",
        "response_started",
        "started",
        "status",
        "task",
        "timer",
    )

    def __init__(self, started: float, on_old: Callable[[], bool] | None = None) -> None:
        self.started = started
        self.on_old = on_old
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: Deadline | None = None
        self.classification: Classification | None = None
        self.quota: QuotaDecision | None = None
        self.admitted = False
        self.response_started = False
        self.status = 0
        self.abandoned = False
        self.expired = False
        self.reports = True
        """True when the edge, not a bulkhead, reports this request's lifecycle events."""

    def old(self) -> bool:
        """Called by the sweep once the request is older than the sweep period: runs the
        ``on_old`` hook. True once no further calls are needed."""
        on_old = self.on_old
        return True if on_old is None else on_old()


class _Sweeper:
    """One loop timer for every request in flight through a policy (per event loop).

    Every ``period`` seconds it visits the requests older than ``period``: it arms the
    request's deadline timer (a request that ends sooner never pays for one) and calls the
    adapter's ``on_old`` hook (start watching for a client disconnect). Each request costs a
    dictionary insert and delete.
    """

    __slots__ = ("loop", "pending", "period", "timer")

    def __init__(self, period: float) -> None:
        self.period = period
        self.pending: dict[Flight, None] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, flight: Flight, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self.loop:  # used from another loop (tests, a new server): start afresh
            if self.timer is not None:
                self.timer.cancel()
            self.pending.clear()
            self.timer = None
            self.loop = loop
        self.pending[flight] = None
        if self.timer is None:
            self.timer = loop.call_later(self.period, self._sweep)

    def track(
        self, flight: Flight, task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Watch ``flight`` (its ``deadline`` set) until `forget`: a deadline within one sweep
        period gets its timer now, since the sweep would come too late for it; the sweep arms
        the others once their request is old."""
        deadline = flight.deadline
        if deadline is not None and deadline.at - flight.started <= self.period:
            flight.timer = loop.call_at(deadline.at, _expire, flight, task)
        if loop is self.loop:  # `add`, inlined: once per request
            self.pending[flight] = None
            if self.timer is None:
                self.timer = loop.call_later(self.period, self._sweep)
        else:
            self.add(flight, loop)

    def forget(self, flight: Flight) -> None:
        """The request ended: stop watching it and cancel its deadline timer."""
        self.pending.pop(flight, None)
        timer = flight.timer
        if timer is not None:
            timer.cancel()

    def _sweep(self) -> None:
        self.timer = None
        pending = self.pending
        if not pending:
            return
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - self.period
        for flight in list(pending):
            if flight.started > cutoff:
                break  # insertion order is arrival order: the rest are younger
            if flight.timer is None and flight.deadline is not None and flight.task is not None:
                flight.timer = loop.call_at(flight.deadline.at, _expire, flight, flight.task)
            if flight.old():
                del pending[flight]
        if pending:
            self.timer = loop.call_later(self.period, self._sweep)


class Express:
    """A route's plan for adapters' fast path (`EdgePolicy.express`): a request without
    brownout headers (or with a plain budget), arriving at an uncontended bulkhead, gets the
    route's default budget and classification and is admitted with
    `Bulkhead.admit_uncontended`. Slots, not a NamedTuple: CPython 3.11 specializes reads of
    slots, not of NamedTuple fields, and adapters read these once per request."""

    __slots__ = ("bulkhead", "classification", "classifier", "degraded", "seconds")

    def __init__(
        self,
        bulkhead: Bulkhead,
        seconds: float,
        classification: Classification,
        classifier: Classifier | None,
        degraded: DegradedModes | None,
    ) -> None:
        self.bulkhead = bulkhead
        self.seconds = seconds
        """The route's default budget."""
        self.classification = classification
        """What the route gives a request without headers (the classifier's starting point)."""
        self.classifier = classifier
        self.degraded = degraded
        """The policy's degraded modes: announced on the response, fallbacks settled."""


class ExpressScope:
    """The request scope of an express admission, for adapters whose fast path need not be
    one coroutine frame (aiohttp, gRPC; the ASGI middleware inlines the same steps): the
    `Flight` marked admitted (its bulkhead reports the lifecycle), the request context with
    the budget's deadline, the fallback marks when degraded modes are declared, and the sweep
    (deadline timer, ``on_old`` hook). `close` undoes all of it once the handler is done; the
    adapter then settles the permit (`EdgePolicy.express_raised` on an exception)."""

    __slots__ = (
        "_marks_token",
        "_policy",
        "_sweeper",
        "_token",
        "cancelling",
        "flight",
        "marks",
        "task",
    )

    def __init__(
        self,
        policy: EdgePolicy,
        express: Express,
        flight: Flight,
        cls: Classification,
        seconds: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        started = flight.started
        flight.classification = cls
        flight.admitted = True
        flight.reports = False  # the bulkhead reports the lifecycle
        ctx = _inbound_context(
            started + seconds, cls.priority, cls.caller, cls.operation, cls.in_progress, started
        )
        flight.deadline = ctx.deadline
        task = flight.task = current_task_of(loop)
        assert task is not None
        self._policy = policy
        self.flight = flight
        self.task = task
        self._token = _set_current(ctx)
        self.marks: list[str] | None = None
        """The degraded modes whose fallback answered, when modes are declared."""
        self._marks_token: Token[list[str] | None] | None = None
        if express.degraded is not None:
            self.marks = []
            self._marks_token = served_by_fallback.set(self.marks)
        self._sweeper = sweeper = policy._sweeper
        sweeper.track(flight, task, loop)
        self.cancelling = task.cancelling()
        """The task's cancel count before the handler ran (`EdgePolicy.express_raised`)."""

    def close(self) -> None:
        self._sweeper.forget(self.flight)
        _reset_current(self._token)
        if self._marks_token is not None:
            served_by_fallback.reset(self._marks_token)

    def settle(self, permit: Permit | Untracked) -> None:
        """The handler answered (``flight.status`` set): settle ``permit`` as `serve` does."""
        flight = self.flight
        if flight.abandoned:
            # It swallowed the cancellation for its client's disconnect and answered anyway:
            # nobody hears the answer, so it is abandoned (O1), not a success.
            permit.settle_raised(asyncio.CancelledError)
        elif flight.status >= 500:
            permit.failed(f"status_{flight.status}")
        elif self.marks:  # a fallback answered: a success the limit must not learn from
            assert flight.classification is not None
            assert flight.deadline is not None
            self._policy.settle_fallback(permit, flight, flight.classification, flight.deadline)
        else:
            permit.success()


_BUDGET_BYTES = BUDGET_HEADER.encode("latin-1")
EXPRESS_HEADERS = frozenset(
    name.encode("latin-1") for name in (BUDGET_HEADER, SIGNED_BUDGET_HEADER, PRIORITY_HEADER)
)
"""Request headers (lower case, bytes) the edge has a decision to make about (honour, clamp, or
ignore and report): a request carrying any of them takes the express path only through
`EdgePolicy.express_budget`."""


class Abandoned:
    """The type of `ABANDONED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABANDONED"


ABANDONED = Abandoned()
"""What `EdgePolicy.serve` returns when the client went away and the handler was cancelled."""


# -- the policy --------------------------------------------------------------------------------


def _no_header(name: str) -> None:
    return None


# Enum members read through their class cost ~75 ns each on CPython 3.11 (the metaclass's
# attribute lookup); the hot path compares against these module-level names instead.
_SIGNED = Trust.SIGNED
_TRUSTED = Trust.TRUSTED
_LOOP_CLOCK = default_clock()


def _expire(flight: Flight, task: asyncio.Task[Any]) -> None:
    """Deadline timer: cancel the request's task (turned into `DeadlineExceeded`)."""
    if not task.done():
        flight.expired = True
        task.cancel()


@dataclass(eq=False)
class EdgePolicy:
    """Everything the edge decides for inbound requests, independent of any framework.

    - ``bulkhead``: the default admission for every route (``None``: no admission control,
      deadlines and classification only);
    - ``deadline``: the inbound deadline policy; `Route` ``default``/``maximum`` override it;
    - ``trust``: how far a request's headers are believed (a `Trust` or a function of the
      framework request); only ``Trust.TRUSTED`` sources may claim a priority by header (S4),
      capped at ``max_claimed_priority``;
    - ``classifier``: the last word on priority, caller and operation (runs after auth);
    - ``health_paths``: always answered, never admitted, never counted (S7);
    - ``routes``: per-route policy keyed by route template (HTTP) or full method name (gRPC);
    - ``quota`` and ``on_quota_exceeded``: the optional quota hook (429), or demotion to
      ``SHEDDABLE`` when the bulkhead has idle capacity (S5);
    - ``degraded``: active degraded modes are announced on every response (G2);
    - ``slowed``: hold refusals until about the median success latency (S6);
    - ``statuses``: reason -> HTTP status overrides (defaults: quota 429, deadline expiry
      ``expired_status`` (504), anything else 503);
    - ``do_not_retry``: reasons whose refusals carry ``brownout-retry: never`` (by default only
      those that already went through a retry layer: budget exhausted, do-not-retry);
    - ``retry_after_jitter``: Retry-After is stretched by a random factor in
      ``[1, 1 + jitter]`` so refused callers do not come back together;
    - ``sweep_period``: requests older than this get their deadline timer and disconnect
      watch from one shared sweep (faster requests never pay for a timer); the deadline itself
      is enforced exactly.
    """

    bulkhead: Admission | None = None
    deadline: InboundDeadlinePolicy = field(default_factory=InboundDeadlinePolicy)
    trust: TrustSource = Trust.UNTRUSTED
    classifier: Classifier | None = None
    health_paths: Collection[str] = ("/health", "/healthz", "/ready", "/readyz")
    routes: Mapping[str, Route] = field(default_factory=dict)
    default_priority: Priority = Priority.CRITICAL
    max_claimed_priority: Priority = Priority.CRITICAL
    quota: QuotaCheck | None = None
    on_quota_exceeded: Literal["reject", "demote"] = "reject"
    degraded: DegradedModes | None = None
    slowed: SlowedRejections | None = None
    expired_status: int = 504
    statuses: Mapping[Reason, int] = field(default_factory=dict)
    do_not_retry: Collection[Reason] = _DEFAULT_DO_NOT_RETRY
    retry_after_jitter: float = 0.5
    sweep_period: float = 0.05
    name: str = "edge"
    events: EventHub = field(default=hub, repr=False)
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        if self.on_quota_exceeded not in ("reject", "demote"):
            raise ValueError('on_quota_exceeded must be "reject" or "demote"')
        if self.retry_after_jitter < 0:
            raise ValueError("retry_after_jitter must be >= 0")
        self.health_paths = frozenset(self.health_paths)
        self._trust_fn: Callable[[Any], Trust] | None = (
            None if isinstance(self.trust, Trust) else self.trust
        )
        self._fixed_trust = self.trust if isinstance(self.trust, Trust) else Trust.UNTRUSTED
        self._dnr = frozenset(self.do_not_retry)
        self._resolved: dict[str, ResolvedRoute] = {}
        self._patterns: list[tuple[re.Pattern[str], str]] = []
        for template, route in self.routes.items():
            self._resolved[template] = self._resolve(template, route)
            self._patterns.append((compile_template(template), template))
        self._unmatched = self._resolve(UNMATCHED, Route())
        self._plain: dict[str, Classification] = {}
        self._refusals: dict[Reason, Refusal] = {r: self._build_refusal(r) for r in Reason}
        if self.sweep_period <= 0:
            raise ValueError("sweep_period must be > 0")
        self._sweeper = _Sweeper(self.sweep_period)

    # -- configuration, resolved once -----------------------------------------------------
    def _resolve(self, template: str, route: Route) -> ResolvedRoute:
        d = self.deadline
        if route.default is not None or route.maximum is not None:
            maximum = route.maximum if route.maximum is not None else d.maximum
            default = route.default if route.default is not None else min(d.default, maximum)
            d = dc_replace(d, default=default, maximum=maximum)
        return ResolvedRoute(
            template,
            route.priority if route.priority is not None else self.default_priority,
            d,
            route.bulkhead if route.bulkhead is not None else self.bulkhead,
        )

    def status_for(self, reason: Reason) -> int:
        """The HTTP status for a refusal with ``reason``."""
        s = self.statuses.get(reason)
        if s is not None:
            return s
        if reason is Reason.QUOTA:
            return 429
        if reason is Reason.DEADLINE_EXPIRED or reason is Reason.OUTCOME_UNKNOWN:
            return self.expired_status  # a gateway timeout: downstream never answered in time
        return 503

    def _build_refusal(self, reason: Reason) -> Refusal:
        status = self.status_for(reason)
        dnr = reason in self._dnr
        body = problem_body(reason, status, do_not_retry=dnr)
        return Refusal(status, reason, body, None, dnr, ())

    # -- routes ---------------------------------------------------------------------------
    def route(self, template: str | None) -> ResolvedRoute:
        """The resolved policy for a route template (or the catch-all for ``None``/unknown)."""
        if template is None:
            return self._unmatched
        r = self._resolved.get(template)
        if r is None:
            if len(self._resolved) >= 1024:  # templates come from the app; still, bound it
                return self._unmatched
            r = self._resolved[template] = ResolvedRoute(
                template, self.default_priority, self.deadline, self.bulkhead
            )
        return r

    def match(self, path: str) -> str | None:
        """The template of this policy's own ``routes`` that matches ``path``, if any (for apps
        whose framework cannot name the route)."""
        for pattern, template in self._patterns:
            if pattern.fullmatch(path) is not None:
                return template
        return None

    def is_health(self, path: str) -> bool:
        """True for health and readiness paths: answered always, never admitted."""
        return path in self.health_paths

    # -- refusals -------------------------------------------------------------------------
    def refusal(
        self,
        reason: Reason,
        retry_after: float | None = None,
        *,
        quota: QuotaDecision | None = None,
    ) -> Refusal:
        """The refusal for ``reason``: precomputed body, jittered Retry-After when known."""
        base = self._refusals[reason]
        degraded = self.degraded.active_names() if self.degraded is not None else ()
        if retry_after is None and not degraded and quota is None:
            return base
        body = base.body
        if degraded:
            body = problem_body(
                reason, base.status, degraded=degraded, do_not_retry=base.do_not_retry
            )
        estimate = retry_after if not base.do_not_retry else None
        jittered = None
        if estimate is not None:
            jittered = estimate * (1.0 + self.retry_after_jitter * self.rng.random())
        # The constructor, not ``_replace`` (a map over the fields and a dict per call).
        return Refusal(
            base.status, reason, body, jittered, base.do_not_retry, degraded, quota, estimate
        )

    def degraded_names(self) -> tuple[str, ...]:
        """The active degraded modes (empty when none or not configured)."""
        return self.degraded.active_names() if self.degraded is not None else ()

    # -- the flow -------------------------------------------------------------------------
    def trust_of(self, request: Any) -> Trust:
        """How far this request's headers are believed."""
        fn = self._trust_fn
        return self._fixed_trust if fn is None else fn(request)

    def classify(
        self,
        request: Any,
        route: ResolvedRoute,
        operation: str,
        trust: Trust,
        get: HeaderGetter,
    ) -> Classification:
        """The route's priority, a trusted priority claim (S4), then the user's classifier."""
        priority = route.priority
        claim = get(PRIORITY_HEADER)
        if claim is not None:
            if trust is Trust.TRUSTED:
                p = parse_priority(claim)
                if p is not None:
                    priority = p if p <= self.max_claimed_priority else self.max_claimed_priority
                elif self.events.enabled:
                    self.events.emit(
                        DeadlineHeaderIgnored(_now(), self.name, PRIORITY_HEADER, "malformed")
                    )
            elif self.events.enabled:
                self.events.emit(
                    DeadlineHeaderIgnored(_now(), self.name, PRIORITY_HEADER, "untrusted source")
                )
        cls = Classification(priority, "unknown", operation)
        if self.classifier is not None:
            cls = self.classifier(request, cls)
        return cls

    async def serve(
        self,
        request: Any,
        call: Callable[[], Awaitable[T]],
        flight: Flight,
        *,
        route: ResolvedRoute,
        get: HeaderGetter = _no_header,
        budget: float | None = None,
        answers: tuple[type[BaseException], ...] = (),
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> T | Refusal | Abandoned:
        """Classify, check quota, admit, and run ``call`` inside the request context.

        Returns what ``call`` returned, a `Refusal` for the adapter to write, or `ABANDONED`.
        ``budget`` (seconds) replaces the header-derived budget for protocols that carry
        their own deadline (gRPC); it is still clamped to the route maximum. Exceptions of
        the handler propagate, counted as failures, except ``answers``: exception types that
        are the framework's way to answer (aiohttp's ``HTTPException``), counted by the
        status the adapter put in ``flight.status``. ``loop``: the running loop, when the
        adapter already has it (a lookup costs a system call on CPython 3.11).

        Accounting: a route with a bulkhead leaves the request's lifecycle events (offered,
        admitted, shed, completed, failed, abandoned, expired) to the bulkhead, which sees all
        of them; the edge only tells the permit when a response with a 5xx status was a
        failure. Without a bulkhead, the edge reports the lifecycle itself, with latency from
        its own stopwatch. Quota refusals never reach a bulkhead, so the edge reports them.
        """
        # Few locals: the coroutine (one per request) stays within pymalloc's 512-byte small
        # objects instead of going to the system allocator.
        trust = self._fixed_trust if self._trust_fn is None else self._trust_fn(request)
        policy = route.deadline
        events = self.events
        if budget is None:
            # The common case, a request carrying no budget header, answered without building
            # an `InboundBudget` (what ``policy.resolve`` would return: the route default).
            if (
                trust is not _SIGNED
                and (trust is _TRUSTED or policy.honour_untrusted)
                and get(BUDGET_HEADER) is None
                and not policy.read_envoy
            ):
                seconds = policy.default
            else:
                seconds = policy.resolve(get, trust).seconds
        else:
            seconds = policy.clamp(budget)
        if self.classifier is None and trust is not _TRUSTED and not events.enabled:
            # No claim can be honoured and nobody listens for an ignored one: the route's own.
            # Immutable, so one per route serves every such request.
            cls = self._plain.get(route.template)
            if cls is None or cls.priority is not route.priority:
                cls = Classification(route.priority, "unknown", route.template)
                if len(self._plain) < 1024:
                    self._plain[route.template] = cls
        else:
            cls = self.classify(request, route, route.template, trust, get)
        flight.classification = cls
        bulkhead = route.bulkhead
        flight.reports = bulkhead is None
        demote = False
        result: Any = None
        if self.quota is not None:
            result = await self._check_quota(cls, flight, bulkhead)
            if result is not None:
                return result  # type: ignore[no-any-return]
            if flight.classification is not cls:  # demoted to SHEDDABLE
                demote = True
                cls = flight.classification
        if loop is None:
            loop = running_loop()
        task = flight.task = current_task_of(loop)
        assert task is not None
        parent = _get_current()
        seconds += flight.started  # now the deadline's instant
        deadline = parent.deadline
        if (
            deadline is None or not deadline.at <= seconds
        ):  # (a NaN reaches Deadline, which refuses it)
            deadline = _new_deadline(seconds) if seconds == seconds else Deadline(seconds)
        flight.deadline = deadline
        try:
            # The request context, set directly (what ``brownout.request(...)`` sets, without
            # its per-call dictionaries): deadline, priority, caller, operation, stopwatch.
            ctx = _make_context(
                deadline,
                cls.priority,
                cls.caller,
                cls.operation,
                parent.attempt,
                parent.idempotency_key,
                cls.in_progress,
                flight.started,
            )
            token = _set_current(ctx)
            marks: list[str] | None = None
            marks_token = None
            if self.degraded is not None:
                marks = []
                marks_token = served_by_fallback.set(marks)
            try:
                # Against the stopwatch's start when nothing was awaited since (no second
                # clock read; a deadline passing in those microseconds is caught by its timer,
                # armed below as it is that close); after a quota check, against now. A
                # bulkhead checks it itself at entry, and counts it (offered, shed
                # deadline_expired); without one the edge counts it the same way (O1).
                if bulkhead is None and deadline.at <= (
                    flight.started if self.quota is None else loop.time()
                ):
                    if events.enabled:
                        self._emit_refused(cls, Reason.DEADLINE_EXPIRED)
                    raise DeadlineExceeded("the deadline expired before the work started")
                # One loop timer enforces the deadline, as asyncio.timeout does: it cancels
                # the task, and that cancellation becomes DeadlineExceeded below.
                cancelling = task.cancelling()
                sweeper = self._sweeper
                sweeper.track(flight, task, loop)
                try:
                    if bulkhead is None:
                        if events.enabled:
                            self._emit_unguarded_admission(cls, deadline)
                        flight.admitted = True
                        result = await call()
                    elif demote:
                        # Idle capacity was checked (`_check_quota`); a refusal by the
                        # bulkhead's own rules (shares, overload, deadline) is answered and
                        # counted as any refusal at admission.
                        permit = bulkhead.try_admit()
                        flight.admitted = True
                        result = await _run_settling(permit, call, flight, answers)
                        if marks and not permit.settled:
                            self.settle_fallback(permit, flight, cls, deadline)
                    else:
                        answered: BaseException | None = None
                        async with bulkhead.admit() as permit:
                            flight.admitted = True
                            try:
                                result = await call()
                            except answers as e:  # an answer, not a failure, for the bulkhead
                                answered = e
                            if flight.abandoned:
                                # The handler swallowed the cancellation for its client's
                                # disconnect and answered anyway: abandoned (O1), as if it
                                # had let the cancellation through.
                                if hasattr(permit, "settle_raised"):
                                    permit.settle_raised(asyncio.CancelledError)
                            elif flight.status >= 500:
                                if hasattr(permit, "failed"):
                                    permit.failed(f"status_{flight.status}")
                            elif marks and answered is None:
                                self.settle_fallback(permit, flight, cls, deadline)
                        if answered is not None:
                            raise answered
                except asyncio.CancelledError:
                    if flight.expired and task.uncancel() <= cancelling:
                        raise DeadlineExceeded(
                            "the deadline expired; the work was cancelled"
                        ) from None
                    raise
                finally:
                    sweeper.forget(flight)
                    flight.task = None
            finally:
                _reset_current(token)
                if marks_token is not None:
                    served_by_fallback.reset(marks_token)
        except (asyncio.CancelledError, Exception) as e:
            if isinstance(e, Rejected) and not flight.admitted:
                # Refused at admission: the bulkhead already reported the shed.
                if self.slowed is None:
                    return self.refusal(e.reason, e.retry_after)
                return await self._held(self.refusal(e.reason, e.retry_after))
            answer = self.answer_raised(e, flight, task, answers)
            if answer is None:
                raise
            return answer
        if flight.abandoned:
            return self.record_abandoned(flight)
        if self.slowed is not None or flight.reports:
            self._finished(flight, cls, deadline)
        return result  # type: ignore[no-any-return]  # (typing.cast is a call on the hot path)

    def answer_raised(
        self,
        e: BaseException,
        flight: Flight,
        task: asyncio.Task[Any],
        answers: tuple[type[BaseException], ...] = (),
    ) -> Refusal | Abandoned | None:
        """The answer to an exception out of an admitted handler (or its admission after a
        quota check): a `Refusal` to write, `ABANDONED`, or ``None`` to let ``e`` propagate.
        Adapters' fast paths share it with `serve`. The permit, if any, is already settled.
        """
        if isinstance(e, Rejected):
            # A refusal from inside the handler (a dependency's breaker, budget, ...).
            if flight.reports:
                self._failed(flight, "Rejected")  # as a bulkhead reports it (admission.md)
            if flight.response_started:
                return None
            return self.refusal(e.reason, e.retry_after)
        if isinstance(e, DeadlineExceeded):
            if flight.abandoned:
                return self.record_abandoned(flight)
            cls = flight.classification
            if flight.admitted and flight.reports and self.events.enabled and cls is not None:
                self.events.emit(
                    RequestExpired(
                        _now(), self.name, cls.operation, cls.priority, cls.caller, "running", 0.0
                    )
                )
            if flight.response_started:
                return None
            return self.refusal(Reason.DEADLINE_EXPIRED)
        if isinstance(e, asyncio.CancelledError):
            if flight.abandoned:
                task.uncancel()
                return self.record_abandoned(flight)
            return None
        if flight.abandoned:
            return self.record_abandoned(flight)
        if isinstance(e, UnknownOutcome):
            # D6: the retry layer below already gave up on this mutation; the caller must
            # reconcile by key, so the answer says "do not retry" instead of a bare 500.
            if flight.reports:
                self._failed(flight, "UnknownOutcome")
            if flight.response_started:
                return None
            return self.refusal(Reason.OUTCOME_UNKNOWN)
        if flight.reports and isinstance(e, Exception):
            cls = flight.classification
            deadline = flight.deadline
            if answers and isinstance(e, answers) and cls is not None and deadline is not None:
                self._finished(flight, cls, deadline)
            else:
                self._failed(flight, type(e).__name__)
        return None

    def express_admit(
        self, express: Express, request: Any, started: float, seconds: float
    ) -> tuple[Permit | Untracked, Classification] | None:
        """Admission on the express path of a request arriving at ``started`` with ``seconds``
        to its deadline: the classifier on the route's default classification, then
        `Bulkhead.admit_uncontended`. The permit and the classification, or ``None`` (a spent
        budget, a contended bulkhead: nothing counted) for the adapter to take `serve`. The
        ASGI middleware inlines the same steps."""
        if not seconds > 0.0:
            return None
        cls = express.classification
        if express.classifier is not None:
            cls = express.classifier(request, cls)
        permit = express.bulkhead.admit_uncontended(
            cls.priority, cls.caller, cls.operation, started, seconds
        )
        return None if permit is None else (permit, cls)

    def express_raised(
        self,
        e: BaseException,
        permit: Permit | Untracked,
        flight: Flight,
        task: asyncio.Task[Any],
        cancelling: int,
    ) -> Refusal | Abandoned:
        """The express path's handler raised ``e``: settle ``permit`` by it, turn the
        cancellation by our own deadline timer into `DeadlineExceeded` (``cancelling``: the
        task's count before the handler ran; a higher one is an outer cancellation, a server
        shutting down, and stays one), and answer as `serve` would (`answer_raised`).

        Returns the `Refusal` to write or `ABANDONED`; re-raises when there is nothing to
        answer (``e`` itself, or the `DeadlineExceeded` it became)."""
        permit.settle_raised(type(e))
        raised = e
        if (
            flight.expired
            and isinstance(e, asyncio.CancelledError)
            and task.uncancel() <= cancelling
        ):
            raised = DeadlineExceeded("the deadline expired; the work was cancelled")
        answer = self.answer_raised(raised, flight, task)
        if answer is None:
            if raised is e:
                raise e
            raise raised from None
        return answer

    def express(self, route: ResolvedRoute) -> Express | None:
        """The fast path's plan for ``route``, or ``None`` when only `serve` can handle it.

        A route qualifies when its requests need nothing `serve` adds beyond admission and
        degraded-mode bookkeeping: a `Bulkhead` on the loop's clock, no quota hook or slowed
        refusals, no Envoy header. Each request then still takes `serve` if it carries a
        brownout header (a budget, signed or not, or a priority claim: trust only matters for
        those), runs inside another request's context, or finds the bulkhead contended (see
        `Bulkhead.admit_uncontended`). The classifier, if any, runs on the express path too,
        with the same default classification `serve` would give it. Read once per route, like
        the rest of the policy.
        """
        bulkhead = route.bulkhead
        if (
            not isinstance(bulkhead, Bulkhead)
            or bulkhead._clock is not _LOOP_CLOCK
            or self.quota is not None
            or self.slowed is not None
            or route.deadline.read_envoy
        ):
            return None
        return Express(
            bulkhead,
            route.deadline.default,
            Classification(route.priority, "unknown", route.template),
            self.classifier,
            self.degraded,
        )

    def express_budget(
        self, route: ResolvedRoute, request: Any, headers: Iterable[tuple[bytes, bytes]]
    ) -> float:
        """The budget (seconds) of a request whose brownout headers the express path can take
        itself, or ``0.0`` for `serve` to decide.

        The express path takes one unsigned budget header and nothing else (every call
        between brownout services carries one), where `InboundDeadlinePolicy.resolve` would
        simply honour it: clamped to the route maximum, or the route default where the source
        may not set it. `serve` takes a priority claim, a signed budget or a signed trust, a
        malformed, repeated or already spent budget, and Envoy's header (it reports what it
        ignores). ``headers``: (lower-case name, value) byte pairs.
        """
        raw: bytes | None = None
        for name, value in headers:
            if name in EXPRESS_HEADERS:
                if name != _BUDGET_BYTES or raw is not None:
                    return 0.0
                raw = value
        policy = route.deadline
        if raw is None:
            return policy.default
        if policy.read_envoy:
            return 0.0
        trust = self._fixed_trust if self._trust_fn is None else self._trust_fn(request)
        if trust is _SIGNED:
            return 0.0
        if trust is not _TRUSTED and not policy.honour_untrusted:
            return policy.default  # resolve ignores it without a word: so do we
        try:
            seconds = decode_budget_ms(raw)
        except HeaderError:
            return 0.0
        # A spent budget (0) is also serve's: it answers 504 before the work starts.
        return seconds if seconds < policy.maximum else policy.maximum

    async def _check_quota(
        self, cls: Classification, flight: Flight, bulkhead: Admission | None
    ) -> Refusal | None:
        """The quota hook's verdict: a refusal, or ``None`` to go on (``flight.classification``
        replaced by a ``SHEDDABLE`` one when an over-quota caller is demoted: only while the
        bulkhead has an idle permit, checked here so that the 429 otherwise answered is
        counted as what it is, a quota refusal, not offered to the bulkhead and shed there as
        ``overloaded``)."""
        assert self.quota is not None
        decision = await self.quota(cls)
        flight.quota = decision
        if decision.allowed:
            return None
        if (
            self.on_quota_exceeded == "demote"
            and bulkhead is not None
            and _quota_reason(decision) is Reason.QUOTA
            and _idle(bulkhead)
        ):
            flight.classification = cls._replace(priority=Priority.SHEDDABLE)
            return None
        return await self._refuse_quota(cls, decision)

    def _finished(self, flight: Flight, cls: Classification, deadline: Deadline) -> None:
        if self.slowed is None and not (flight.reports and self.events.enabled):
            return  # nobody to tell: skip the clock read
        t = _now()
        status = flight.status
        if status >= 500:
            if flight.reports:
                self._failed(flight, f"status_{status}", t)
            return
        latency = t - flight.started
        useful = t <= deadline.at
        if useful and self.slowed is not None:
            self.slowed.observe(latency)
        if flight.reports and self.events.enabled:
            self.events.emit(
                RequestCompleted(
                    t, self.name, cls.operation, cls.priority, cls.caller, latency, useful
                )
            )

    # -- helpers of serve ------------------------------------------------------------------
    async def _held(self, refusal: Refusal) -> Refusal:
        slowed = self.slowed
        if slowed is not None:
            fut = slowed.hold()
            if fut is not None:
                await fut
        return refusal

    def settle_fallback(
        self, permit: Any, flight: Flight, cls: Classification, deadline: Deadline
    ) -> None:
        """A degraded-mode fallback answered: count the success, but teach the limit nothing.

        A fallback answers in microseconds; fed to an adaptive limit it drags the no-load
        baseline down, and when the mode ends the normal latency reads as queueing and the
        limit collapses (seen in the lab: 25% of capacity until the next probe).
        """
        permit.ignore()
        if self.events.enabled:
            now = _now()
            self.events.emit(
                RequestCompleted(
                    now,
                    self.name,
                    cls.operation,
                    cls.priority,
                    cls.caller,
                    now - flight.started,
                    now <= deadline.at,
                )
            )

    async def _refuse_quota(self, cls: Classification, decision: QuotaDecision) -> Refusal:
        reason = _quota_reason(decision)
        if self.events.enabled:
            self._emit_refused(cls, reason)
        return await self._held(self.refusal(reason, decision.retry_after, quota=decision))

    def _emit_refused(self, cls: Classification, reason: Reason) -> None:
        """Count a request refused before any bulkhead saw it: offered, then shed."""
        t = _now()
        events = self.events
        events.emit(RequestOffered(t, self.name, cls.operation, cls.priority, cls.caller, None))
        events.emit(
            RequestShed(t, self.name, cls.operation, cls.priority, cls.caller, reason, None, 0.0)
        )

    def _emit_unguarded_admission(self, cls: Classification, deadline: Deadline) -> None:
        t = _now()
        self.events.emit(
            RequestOffered(
                t, self.name, cls.operation, cls.priority, cls.caller, deadline.remaining()
            )
        )
        self.events.emit(
            RequestAdmitted(t, self.name, cls.operation, cls.priority, cls.caller, 0.0)
        )

    def _failed(self, flight: Flight, error: str, t: float | None = None) -> None:
        if self.events.enabled and flight.classification is not None:
            t = _now() if t is None else t
            c = flight.classification
            self.events.emit(
                RequestFailed(
                    t, self.name, c.operation, c.priority, c.caller, t - flight.started, error
                )
            )

    def record_abandoned(self, flight: Flight) -> Abandoned:
        """Count the request as abandoned by its client (not a success), unless its bulkhead
        reports the lifecycle; for adapters that learn of a disconnect by a cancellation."""
        if flight.reports and self.events.enabled and flight.classification is not None:
            t = _now()
            c = flight.classification
            self.events.emit(
                RequestAbandoned(
                    t, self.name, c.operation, c.priority, c.caller, t - flight.started
                )
            )
        return ABANDONED


async def _run_settling(
    permit: Any,
    call: Callable[[], Awaitable[T]],
    flight: Flight,
    answers: tuple[type[BaseException], ...],
) -> T:
    """Run ``call`` under a permit from ``try_admit`` and settle it by the outcome, the way
    ``async with bulkhead.admit()`` would."""
    try:
        result = await call()
    except (TimeoutError, asyncio.CancelledError, Rejected) as e:
        # Counted as `async with bulkhead.admit()` counts them on the general path: expired,
        # abandoned, or failed with the refusal's name.
        permit.settle_raised(type(e))
        raise
    except BaseException as e:
        if isinstance(e, answers) and flight.status < 500:
            permit.success()
        else:
            permit.failed(type(e).__name__)
        raise
    if flight.abandoned:  # the cancellation for a disconnect, swallowed: abandoned (O1)
        permit.settle_raised(asyncio.CancelledError)
    elif flight.status >= 500:
        permit.failed(f"status_{flight.status}")
    elif not served_by_fallback.get():
        permit.success()
    return result  # a fallback's answer is settled by the edge (`settle_fallback`)


_ENCODED: dict[str, bytes] = {}


def header_getter(pairs: Iterable[tuple[bytes, bytes]]) -> HeaderGetter:
    """A header getter over ASGI-style ``(lower-case name, value)`` byte pairs."""

    def get(name: str) -> bytes | None:
        key = _ENCODED.get(name)
        if key is None:
            key = name.encode("latin-1")
            if len(_ENCODED) < 64:
                _ENCODED[name] = key
        for k, v in pairs:
            if k == key:
                return v
        return None

    return get
