"""The broker-independent halves of a producer and a consumer.

An adapter (aio-pika, redis-py) gives `MessageRunner` each delivery and a `MessageBroker`
that can acknowledge it, enqueue its next attempt and park it; it gives `Publisher` a send
function and a way to measure the backlog. Everything else is decided here, the same for
every broker: the envelope, the decision, the deadline, admission and the events.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, Protocol

from .._admission import Bulkhead
from .._clock import Clock, default_clock
from .._context import current
from .._errors import DeadlineExceeded, Reason, Rejected
from .._priority import Priority
from ..events import (
    EventHub,
    MessageCompleted,
    MessageParked,
    MessagePublished,
    MessageRefused,
    MessageRetried,
    MessageStarted,
    hub,
)
from .envelope import ENVELOPE_FIELDS, Envelope, EnvelopeError
from .policy import BacklogBound, MessagePolicy, Park, RetryLater, Run
from .scope import MessageScope, MessageSweeper

__all__ = [
    "Delivery",
    "Message",
    "MessageBroker",
    "MessageHandler",
    "MessageRunner",
    "Publisher",
]

WallClock = Callable[[], float]
_ENVELOPE_FIELDS = frozenset(ENVELOPE_FIELDS)


class Delivery(Protocol):
    """One message as a broker delivered it: what an adapter hands to `MessageRunner`."""

    @property
    def body(self) -> bytes: ...

    @property
    def headers(self) -> Mapping[str, Any]: ...

    @property
    def redeliveries(self) -> int:
        """How many times the broker delivered this copy before without an acknowledgement
        (a consumer died holding it); 0 for a first delivery."""
        ...


class MessageBroker(Protocol):
    """What a consumer adapter does on the broker's side. Each method returns only once the
    broker confirmed it (publisher confirms, a transaction): the runner acknowledges a
    delivery only after its retry or parked copy is stored, so nothing is lost."""

    async def ack(self, delivery: Any) -> None: ...

    async def retry_later(self, delivery: Any, envelope: Envelope, delay: float) -> None:
        """Store a copy of ``delivery`` with ``envelope``, to be delivered after ``delay``."""
        ...

    async def park(
        self, delivery: Any, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        """Store a copy of ``delivery`` in the parked queue with its reason."""
        ...


class Message:
    """What a handler gets: the body, the envelope, and the headers that are not brownout's."""

    __slots__ = ("_headers", "_raw", "attempt", "body", "delivery", "envelope")

    def __init__(
        self,
        body: bytes,
        envelope: Envelope,
        attempt: int,
        headers: Mapping[str, Any],
        delivery: Any,
    ) -> None:
        self.body = body
        self.envelope = envelope
        self.attempt = attempt
        """This delivery's attempt number (1 for the first); > 1 may be a duplicate."""
        self._raw = headers
        self._headers: dict[str, Any] | None = None
        self.delivery = delivery
        """The adapter's own delivery object (an aio-pika message, a stream entry)."""

    @property
    def headers(self) -> dict[str, Any]:
        """The message's headers that are not brownout's envelope (read on first use)."""
        headers = self._headers
        if headers is None:
            headers = self._headers = {
                k: v for k, v in self._raw.items() if k not in _ENVELOPE_FIELDS
            }
        return headers

    @property
    def idempotency_key(self) -> str | None:
        """The same on every attempt: deduplicate side effects by it."""
        return self.envelope.idempotency_key

    def __repr__(self) -> str:
        return f"Message(attempt={self.attempt}, key={self.idempotency_key!r})"


MessageHandler = Callable[[Message], Awaitable[None]]
_NO_TIME_LEFT = frozenset({Reason.DEADLINE_EXPIRED, Reason.DEADLINE_TOO_SHORT})


