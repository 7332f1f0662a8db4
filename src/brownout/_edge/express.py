"""The express path's plan and scope: how adapters serve a request with nothing to decide
(no brownout header but a plain budget, a bulkhead with room and nobody queued) without
`EdgePolicy.serve`, with the same answers and counts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextvars import Token
from typing import TYPE_CHECKING

from .._admission.bulkhead import Bulkhead
from .._admission.permit import Permit, Untracked
from .._clock import current_task_of
from .._context import inbound_context, reset_current, set_current
from .._degrade.markers import served_by_fallback
from .._propagation import (
    ATTEMPT_HEADER,
    BUDGET_HEADER,
    IDEMPOTENCY_HEADER,
    PRIORITY_HEADER,
    SIGNED_BUDGET_HEADER,
)
from .flight import Flight, Sweeper
from .protocols import ActiveModes, Classification, RequestClassifier

if TYPE_CHECKING:
    from .policy import EdgePolicy

__all__ = ["BUDGET_BYTES", "EXPRESS_HEADERS", "Express", "ExpressScope"]

BUDGET_BYTES = BUDGET_HEADER.encode("latin-1")
EXPRESS_HEADERS = frozenset(
    name.encode("latin-1")
    for name in (
        BUDGET_HEADER,
        SIGNED_BUDGET_HEADER,
        PRIORITY_HEADER,
        IDEMPOTENCY_HEADER,
        ATTEMPT_HEADER,
    )
)
"""Request headers (lower case, bytes) the edge has a decision to make about (honour, clamp, or
ignore and report): a request carrying any of them takes the express path only through
`EdgePolicy.express_budget`, which leaves all but a plain budget to `EdgePolicy.serve` (an
idempotency key or attempt number goes into the request context there, I1)."""


class Express:
    """A route's plan for adapters' fast path (`EdgePolicy.express`): a request without
    brownout headers (or with a plain budget), arriving at an uncontended bulkhead, gets the
    route's default budget and classification and is admitted with
    `Bulkhead.admit_uncontended`. Slots, not a NamedTuple: the interpreter specializes slot
    reads, not NamedTuple field reads, and adapters read these once per request."""

    __slots__ = ("bulkhead", "classification", "classifier", "degraded", "seconds", "sweeper")

    def __init__(
        self,
        bulkhead: Bulkhead,
        seconds: float,
        classification: Classification,
        classifier: RequestClassifier | None,
        degraded: ActiveModes | None,
        sweeper: Sweeper,
    ) -> None:
        self.bulkhead = bulkhead
        self.seconds = seconds
        """The route's default budget."""
        self.classification = classification
        """What the route gives a request without headers (the classifier's starting point)."""
        self.classifier = classifier
        self.degraded = degraded
        """The policy's degraded modes: announced on the response, fallbacks settled."""
        self.sweeper = sweeper
        """The policy's sweep: deadline timers and ``on_old`` hooks of old requests."""


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
        carried: str = "header",
    ) -> None:
        started = flight.started
        # ``carried``: where a budget other than the route default came from. The default
        # is handed on as the route's own float, so identity tells the two apart.
        origin = "default" if seconds is express.seconds else carried
        flight.classification = cls
        flight.admitted = True
        flight.reports = False  # the bulkhead reports the lifecycle
        ctx = inbound_context(
            started + seconds,
            cls.priority,
            cls.caller,
            cls.operation,
            cls.in_progress,
            started,
            origin,
        )
        flight.deadline = ctx.deadline
        task = flight.task = current_task_of(loop)
        assert task is not None
        self._policy = policy
        self.flight = flight
        self.task = task
        self._token = set_current(ctx)
        self.marks: list[str] | None = None
        """The degraded modes whose fallback answered, when modes are declared."""
        self._marks_token: Token[list[str] | None] | None = None
        if express.degraded is not None:
            self.marks = []
            self._marks_token = served_by_fallback.set(self.marks)
        self._sweeper = sweeper = express.sweeper
        sweeper.track(flight, task, loop)
        self.cancelling = task.cancelling()
        """The task's cancel count before the handler ran (`EdgePolicy.express_raised`)."""

    def close(self) -> None:
        self._sweeper.forget(self.flight)
        reset_current(self._token)
        if self._marks_token is not None:
            served_by_fallback.reset(self._marks_token)

    def settle(self, permit: Permit | Untracked) -> None:
        """The handler answered (``flight.status`` set): settle ``permit`` by the answer
        (`EdgePolicy.settle`)."""
        marks: Sequence[str] | None = self.marks
        self._policy.settle(permit, self.flight, marks)
