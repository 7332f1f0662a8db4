"""`EdgePolicy`: everything the edge decides for an inbound request, independent of any
framework, and `serve`, the general path that decides it.

For one request the policy starts the stopwatch, resolves the budget (the route's
`InboundDeadlinePolicy`), classifies the request (a priority header only from a trusted
source, S4; the user's classifier last), checks the optional quota hook (429, or demotion to
idle capacity, S5), admits through the route's bulkhead, and runs the handler inside the
request context, cancelled at deadline expiry. How the permit is settled by the answer
(`EdgePolicy.settle`) and what a raised exception answers (`EdgePolicy.answer_raised`) are
decided here for every path and adapter.

Events: a `Bulkhead` reports the whole lifecycle of the work it admits, so on a route with a
bulkhead the edge adds only what the bulkhead cannot see: refusals that never reached it
(quota) and that a 5xx response was a failure (through the permit). On a route without a
bulkhead the edge reports the lifecycle itself, with latency from its own stopwatch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Literal, TypeVar

from .._admission.bulkhead import Bulkhead
from .._admission.permit import Permit, Untracked
from .._admission.protocols import AdmitsWork, SettlesWork
from .._admission.thread_bulkhead import ThreadBulkhead
from .._clock import MonotonicClock, current_task_of, default_clock, running_loop
from .._clock import now as _now
from .._context import get_current, make_context, reset_current, set_current
from .._deadline import Deadline, new_deadline
from .._degrade.markers import served_by_fallback
from .._errors import DeadlineExceeded, HeaderError, Reason, Rejected, UnknownOutcome
from .._priority import Priority, parse_priority
from .._propagation import (
    ATTEMPT_HEADER,
    BUDGET_HEADER,
    IDEMPOTENCY_HEADER,
    PRIORITY_HEADER,
    HeaderGetter,
    InboundDeadlinePolicy,
    Repeated,
    Trust,
    bind_idempotency_key,
    decode_attempt,
    decode_budget_ms,
    decode_idempotency_key,
)
from ..events import (
    DeadlineHeaderIgnored,
    EventHub,
    HandlerOverran,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestShed,
    hub,
)
from .express import BUDGET_BYTES, EXPRESS_HEADERS, Express
from .flight import ABANDONED, ANSWERED, Abandoned, Answered, Flight, Sweeper
from .protocols import (
    ActiveModes,
    Classification,
    QuotaAnswer,
    QuotaCheck,
    RequestClassifier,
    TrustSource,
)
from .refusals import (
    DEFAULT_DO_NOT_RETRY,
    DETAILS,
    STATUS_FOR_GRPC_CODE,
    Refusal,
    grpc_code_for_status,
    problem_body,
    retry_after_window,
)
from .routes import UNMATCHED, ResolvedRoute, Route, compile_template
from .settings import edge_from
from .slowed import SlowedRejections

__all__ = ["EdgePolicy", "header_getter", "header_value", "metadata_getter", "one_value"]

T = TypeVar("T")

_log = logging.getLogger("brownout.edge")


def _idle(admission: Any) -> bool:
    """True when ``admission`` has a free permit and nobody waits for one (S5: over-quota
    work may use idle capacity only). An admission that does not say (no ``in_flight``,
    ``limit`` and ``queue_depth``, as `Bulkhead` has) is left to ``try_admit``."""
    try:
        return bool(admission.in_flight < admission.limit and not admission.queue_depth)
    except AttributeError:
        return True


def _quota_reason(decision: Any) -> Reason:
    # A quota store that is down and fails closed is the service's problem (503), not the
    # caller's (429): the decision says so with its own reason.
    reason = getattr(decision, "reason", None)
    return reason if isinstance(reason, Reason) else Reason.QUOTA


def _no_header(name: str) -> None:
    return None


# The hot path compares against module-level names: an enum member read through its class
# goes through the metaclass's attribute lookup.
_SIGNED = Trust.SIGNED
_TRUSTED = Trust.TRUSTED
_LOOP_CLOCK = default_clock()


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
    - ``metrics_paths``: the metrics endpoints, exempt like health paths, so scrapes are
      answered while the service sheds (`exempt_paths` holds both);
    - ``routes``: per-route policy keyed by route template (HTTP) or full method name (gRPC);
    - ``quota`` and ``on_quota_exceeded``: the optional quota hook (429), or demotion to
      ``SHEDDABLE`` when the bulkhead has idle capacity (S5);
    - ``degraded``: active degraded modes are announced on every response (G2);
    - ``slowed``: hold refusals until about the median success latency (S6);
    - ``statuses``: reason -> HTTP status overrides (defaults: quota 429, deadline expiry
      ``expired_status`` (504), anything else 503);
    - ``grpc_codes``: reason -> gRPC status overrides, as `grpc.StatusCode` member names
      (default: the equivalent of the HTTP status, `refusals.GRPC_CODE_FOR_STATUS`: 429
      RESOURCE_EXHAUSTED, 504 DEADLINE_EXCEEDED, 503 UNAVAILABLE), so ``statuses`` and
      ``expired_status`` decide for gRPC too;
    - ``details``: reason -> detail text overrides (problem body and gRPC status details;
      defaults: `refusals.DETAILS`);
    - ``do_not_retry``: reasons whose refusals carry ``brownout-retry: never`` (by default only
      those that already went through a retry layer: budget exhausted, do-not-retry);
    - ``retry_after_jitter``: the estimate is stretched by a random factor in
      ``[1, 1 + jitter]`` (gRPC's pushback, in ms) and ``Retry-After``, whole seconds, is
      drawn uniformly from ``[ceil(estimate), ceil(estimate * (1 + jitter)) + 1]`` with the
      same random number (`refusals.retry_after_window`), so refused callers do not come back
      together, not even within one second;
    - ``connections``: the admission of long-lived connections (websockets), a bulkhead or
      cap of their own; ``None``: the route's bulkhead (`connections.serve_connection`);
    - ``sweep_period``: requests older than this get their deadline timer and disconnect
      watch from one shared sweep (faster requests never pay for a timer); the deadline itself
      is enforced exactly.
    """

    bulkhead: AdmitsWork | None = None
    deadline: InboundDeadlinePolicy = field(default_factory=InboundDeadlinePolicy)
    trust: TrustSource = Trust.UNTRUSTED
    classifier: RequestClassifier | None = None
    health_paths: Collection[str] = ("/health", "/healthz", "/ready", "/readyz")
    metrics_paths: Collection[str] = ("/metrics",)
    routes: Mapping[str, Route] = field(default_factory=dict)
    default_priority: Priority = Priority.CRITICAL
    max_claimed_priority: Priority = Priority.CRITICAL
    quota: QuotaCheck | None = None
    on_quota_exceeded: Literal["reject", "demote"] = "reject"
    degraded: ActiveModes | None = None
    slowed: SlowedRejections | None = None
    expired_status: int = 504
    statuses: Mapping[Reason, int] = field(default_factory=dict)
    grpc_codes: Mapping[Reason, str] = field(default_factory=dict)
    details: Mapping[Reason, str] = field(default_factory=dict)
    do_not_retry: Collection[Reason] = DEFAULT_DO_NOT_RETRY
    retry_after_jitter: float = 0.5
    sweep_period: float = 0.05
    connections: AdmitsWork | None = None
    name: str = "edge"
    events: EventHub = field(default=hub, repr=False)
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        if self.on_quota_exceeded not in ("reject", "demote"):
            raise ValueError('on_quota_exceeded must be "reject" or "demote"')
        if self.retry_after_jitter < 0:
            raise ValueError("retry_after_jitter must be >= 0")
        if getattr(self.quota, "requires_classifier", False) and self.classifier is None:
            raise ValueError(
                "quota= keyed by caller needs classifier=: without one every caller is "
                "'unknown' and all share one allowance"
            )
        unknown = set(self.grpc_codes.values()) - STATUS_FOR_GRPC_CODE.keys()
        if unknown:
            raise ValueError(f"grpc_codes: not grpc.StatusCode names: {sorted(unknown)}")
        self.health_paths = frozenset(self.health_paths)
        self.metrics_paths = frozenset(self.metrics_paths)
        self.exempt_paths: frozenset[str] = self.health_paths | self.metrics_paths
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
        if self.sweep_period <= 0:
            raise ValueError("sweep_period must be > 0")
        self._sweeper = Sweeper(self.sweep_period, self._answer_expired)
        self._refusals: dict[Reason, Refusal] = {r: self._build_refusal(r) for r in Reason}

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, section: str = "edge", **code: Any
    ) -> EdgePolicy:
        """The policy described by table ``section`` of ``config`` (`brownout.load_config`;
        keys in docs/configuration.md). What is code (classifier, trust function, quota,
        degraded, events, rng) is passed as keyword arguments, which win over the settings.
        Raises `ConfigError` listing every problem."""
        return edge_from(cls, config, section, code)

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

    def grpc_code_for(self, reason: Reason) -> str:
        """The gRPC status (a `grpc.StatusCode` member name) for a refusal with ``reason``."""
        code = self.grpc_codes.get(reason)
        return code if code is not None else grpc_code_for_status(self.status_for(reason))

    def detail_for(self, reason: Reason) -> str:
        """The detail text of a refusal with ``reason`` (problem body, gRPC details)."""
        detail = self.details.get(reason)
        return detail if detail is not None else DETAILS.get(reason, reason.value)

    def _build_refusal(self, reason: Reason) -> Refusal:
        status = self.status_for(reason)
        dnr = reason in self._dnr
        detail = self.detail_for(reason)
        body = problem_body(reason, status, detail=detail, do_not_retry=dnr)
        return Refusal(
            status, reason, body, None, dnr, (), None, None, detail, self.grpc_code_for(reason)
        )

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

    def is_exempt(self, path: str) -> bool:
        """True for health and metrics paths: passed to the application, never admitted,
        queued, shed or counted."""
        return path in self.exempt_paths

    # -- refusals -------------------------------------------------------------------------
    def refusal(
        self,
        reason: Reason,
        retry_after: float | None = None,
        *,
        quota: QuotaAnswer | None = None,
    ) -> Refusal:
        """The refusal for ``reason``: precomputed body, jittered Retry-After when known."""
        base = self._refusals[reason]
        degraded = self.degraded.active_names() if self.degraded is not None else ()
        if retry_after is None and not degraded and quota is None:
            return base
        body = base.body
        if degraded:
            body = problem_body(
                reason,
                base.status,
                detail=base.detail,
                degraded=degraded,
                do_not_retry=base.do_not_retry,
            )
        estimate = retry_after if not base.do_not_retry else None
        jittered = None
        whole = None
        if estimate is not None:
            jitter = self.retry_after_jitter
            u = self.rng.random()
            jittered = estimate * (1.0 + jitter * u)
            whole = retry_after_window(estimate, jitter, u)
        # The constructor, not ``_replace`` (a map over the fields and a dict per call).
        return Refusal(
            base.status,
            reason,
            body,
            jittered,
            base.do_not_retry,
            degraded,
            quota,
            estimate,
            base.detail,
            base.grpc_code,
            whole,
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
                # Differing claims: which one was meant is anyone's guess; none is honoured.
                p = None if isinstance(claim, Repeated) else parse_priority(claim)
                if p is not None:
                    priority = p if p <= self.max_claimed_priority else self.max_claimed_priority
                elif self.events.enabled:
                    problem = "repeated" if isinstance(claim, Repeated) else "malformed"
                    self.events.emit(
                        DeadlineHeaderIgnored(_now(), self.name, PRIORITY_HEADER, problem)
                    )
            elif self.events.enabled:
                self.events.emit(
                    DeadlineHeaderIgnored(_now(), self.name, PRIORITY_HEADER, "untrusted source")
                )
        cls = Classification(priority, "unknown", operation)
        if self.classifier is not None:
            cls = self.classifier(request, cls)
        return cls

    def idempotency(
        self, get: HeaderGetter, trust: Trust, caller: str, attempt: int, key: str | None
    ) -> tuple[int, str | None]:
        """The attempt number and idempotency key a request carries (I1), else ``attempt``
        and ``key`` (the enclosing context's). The key, from any caller, is bound to
        ``caller`` (`bind_idempotency_key`: the classifier's, who authenticated it); the
        attempt is read only from a trusted source, as a priority claim is (S4). A
        malformed, repeated-with-differing-values or untrusted value is ignored and reported
        as `DeadlineHeaderIgnored`."""
        raw = get(IDEMPOTENCY_HEADER)
        if raw is not None:
            if isinstance(raw, Repeated):
                self._header_ignored(IDEMPOTENCY_HEADER, "repeated")
            else:
                try:
                    key = bind_idempotency_key(caller, decode_idempotency_key(raw))
                except HeaderError as e:
                    self._header_ignored(IDEMPOTENCY_HEADER, e.problem)
        raw = get(ATTEMPT_HEADER)
        if raw is not None:
            if trust is not _TRUSTED:
                self._header_ignored(ATTEMPT_HEADER, "untrusted source")
            elif isinstance(raw, Repeated):
                self._header_ignored(ATTEMPT_HEADER, "repeated")
            else:
                try:
                    attempt = decode_attempt(raw)
                except HeaderError as e:
                    self._header_ignored(ATTEMPT_HEADER, e.problem)
        return attempt, key

    def _header_ignored(self, header: str, problem: str) -> None:
        if self.events.enabled:
            self.events.emit(DeadlineHeaderIgnored(_now(), self.name, header, problem))

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
    ) -> T | Refusal | Abandoned | Answered:
        """Classify, check quota, admit, and run ``call`` inside the request context.

        Returns what ``call`` returned, a `Refusal` for the adapter to write, `ABANDONED`, or
        `ANSWERED` (the edge answered at the deadline through `Flight.answer_now`).
        ``budget`` (seconds) replaces the header-derived budget for protocols that carry
        their own deadline (gRPC); it is still clamped to the route maximum. Exceptions of
        the handler propagate, counted as failures, except ``answers``: exception types that
        are the framework's way to answer (aiohttp's ``HTTPException``), counted by the
        status the adapter put in ``flight.status``. ``loop``: the running loop, when the
        adapter already has it (looking it up again costs more than passing it).

        Accounting: a route with a bulkhead leaves the request's lifecycle events (offered,
        admitted, shed, completed, failed, abandoned, expired) to the bulkhead, which sees all
        of them; the edge only tells the permit when a response with a 5xx status was a
        failure. Without a bulkhead, the edge reports the lifecycle itself, with latency from
        its own stopwatch. Quota refusals never reach a bulkhead, so the edge reports them.
        """
        # Few locals: the coroutine (one per request) stays a small object for the allocator.
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
                origin = "default"
            else:
                seconds, origin, _ = policy.resolve(get, trust)
        else:
            # The protocol's own deadline, honoured by the rule the headers follow.
            seconds, origin, _ = policy.resolve(get, trust, budget)
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
        parent = get_current()
        attempt, key = self.idempotency(
            get, trust, cls.caller, parent.attempt, parent.idempotency_key
        )
        seconds += flight.started  # now the deadline's instant
        deadline = parent.deadline
        if (
            deadline is None or not deadline.at <= seconds
        ):  # (a NaN reaches Deadline, which refuses it)
            deadline = (
                new_deadline(seconds, origin)
                if seconds == seconds
                else Deadline(seconds, origin=origin)
            )
        flight.deadline = deadline
        if self.quota is not None:
            # Under the request's deadline: a shared store takes at most its share of what is
            # left (`Quota.check`), not its whole timeout before the deadline is even set.
            quota_token = set_current(
                make_context(
                    deadline,
                    cls.priority,
                    cls.caller,
                    cls.operation,
                    attempt,
                    key,
                    cls.in_progress,
                    flight.started,
                )
            )
            try:
                result = await self._check_quota(cls, flight, bulkhead)
            finally:
                reset_current(quota_token)
            if result is not None:
                return result  # type: ignore[no-any-return]
            if flight.classification is not cls:  # demoted to SHEDDABLE
                demote = True
                cls = flight.classification
        if loop is None:
            loop = running_loop()
        task = flight.task = current_task_of(loop)
        assert task is not None
        try:
            # The request context, set directly (what ``brownout.request(...)`` sets, without
            # its per-call dictionaries): deadline, priority, caller, operation, stopwatch.
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
                        if flight.expired:
                            self.overran(flight)
                    elif demote:
                        # Idle capacity was checked (`_check_quota`); a refusal by the
                        # bulkhead's own rules (shares, overload, deadline) is answered and
                        # counted as any refusal at admission.
                        permit = bulkhead.try_admit()
                        flight.admitted = True
                        try:
                            result = await call()
                        except answers:
                            self.settle(permit, flight, None)  # an answer, by its status
                            raise
                        except BaseException as e:
                            permit.settle_raised(type(e))  # as ``async with`` settles it
                            raise
                        self.settle(permit, flight, marks)
                    else:
                        answered: BaseException | None = None
                        async with bulkhead.admit() as permit:
                            flight.admitted = True
                            try:
                                result = await call()
                            except answers as e:  # an answer, not a failure, for the bulkhead
                                answered = e
                            self.settle(permit, flight, marks if answered is None else None)
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
                reset_current(token)
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
        if flight.expired:
            if flight.answered:
                return ANSWERED  # the 504 went out at the deadline; this answer is too late
            return result  # type: ignore[no-any-return]  # a started response, finished late
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
    ) -> Refusal | Abandoned | Answered | None:
        """The answer to an exception out of an admitted handler (or its admission after a
        quota check): a `Refusal` to write, `ABANDONED`, `ANSWERED` (the edge answered at the
        deadline), or ``None`` to let ``e`` propagate. Adapters' fast paths share it with
        `serve`. The permit, if any, is already settled.
        """
        if flight.expired and not isinstance(e, (DeadlineExceeded, asyncio.CancelledError)):
            # It outlived its deadline's cancellation and then raised: as late as an answer
            # (one of ``answers`` was counted when its permit was settled).
            if not (answers and isinstance(e, answers)):
                self.overran(flight)
            if flight.answered:
                return ANSWERED
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
            if flight.answered:
                return ANSWERED  # written at the deadline (`_answer_expired`)
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
    ) -> Refusal | Abandoned | Answered:
        """The express path's handler raised ``e``: settle ``permit`` by it, turn the
        cancellation by our own deadline timer into `DeadlineExceeded` (``cancelling``: the
        task's count before the handler ran; a higher one is an outer cancellation, a server
        shutting down, and stays one), and answer as `serve` would (`answer_raised`).

        Returns the `Refusal` to write, `ABANDONED` or `ANSWERED`; re-raises when there is
        nothing to answer (``e`` itself, or the `DeadlineExceeded` it became)."""
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

    def express(self, route: ResolvedRoute, *, on_thread: bool = False) -> Express | None:
        """The fast path's plan for ``route``, or ``None`` when only `serve` can handle it.

        A route qualifies when its requests need nothing `serve` adds beyond admission and
        degraded-mode bookkeeping: a `Bulkhead` on the loop's clock (``on_thread``, for the
        blocking edge: a `ThreadBulkhead` on ``time.monotonic()``, the edge's clock on a
        thread without a loop), no quota hook or slowed refusals, no Envoy header. Each
        request then still takes `serve` (on a thread: `blocking.begin`) if it carries a
        brownout header (a budget, signed or not, or a priority claim: trust only matters for
        those), runs inside another request's context, or finds the bulkhead contended (see
        `Bulkhead.admit_uncontended`). The classifier, if any, runs on the express path too,
        with the same default classification `serve` would give it. Read once per route, like
        the rest of the policy.
        """
        bulkhead = route.bulkhead
        if on_thread:
            fits = isinstance(bulkhead, ThreadBulkhead) and type(bulkhead.clock) is MonotonicClock
        else:
            fits = isinstance(bulkhead, Bulkhead) and bulkhead.clock is _LOOP_CLOCK
        if (
            not fits
            or self.quota is not None
            or self.slowed is not None
            or route.deadline.read_envoy
        ):
            return None
        assert isinstance(bulkhead, Bulkhead)
        return Express(
            bulkhead,
            route.deadline.default,
            Classification(route.priority, "unknown", route.template),
            self.classifier,
            self.degraded,
            self._sweeper,
        )

    def carried_budget(self, route: ResolvedRoute, request: Any, seconds: float | None) -> float:
        """The budget of a request without brownout headers whose protocol carries its own
        deadline (gRPC: ``seconds`` from ``grpc-timeout``, ``None`` without one), for the
        express path: as `serve` resolves it (`InboundDeadlinePolicy.honours_unsigned`:
        clamped to the route maximum where the source may set it, else the route default)."""
        policy = route.deadline
        if seconds is None:
            return policy.default
        trust = self._fixed_trust if self._trust_fn is None else self._trust_fn(request)
        if not policy.honours_unsigned(trust):
            return policy.default
        return seconds if seconds < policy.maximum else policy.maximum

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
                if name != BUDGET_BYTES or raw is not None:
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
        self, cls: Classification, flight: Flight, bulkhead: AdmitsWork | None
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

    def settle(self, permit: SettlesWork, flight: Flight, marks: Sequence[str] | None) -> None:
        """The handler answered (``flight.status`` set): settle ``permit`` by the answer. The
        one rule for `serve` and every adapter's express path; ``marks``: the degraded modes
        whose fallback answered (`served_by_fallback`), if any."""
        if flight.expired:
            # It answered after its deadline's cancellation: the edge answered 504 for it
            # then, and the slot was held until now (the work really ran that long).
            permit.settle_raised(TimeoutError)
            self.overran(flight)
        elif flight.abandoned:
            # It swallowed the cancellation for its client's disconnect and answered anyway:
            # nobody hears the answer, so it is abandoned (O1), not a success.
            permit.settle_raised(asyncio.CancelledError)
        elif flight.status >= 500:
            permit.failed(f"status_{flight.status}")
        elif marks:
            self.settle_fallback(permit, flight)
        else:
            permit.success()

    def _answer_expired(self, flight: Flight) -> None:
        """The sweep's deadline timer has just cancelled a running handler: answer it now
        (the expiry's refusal, 504), whether or not the handler stops, through the adapter
        (`Flight.answer_now`). Nothing when the response has started (it is left
        incomplete), the client is gone, the request is still waiting for admission, or the
        adapter cannot write on its own."""
        if flight.response_started or flight.abandoned or flight.answered or not flight.admitted:
            return
        if flight.answer_now(self.refusal(Reason.DEADLINE_EXPIRED)):
            flight.answered = True

    def overran(self, flight: Flight, *, on_thread: bool = False) -> None:
        """The handler ended (answered or raised) after its deadline's cancellation: count
        `HandlerOverran` and log it. Its slot was held until now; its answer is discarded
        when the edge answered for it (``flight.answered``): at the deadline on a loop, when
        it returned on a thread (``on_thread``: a thread is never cancelled)."""
        task = flight.task
        if task is not None and task.cancelling():
            task.uncancel()  # the deadline's cancellation, swallowed: not the server's
        cls = flight.classification
        deadline = flight.deadline
        t = _now()
        over = t - deadline.at if deadline is not None else 0.0
        if cls is not None:
            if self.events.enabled:
                self.events.emit(
                    HandlerOverran(t, self.name, cls.operation, cls.priority, cls.caller, over)
                )
                if flight.reports:
                    self.events.emit(
                        RequestExpired(
                            t, self.name, cls.operation, cls.priority, cls.caller, "running", 0.0
                        )
                    )
            if on_thread:
                how = "a thread is not cancelled; " + (
                    "answered 504 for it when it returned"
                    if flight.answered
                    else "its own answer had started"
                )
            else:
                how = "ignoring its cancellation; " + (
                    "answered for it at the deadline"
                    if flight.answered
                    else "the handler's own answer stood"
                )
            _log.warning(
                "%s: the handler of %s ran %.3f s past its deadline (%s; its slot was held "
                "until it returned)",
                self.name,
                cls.operation,
                over,
                how,
            )

    def settle_fallback(self, permit: SettlesWork, flight: Flight) -> None:
        """A degraded-mode fallback answered: count the success, but teach the limit nothing
        (a fallback's speed says nothing about the dependency, and would drag an adaptive
        limit's no-load baseline down)."""
        permit.ignore()
        cls = flight.classification
        if self.events.enabled and cls is not None:
            now = _now()
            deadline = flight.deadline
            self.events.emit(
                RequestCompleted(
                    now,
                    self.name,
                    cls.operation,
                    cls.priority,
                    cls.caller,
                    now - flight.started,
                    deadline is None or now <= deadline.at,
                )
            )

    async def _refuse_quota(self, cls: Classification, decision: QuotaAnswer) -> Refusal:
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