class MessageRunner:
    """Runs one queue's deliveries: read the envelope, decide (`MessagePolicy`), admit through
    ``bulkhead``, run ``handler`` inside brownout's request context with the message's
    remaining time (outbound calls carry the budget and are cancelled at the deadline), then
    acknowledge, retry later or park through ``broker``.

    A delivery the bulkhead refuses (the consumer is over its limit) is enqueued again after
    the refusal's ``retry_after`` without using an attempt. Only the broker's own failures
    (it cannot store a copy or acknowledge) escape `process`; the delivery is then left
    unacknowledged, so the broker delivers it again.
    """

    def __init__(
        self,
        handler: MessageHandler,
        broker: MessageBroker,
        *,
        queue: str,
        policy: MessagePolicy | None = None,
        bulkhead: Bulkhead | None = None,
        events: EventHub = hub,
        wall: WallClock = time.time,
        clock: Clock | None = None,
    ) -> None:
        self.handler = handler
        self.broker = broker
        self.queue = queue
        self.policy = policy if policy is not None else MessagePolicy()
        self.bulkhead = bulkhead
        self.events = events
        self.wall = wall
        self.clock = clock if clock is not None else default_clock()
        self._sweeper = MessageSweeper()

    async def process(self, delivery: Delivery) -> Run | RetryLater | Park:
        """Handle one delivery to the end; returns what was decided."""
        policy = self.policy
        now = self.wall()
        try:
            envelope = Envelope.decode(delivery.headers)
        except EnvelopeError as error:
            decision = policy.malformed(error, now)
        else:
            decision = policy.before(envelope, now, redeliveries=delivery.redeliveries)
        if isinstance(decision, Park):
            await self._park(
                delivery, decision, decision.envelope.attempt if decision.envelope else 1
            )
            return decision
        return await self._run(delivery, decision, now)

    async def _run(self, delivery: Delivery, run: Run, now: float) -> Run | RetryLater | Park:
        env = run.envelope
        message = Message(delivery.body, env, run.attempt, delivery.headers, delivery)
        events = self.events.enabled
        if events:
            self._emit(
                MessageStarted, env, attempt=run.attempt, age=env.age(now), remaining=run.budget
            )
        clock = self.clock
        started = clock.now()
        entered = False
        bulkhead = self.bulkhead
        scope = MessageScope()
        try:
            scope.enter(run.budget, env, run.attempt, self._sweeper)
            try:
                if bulkhead is None:
                    entered = True
                    await self.handler(message)
                else:
                    async with bulkhead.admit():
                        entered = True
                        await self.handler(message)
            except BaseException as error:
                scope.exit(error)  # the message's own deadline: DeadlineExceeded
                raise
            scope.exit(None)
        except Rejected as refused:
            if entered:
                return await self._failed(delivery, run, refused)
            if refused.reason in _NO_TIME_LEFT:
                return await self._failed(delivery, run, refused, deadline_passed=True)
            return await self._defer(delivery, run, refused)
        except DeadlineExceeded as error:
            return await self._failed(delivery, run, error, deadline_passed=True)
        except Exception as error:
            return await self._failed(delivery, run, error)
        latency = clock.now() - started
        await self.broker.ack(delivery)
        if self.events.enabled:
            self._emit(
                MessageCompleted,
                env,
                attempt=run.attempt,
                latency=latency,
                age=env.age(self.wall()),
            )
        return run

    async def _failed(
        self, delivery: Delivery, run: Run, error: BaseException, *, deadline_passed: bool = False
    ) -> RetryLater | Park:
        now = self.wall()
        decision = self.policy.after_failure(run, error, now, deadline_passed=deadline_passed)
        if isinstance(decision, Park):
            await self._park(delivery, decision, run.attempt)
        else:
            await self.broker.retry_later(delivery, decision.envelope, decision.delay)
            await self.broker.ack(delivery)
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

    async def _defer(self, delivery: Delivery, run: Run, refused: Rejected) -> RetryLater:
        now = self.wall()
        delay = refused.retry_after if refused.retry_after is not None else 0.1
        # not an attempt: keep the envelope's number (broker redeliveries included)
        envelope = replace(
            run.envelope.with_history(now, "deferred", str(refused)), attempt=run.attempt
        )
        decision = RetryLater(envelope, delay, str(refused))
        await self.broker.retry_later(delivery, envelope, delay)
        await self.broker.ack(delivery)
        self._emit(
            MessageRetried,
            run.envelope,
            attempt=run.attempt,
            delay=delay,
            cause=refused.reason.value,
            budget_exhausted=False,
            deferred=True,
        )
        return decision

    async def _park(self, delivery: Delivery, park: Park, attempt: int) -> None:
        now = self.wall()
        envelope = park.envelope
        if envelope is not None:
            envelope = envelope.with_history(now, "parked", f"{park.reason.value}: {park.detail}")
        await self.broker.park(delivery, envelope, park.reason.value, park.detail)
        await self.broker.ack(delivery)
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
        return f"MessageRunner(queue={self.queue!r}, policy={self.policy!r})"


