"""`SyncMessageRunner`: `MessageRunner`'s twin for workers that run a message's handler in
a thread (Celery): the same envelope, decisions and events, with the handler inside
brownout's request context.

A synchronous handler cannot be interrupted: the message's deadline is carried (outbound
calls see the budget, `brownout.check_deadline` raises past it) but not enforced by
cancellation. A handler that fails once its deadline passed is parked ``expired``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._clock import Clock, default_clock
from .._context import get_current, make_context, reset_current, set_current
from .._deadline import Deadline
from .._priority import Priority
from ..events import (
    EventHub,
    MessageCompleted,
    MessageParked,
    MessageRetried,
    MessageStarted,
    hub,
)
from .envelope import Envelope, EnvelopeError
from .policy import MessagePolicy, Park, RetryLater, Run
from .runner import Delivery, Message

__all__ = ["Outcome", "SyncHandler", "SyncMessageBroker", "SyncMessageRunner"]

R = TypeVar("R")
SyncHandler = Callable[[Message], R]


class SyncMessageBroker(Protocol):
    """What a synchronous consumer adapter does on the broker's side; each method returns
    only once the broker stored what it was asked to (a confirmed publish)."""

    def ack(self, delivery: Any) -> None: ...

    def retry_later(self, delivery: Any, envelope: Envelope, delay: float) -> None:
        """Store a copy of ``delivery`` with ``envelope``, to be delivered after ``delay``."""
        ...

    def park(self, delivery: Any, envelope: Envelope | None, reason: str, detail: str) -> None:
        """Store a copy of ``delivery`` in the parked queue with its reason."""
        ...


@dataclass(frozen=True, slots=True)
class Outcome(Generic[R]):
    """What `SyncMessageRunner.process` decided, and the handler's return value when it ran
    to the end (``decision`` is then a `Run`)."""

    decision: Run | RetryLater | Park
    result: R | None = None


class SyncMessageRunner:
    """Runs one queue's deliveries in the caller's thread: read the envelope, decide
    (`MessagePolicy`), run the handler inside brownout's request context (the message's
    remaining time, priority, caller, attempt and idempotency key), then acknowledge, retry
    later or park through ``broker``.

    Exceptions of the types in ``passthrough`` (a framework's own control flow, such as
    Celery's ``Retry``) leave the handler unchanged and undecided; only the broker's own
    failures escape otherwise, leaving the delivery unacknowledged.
    """

    def __init__(
        self,
        broker: SyncMessageBroker,
        *,
        queue: str,
        policy: MessagePolicy | None = None,
        passthrough: tuple[type[BaseException], ...] = (),
        events: EventHub = hub,
        wall: Callable[[], float] = time.time,
        clock: Clock | None = None,
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.policy = policy if policy is not None else MessagePolicy()
        self.passthrough = passthrough
        self.events = events
        self.wall = wall
        self.clock = clock if clock is not None else default_clock()

    def decide(self, headers: Mapping[str, Any], redeliveries: int) -> Run | Park:
        """Run or park a delivery with ``headers``, before running anything."""
        now = self.wall()
        try:
            envelope = Envelope.decode(headers)
        except EnvelopeError as error:
            return self.policy.malformed(error, now)
        return self.policy.before(envelope, now, redeliveries=redeliveries)

    def process(self, delivery: Delivery, handler: SyncHandler[R]) -> Outcome[R]:
        """Handle one delivery to the end; returns what was decided."""
        decision = self.decide(delivery.headers, delivery.redeliveries)
        if isinstance(decision, Park):
            attempt = decision.envelope.attempt if decision.envelope is not None else 1
            self._park(delivery, decision, attempt)
            return Outcome(decision)
        return self._run(delivery, decision, handler)

    def _run(self, delivery: Delivery, run: Run, handler: SyncHandler[R]) -> Outcome[R]:
        env = run.envelope
        now = self.wall()
        self._emit(MessageStarted, env, attempt=run.attempt, age=env.age(now), remaining=run.budget)
        message = Message(delivery.body, env, run.attempt, delivery.headers, delivery)
        parent = get_current()
        deadline = parent.deadline
        if run.budget is not None and (deadline is None or deadline.remaining() > run.budget):
            deadline = Deadline.after(run.budget, clock=self.clock)
        key = env.idempotency_key
        ctx = make_context(
            deadline,
            env.priority,
            env.caller,
            env.operation,
            run.attempt,
            parent.idempotency_key if key is None else key,
            parent.in_progress,
            parent.started_at,
        )
        started = self.clock.now()
        token = set_current(ctx)
        try:
            result = handler(message)
        except self.passthrough:
            raise
        except Exception as error:
            passed = deadline is not None and deadline.remaining() <= 0.0
            return Outcome(self._failed(delivery, run, error, passed))
        finally:
            reset_current(token)
        latency = self.clock.now() - started
        self.broker.ack(delivery)
        self._emit(
            MessageCompleted, env, attempt=run.attempt, latency=latency, age=env.age(self.wall())
        )
        return Outcome(run, result)

    def _failed(
        self, delivery: Delivery, run: Run, error: BaseException, deadline_passed: bool
    ) -> RetryLater | Park:
        now = self.wall()
        decision = self.policy.after_failure(run, error, now, deadline_passed=deadline_passed)
        if isinstance(decision, Park):
            self._park(delivery, decision, run.attempt)
            return decision
        self.broker.retry_later(delivery, decision.envelope, decision.delay)
        self.broker.ack(delivery)
        self._emit(
            MessageRetried,
            run.envelope,
            attempt=decision.envelope.attempt,
            delay=decision.delay,
            cause=type(error).__name__,
            budget_exhausted=decision.budget_exhausted,
            deferred=False,
        )
        return decision

    def _park(self, delivery: Delivery, park: Park, attempt: int) -> None:
        envelope = park.envelope
        if envelope is not None:
            envelope = envelope.with_history(
                self.wall(), "parked", f"{park.reason.value}: {park.detail}"
            )
        self.broker.park(delivery, envelope, park.reason.value, park.detail)
        self.broker.ack(delivery)
        self._emit(
            MessageParked,
            park.envelope,
            reason=park.reason.value,
            detail=park.detail,
            attempt=attempt,
        )

    def _emit(self, kind: Any, envelope: Envelope | None, **fields: Any) -> None:
        if not self.events.enabled:
            return
        if envelope is None:
            operation, priority, caller = "unknown", Priority.CRITICAL, "unknown"
        else:
            operation, priority, caller = envelope.operation, envelope.priority, envelope.caller
        self.events.emit(kind(self.clock.now(), self.queue, operation, priority, caller, **fields))

    def __repr__(self) -> str:
        return f"SyncMessageRunner(queue={self.queue!r}, policy={self.policy!r})"