_ENCODED: dict[str, bytes] = {}

V = TypeVar("V", str, bytes)


def one_value(values: Sequence[V]) -> V | Repeated | None:
    """What a header getter returns for a header's ``values`` (in arrival order): ``None``
    for none, the value when there is one (or several equal ones), else a `Repeated` of the
    distinct values, for the reader to decide (the shortest budget wins; a priority claim is
    ignored). The one rule every adapter's lookup follows (aiohttp: ``headers.getall``)."""
    if not values:
        return None
    first = values[0]
    for value in values:
        if value != first:
            return Repeated(dict.fromkeys(values))
    return first


def header_value(pairs: Iterable[tuple[bytes, bytes]], name: str) -> bytes | Repeated | None:
    """Header ``name`` (lower case) of ASGI-style ``(lower-case name, value)`` byte pairs,
    repeated values included (`one_value`)."""
    key = _ENCODED.get(name)
    if key is None:
        key = name.encode("latin-1")
        if len(_ENCODED) < 64:
            _ENCODED[name] = key
    found: bytes | None = None
    more: list[bytes] | None = None
    for k, v in pairs:
        if k == key:
            if found is None:
                found = v
            elif more is not None:
                more.append(v)
            elif v != found:
                more = [found, v]
    return found if more is None else one_value(more)


def header_getter(pairs: Iterable[tuple[bytes, bytes]]) -> HeaderGetter:
    """A header getter over ASGI-style ``(lower-case name, value)`` byte pairs."""

    def get(name: str) -> bytes | Repeated | None:
        return header_value(pairs, name)

    return get


def metadata_getter(metadata: Sequence[Any]) -> HeaderGetter:
    """A header getter over gRPC metadata: ``(lower-case key, value)`` pairs, values
    ``str`` (or ``bytes`` for ``-bin`` keys), repeated keys included (`one_value`)."""

    def get(name: str) -> str | bytes | Repeated | None:
        return one_value([item[1] for item in metadata if item[0] == name])

    return get