BacklogMeasure = Callable[[], Awaitable[tuple[int | None, float | None]]]
"""Reads a queue's (depth, oldest message's age in seconds); ``None`` for what it cannot."""
Send = Callable[[bytes, dict[str, str]], Awaitable[None]]
"""Enqueues a body with headers and returns once the broker confirmed it."""


class Publisher:
    """The producer's half: stamp the envelope from the current request (remaining budget,
    priority, caller, idempotency key), refuse with `brownout.Rejected` (``backlog_full``)
    while the queue is over ``bound``, then ``send``.

    The backlog is measured at most once per ``refresh`` seconds, and concurrent publishes
    share one measurement, so the broker sees one extra query per period, not per message.
    A measurement that fails counts as unknown (not over the bound); the send then fails on
    its own if the broker is down.
    """

    def __init__(
        self,
        queue: str,
        send: Send,
        *,
        bound: BacklogBound | None = None,
        measure: BacklogMeasure | None = None,
        refresh: float = 1.0,
        ttl: float | None = None,
        events: EventHub = hub,
        wall: WallClock = time.time,
        clock: Clock | None = None,
    ) -> None:
        if bound is not None and measure is None:
            raise ValueError("a bound needs measure=, the way to read the queue's backlog")
        if not 0 <= refresh < math.inf:
            raise ValueError("refresh must be finite and >= 0")
        self.queue = queue
        self.send = send
        self.bound = bound
        self.measure = measure
        self.refresh = refresh
        self.ttl = ttl
        self.events = events
        self.wall = wall
        self.clock = clock if clock is not None else default_clock()
        self._reading: tuple[int | None, float | None] = (None, None)
        self._read_at = -math.inf
        self._reading_task: asyncio.Future[tuple[int | None, float | None]] | None = None

    async def backlog(self) -> tuple[int | None, float | None]:
        """The queue's (depth, oldest age), at most ``refresh`` seconds old."""
        now = self.clock.now()
        if now - self._read_at < self.refresh or self.measure is None:
            return self._reading
        task = self._reading_task
        if task is None:
            task = self._reading_task = asyncio.ensure_future(self._measure())
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._reading_task is task:
                self._reading_task = None

    async def _measure(self) -> tuple[int | None, float | None]:
        assert self.measure is not None
        try:
            reading = await self.measure()
        except Exception:  # an unreadable backlog is unknown; the send says if the broker is down
            reading = (None, None)
        self._reading = reading
        self._read_at = self.clock.now()
        return reading

    async def publish(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        idempotency_key: str | None = None,
        operation: str | None = None,
        priority: Priority | None = None,
    ) -> Envelope:
        """Enqueue ``body``; returns its envelope. Raises `brownout.Rejected`
        (``backlog_full``) when the queue is over its bound."""
        ctx = current()
        envelope = Envelope.stamp(
            self.wall(),
            ctx,
            ttl=ttl if ttl is not None else self.ttl,
            idempotency_key=idempotency_key,
            operation=operation,
        )
        if priority is not None:
            envelope = replace(envelope, priority=priority)
        if self.bound is not None:
            depth, age = await self.backlog()
            try:
                self.bound.check(depth, age, envelope.priority)
            except Rejected as refused:
                self._emit(MessageRefused, envelope, reason=refused.reason, detail=refused.detail)
                raise
        await self.send(body, {**(headers or {}), **envelope.encode()})
        valid_for = envelope.remaining(envelope.enqueued_at)
        self._emit(MessagePublished, envelope, valid_for=valid_for)
        return envelope

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """The last backlog reading, for `brownout.Stats.watch` (``backlog_depth``,
        ``backlog_oldest_age``; nothing before the first measurement)."""
        depth, age = self._reading
        labels = {"source": self.queue}
        if depth is not None:
            yield ("backlog_depth", labels, float(depth))
        if age is not None:
            yield ("backlog_oldest_age", labels, float(age))

    def _emit(self, kind: Any, envelope: Envelope, **fields: Any) -> None:
        if self.events.enabled:
            self.events.emit(
                kind(
                    self.clock.now(),
                    self.queue,
                    envelope.operation,
                    envelope.priority,
                    envelope.caller,
                    **fields,
                )
            )

    def __repr__(self) -> str:
        return f"Publisher(queue={self.queue!r}, bound={self.bound!r})"
