"""RabbitMQ adapter on aio-pika: durable queues without hidden load (issue 26).

::

    await declare(channel, "orders")            # orders, orders.retry.<ms>, orders.parked
    producer = Producer(channel, "orders", bound=BacklogBound(max_depth=10_000), ttl=30)
    await producer.publish(b"...")              # Rejected(backlog_full) over the bound

    consumer = Consumer(channel, "orders", handle, policy=MessagePolicy(max_attempts=5),
                        bulkhead=Bulkhead(FixedLimit(8)))
    await consumer.run()                        # until consumer.stop()

This module only translates between aio-pika and the broker-independent core
(`brownout.durable`): `Producer` drives a `brownout.durable.Publisher`, `Consumer` a
`brownout.durable.MessageRunner`; every decision (run, retry later, park, refuse) is made
there and is a typed event.

What RabbitMQ gives and how it is used:

- every message is persistent (delivery mode 2) and published with publisher confirms: a
  publish returns once the broker confirmed it; a nack, an unroutable message or a closed
  channel raises `NotConfirmed`;
- the backlog's depth comes from a passive queue declare (``message_count``: ready messages,
  not the unacknowledged ones). RabbitMQ has no cheap, side-effect-free way to read the
  oldest message's age (a ``basic.get`` + requeue marks it redelivered), so the age is
  unknown (``None``) and a `brownout.durable.BacklogBound` ``max_age`` never refuses here;
  bound the depth, and let the consumer's ``max_age`` park what got too old;
- a retry is a copy in one of the retry queues ``<queue>.retry.<ms>``, one per delay
  bucket (`RETRY_DELAYS`), each with a queue TTL and ``<queue>`` as its dead-letter route: a
  copy comes back to ``<queue>`` after its bucket's delay (the policy's delay rounded up to
  a bucket, so every queue holds one TTL and nothing waits behind a longer one);
- a parked message is a copy in ``<queue>.parked`` with its body, envelope, the user's
  headers, ``brownout-park-reason``, ``brownout-park-detail`` and ``brownout-parked-at``;
- the original delivery is acknowledged only after its retry or parked copy is confirmed,
  so a consumer that dies at any point loses nothing (RabbitMQ redelivers what it held);
- redeliveries: a quorum queue's ``x-delivery-count`` header counts them. A classic queue
  only flags a message ``redelivered`` (at least once, not how often), so the consumer
  re-enqueues such a message as its next attempt (a confirmed copy, then the ack; event
  `brownout.events.MessageRetried` with cause ``redelivered``) instead of running it: a
  message that kills every consumer reaches ``max_attempts`` and is parked;
- prefetch follows the bulkhead's limit. RabbitMQ applies ``basic.qos`` only to consumers
  started after it, so when an adaptive limit moves the consumer re-subscribes with the new
  prefetch (at most once per ``follow_every`` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    import aio_pika
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
except ModuleNotFoundError as _error:  # pragma: no cover - depends on the environment
    from .._extras import missing_extra

    raise missing_extra(__name__, "rabbitmq", _error) from _error

from .._admission import Bulkhead
from .._clock import Clock
from .._durable import (
    BacklogBound,
    Envelope,
    MessageHandler,
    MessagePolicy,
    MessageRunner,
    ParkedMessage,
    Publisher,
)
from .._priority import Priority
from ..events import EventHub, hub
from ._amqp import BROKER_HEADERS as _BROKER_HEADERS
from ._amqp import PARK_ID_FIELD, RETRY_DELAYS, NotConfirmed, parked_queue, retry_queue
from ._amqp import AmqpBroker as _Broker
from ._amqp import AmqpDelivery as _Delivery
from ._amqp import check_confirms as _check_confirms
from ._amqp import copy_message as _copy
from ._amqp import declare_side_queues as _declare_side_queues
from ._amqp import headers_of as _headers
from ._amqp import publish_confirmed as _publish
from ._amqp import restamp_redelivery as _restamp
from ._amqp import user_headers as _user_headers

__all__ = [
    "PARK_ID_FIELD",
    "RETRY_DELAYS",
    "Consumer",
    "NotConfirmed",
    "ParkedQueue",
    "Producer",
    "declare",
    "parked_queue",
    "retry_queue",
]


async def declare(channel: AbstractChannel, queue: str, *, quorum: bool = False) -> None:
    """Declare ``queue``, its retry queues and ``<queue>.parked``, durable; idempotent.

    ``quorum=True`` makes ``queue`` a quorum queue (its ``x-delivery-count`` counts
    redeliveries exactly). Declaring an existing queue with other arguments is RabbitMQ's
    ``PRECONDITION_FAILED``, raised as it comes.
    """
    main_args: dict[str, Any] = {"x-queue-type": "quorum"} if quorum else {}
    await channel.declare_queue(queue, durable=True, arguments=main_args)
    await _declare_side_queues(channel, queue)


class Producer:
    """Publishes to ``queue`` (declared with `declare`) through a `brownout.durable.Publisher`:
    the envelope stamped from the current request, refused with `brownout.Rejected`
    (``backlog_full``) while the queue holds ``bound.max_depth`` ready messages or more
    (read at most once per ``refresh`` seconds), persistent and confirmed.

    ``channel`` must have publisher confirms (aio-pika's default). ``ttl``: the messages'
    deadline when the request has none shorter. ``timeout``: how long to wait for a confirm.
    """

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        *,
        bound: BacklogBound | None = None,
        ttl: float | None = None,
        refresh: float = 1.0,
        timeout: float | None = 10.0,
        events: EventHub = hub,
        clock: Clock | None = None,
    ) -> None:
        _check_confirms(channel)
        self.channel = channel
        self.queue = queue
        self.timeout = timeout
        self.publisher = Publisher(
            queue,
            self._send,
            bound=bound,
            measure=self.backlog if bound is not None else None,
            refresh=refresh,
            ttl=ttl,
            events=events,
            clock=clock,
        )

    async def backlog(self) -> tuple[int | None, float | None]:
        """(ready messages, ``None``): RabbitMQ cannot tell the oldest age cheaply."""
        declared = await self.channel.declare_queue(self.queue, passive=True)
        count = declared.declaration_result.message_count
        return (count if isinstance(count, int) else None), None

    async def _send(self, body: bytes, headers: dict[str, str]) -> None:
        message = _copy(body, dict(headers))
        await _publish(self.channel, self.queue, message, self.timeout)

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
        """Publish ``body``; returns its envelope once RabbitMQ confirmed it. Raises
        `brownout.Rejected` over the bound, `NotConfirmed` when the broker did not store it."""
        return await self.publisher.publish(
            body,
            headers=headers,
            ttl=ttl,
            idempotency_key=idempotency_key,
            operation=operation,
            priority=priority,
        )

    def __repr__(self) -> str:
        return f"Producer(queue={self.queue!r}, bound={self.publisher.bound!r})"


_RUNNING, _QUEUED, _SETTLED = 0, 1, 2
_MAX_HELD = 4096  # settled tags kept above a stuck floor; beyond, acks go one by one


class _Acks:
    """A consumer channel's acknowledgements, sent together: the acks of one loop turn that
    continue an unbroken run of settled delivery tags go as one ``basic.ack`` with
    ``multiple=True``; the others one by one.

    ``multiple=True`` acknowledges every unacknowledged tag up to its own on the channel, so
    it is sent only up to a tag when every earlier tag (from 1, the channel's first) was
    delivered to this consumer and is settled or in the same batch; a tag this consumer never
    saw (a ``basic.get`` on the channel) breaks the run for good, and its acks then go one by
    one. A reopened channel (robust reconnect) numbers from 1 again: the run restarts.
    """

    __slots__ = ("channel", "failed", "floor", "flushing", "held", "waiting")

    def __init__(self) -> None:
        self.channel: Any = None
        """The aiormq channel the tags below belong to."""
        self.floor = 0
        """Every tag up to this one is settled."""
        self.held: dict[int, int] = {}
        """Tags above ``floor`` delivered to this consumer: running, queued or settled."""
        self.waiting: list[tuple[Any, int]] = []
        self.flushing: asyncio.Task[None] | None = None
        self.failed = 0
        """Acknowledgements the channel refused (closed): those messages come back."""

    def delivered(self, message: AbstractIncomingMessage) -> None:
        channel = message.channel
        if channel is not self.channel:
            self.channel = channel
            self.floor = 0
            self.held = {}
        tag = message.delivery_tag
        if tag is not None:
            self.held[tag] = _RUNNING

    def release(self, message: AbstractIncomingMessage) -> bool:
        """Settle ``message`` otherwise than by an ack (the caller nacks it). False when its
        ack is already queued or sent: it must not be settled twice."""
        tag = message.delivery_tag
        state = self.held.get(tag, _RUNNING) if tag is not None else _RUNNING
        if state != _RUNNING:
            return False
        if tag is not None and tag in self.held:
            self.held[tag] = _SETTLED
        return True

    def ack(self, message: AbstractIncomingMessage) -> None:
        """Queue the ack of ``message``: it leaves with this loop turn's batch. (``basic.ack``
        has no answer to wait for; one that cannot be sent leaves the message unacknowledged,
        and RabbitMQ delivers it again.)"""
        channel = message.channel
        tag = message.delivery_tag
        if tag is None:  # (a delivery to a no-ack consumer: nothing to acknowledge)
            return
        if channel is self.channel and tag in self.held:
            self.held[tag] = _QUEUED
        self.waiting.append((channel, tag))
        if self.flushing is None:
            self.flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self.waiting:
                await asyncio.sleep(0)  # acknowledgements of this loop turn join the batch
                batch, self.waiting = self.waiting, []
                held, floor, top = self.held, self.floor, 0
                while True:
                    state = held.get(floor + 1)
                    if state is None or state == _RUNNING:
                        break
                    floor += 1
                    del held[floor]
                    if state == _QUEUED:
                        top = floor
                self.floor = floor
                if len(held) > _MAX_HELD:
                    self.held = held = {t: v for t, v in held.items() if v != _SETTLED}
                if top:
                    await self._send(self.channel, top, True, top)
                for channel, tag in batch:
                    if channel is not self.channel or tag > top:
                        await self._send(channel, tag, False, 1)
                        if channel is self.channel and tag in held:
                            held[tag] = _SETTLED
        finally:
            self.flushing = None

    async def _send(self, channel: Any, tag: int, multiple: bool, count: int) -> None:
        try:
            await channel.basic_ack(tag, multiple=multiple)
        except Exception:  # the channel closed: RabbitMQ delivers those messages again
            self.failed += count

    async def drain(self) -> None:
        """Wait until the queued acknowledgements are sent."""
        while self.flushing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.flushing)


class _AckingBroker(_Broker):
    """`AmqpBroker` whose acknowledgements are queued and sent together (see `_Acks`)."""

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        timeout: float | None,
        wall: Callable[[], float],
    ) -> None:
        super().__init__(channel, queue, timeout, wall)
        self.acks = _Acks()

    async def ack(self, delivery: _Delivery) -> None:
        """Queued, and sent with the other acks of this loop turn (see `_Acks`)."""
        self.acks.ack(delivery.message)


class Consumer:
    """Consumes ``queue`` (declared with `declare`) through a `brownout.durable.MessageRunner`:
    each delivery is run, retried later or parked by ``policy``, admitted through
    ``bulkhead``, and acknowledged only after success or a confirmed copy.

    Prefetch: ``bulkhead.limit`` (``prefetch`` without a bulkhead, default 16). An adaptive
    limit is read after each delivery; when it moved, the consumer re-subscribes with the new
    prefetch, at most once per ``follow_every`` seconds.

    `stop` stops consuming, waits up to ``stop_timeout`` seconds for running handlers, then
    cancels the rest and returns their deliveries to the queue (they count as redelivered).
    ``channel`` must have publisher confirms and should be this consumer's own.
    """

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        handler: MessageHandler,
        *,
        policy: MessagePolicy | None = None,
        bulkhead: Bulkhead | None = None,
        prefetch: int = 16,
        follow_every: float = 1.0,
        stop_timeout: float = 10.0,
        timeout: float | None = 10.0,
        events: EventHub = hub,
        wall: Callable[[], float] = time.time,
        clock: Clock | None = None,
    ) -> None:
        _check_confirms(channel)
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        if not 0 <= stop_timeout < math.inf or not 0 <= follow_every < math.inf:
            raise ValueError("stop_timeout and follow_every must be finite and >= 0")
        self.channel = channel
        self.queue = queue
        self.bulkhead = bulkhead
        self.follow_every = follow_every
        self.stop_timeout = stop_timeout
        self._fixed_prefetch = prefetch
        broker = _AckingBroker(channel, queue, timeout, wall)
        self._acks = broker.acks
        self.runner = MessageRunner(
            handler,
            broker,
            queue=queue,
            policy=policy,
            bulkhead=bulkhead,
            events=events,
            wall=wall,
            clock=clock,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping: asyncio.Event | None = None
        self._started = False
        self._queue: AbstractQueue | None = None
        self._tag: str | None = None
        self._prefetch = 0
        self._followed_at = -math.inf
        self._following: asyncio.Task[None] | None = None
        self._failures = 0

    @property
    def failures(self) -> int:
        """Deliveries left unacknowledged because the broker failed (they come back)."""
        return self._failures + self._acks.failed

    @property
    def prefetch(self) -> int:
        """The prefetch the consumer subscribed with."""
        return self._prefetch

    def _wanted(self) -> int:
        return self.bulkhead.limit if self.bulkhead is not None else self._fixed_prefetch

    async def _subscribe(self) -> None:
        assert self._queue is not None
        wanted = max(1, self._wanted())
        await self.channel.set_qos(prefetch_count=wanted)
        tag = await self._queue.consume(self._on_message)
        old, self._tag, self._prefetch = self._tag, tag, wanted
        self._followed_at = time.monotonic()
        if old is not None:
            await self._queue.cancel(old)

    async def run(self) -> None:
        """Consume until `stop`; returns once no handler is running. Raises
        `ConnectionError` when the channel closes under it (a robust channel reopens itself
        and keeps consuming instead)."""
        if self._started:
            raise RuntimeError("a Consumer runs once")
        self._started = True
        if self._stopping is None:
            self._stopping = asyncio.Event()
        stopping = self._stopping
        closed: list[BaseException | None] = []

        def on_close(_: Any, error: BaseException | None) -> None:
            if not isinstance(self.channel, aio_pika.RobustChannel):
                closed.append(error)
                stopping.set()

        self.channel.close_callbacks.add(on_close)
        try:
            self._queue = await self.channel.declare_queue(self.queue, passive=True)
            await self._subscribe()
            await stopping.wait()
        finally:
            self.channel.close_callbacks.discard(on_close)
            await self._drain()
        if closed:
            raise ConnectionError(
                f"the channel of Consumer({self.queue!r}) closed: {closed[0]!r}"
            ) from closed[0]

    async def stop(self) -> None:
        """Stop consuming and let `run` finish (running handlers get ``stop_timeout``)."""
        if self._stopping is None:
            self._stopping = asyncio.Event()
        self._stopping.set()

    async def _drain(self) -> None:
        if self._following is not None:
            self._following.cancel()
            with contextlib.suppress(BaseException):
                await self._following
        if self._queue is not None and self._tag is not None and not self.channel.is_closed:
            with contextlib.suppress(Exception):
                await self._queue.cancel(self._tag)
        self._tag = None
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.stop_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await self._acks.drain()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if self._stopping is not None and self._stopping.is_set() and self._tag is None:
            with contextlib.suppress(Exception):
                self._acks.delivered(message)
                self._acks.release(message)
            await message.nack(requeue=True)  # arrived after stop: not ours to run
            return
        if (
            self.bulkhead is not None
            and self.bulkhead.limit != self._prefetch
            and self._following is None
            and time.monotonic() - self._followed_at >= self.follow_every
        ):
            self._following = asyncio.ensure_future(self._follow())
        task = asyncio.current_task()  # aio-pika runs each delivery in a task of its own
        if task is not None:
            self._tasks.add(task)
        try:
            await self._process(message)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _follow(self) -> None:
        try:
            if self._stopping is not None and not self._stopping.is_set():
                await self._subscribe()
        except Exception:  # a failed re-subscribe keeps the old consumer and its prefetch
            self._followed_at = time.monotonic()
        finally:
            self._following = None

    async def _restamp(self, delivery: _Delivery) -> bool:
        return await _restamp(self.runner, self.queue, delivery)

    async def _process(self, message: AbstractIncomingMessage) -> None:
        try:
            self._acks.delivered(message)
            delivery = _Delivery(message)
            if not await self._restamp(delivery):
                await self.runner.process(delivery)
        except asyncio.CancelledError:
            if self._acks.release(message):  # not when its ack is already on its way
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
            raise
        except Exception:  # the broker failed: left unacknowledged, RabbitMQ delivers it again
            self._failures += 1

    def __repr__(self) -> str:
        return f"Consumer(queue={self.queue!r}, prefetch={self._prefetch})"


class ParkedQueue:
    """The parked messages of ``queue`` (``<queue>.parked``): list, show, replay, purge.

    RabbitMQ can only read a queue by taking messages from it, so each method takes them
    with ``basic.get``, holds them unacknowledged while it works, and returns the ones it
    keeps with a nack-requeue (they stay in their place; their ``redelivered`` flag is set,
    which nothing reads here). A method looks at no more than ``scan_limit`` messages, so
    memory stays bounded; a larger parked queue is seen through its first ``scan_limit``.
    ``replay(None)`` leaves alone a message parked after it started (one of its own replays
    parked again), so it never replays one twice.
    ``channel`` should be this object's own (confirms on): its unacknowledged messages are
    the ones held. Operations on one `ParkedQueue` run one at a time.
    """

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        *,
        scan_limit: int = 10_000,
        timeout: float | None = 10.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        _check_confirms(channel)
        if scan_limit < 1:
            raise ValueError("scan_limit must be >= 1")
        self.channel = channel
        self.queue = queue
        self.name = parked_queue(queue)
        self.scan_limit = scan_limit
        self.timeout = timeout
        self.wall = wall
        self._lock = asyncio.Lock()

    @staticmethod
    def _read(message: AbstractIncomingMessage) -> ParkedMessage:
        headers = _headers(message.headers)
        raw_id = headers.get(PARK_ID_FIELD)
        if isinstance(raw_id, bytes):
            raw_id = raw_id.decode("utf-8", "replace")
        ident = raw_id if isinstance(raw_id, str) and raw_id else f"tag-{message.delivery_tag}"
        kept = {k: v for k, v in headers.items() if k != PARK_ID_FIELD and k not in _BROKER_HEADERS}
        return ParkedMessage.from_headers(ident, message.body, kept)

    async def _scan(self, limit: int) -> tuple[AbstractQueue, list[AbstractIncomingMessage]]:
        """Take up to ``limit`` messages, until the queue is empty. (Not bounded by a passive
        declare's ``message_count``: right after a nack-requeue it lags behind.)"""
        queue = await self.channel.declare_queue(self.name, passive=True)
        taken: list[AbstractIncomingMessage] = []
        while len(taken) < limit:
            message = await queue.get(no_ack=False, fail=False, timeout=self.timeout)
            if message is None:
                break
            taken.append(message)
        return queue, taken

    @staticmethod
    async def _give_back(messages: Sequence[AbstractIncomingMessage]) -> None:
        for message in messages:
            await message.nack(requeue=True)

    async def list(self, limit: int = 100, reason: str | None = None) -> list[ParkedMessage]:
        """Up to ``limit`` parked messages, oldest first, only ``reason`` ones when given."""
        async with self._lock:
            _, taken = await self._scan(self.scan_limit)
            try:
                found = [self._read(m) for m in taken]
            finally:
                await self._give_back(taken)
        return [p for p in found if reason is None or p.reason == reason][: max(0, limit)]

    async def get(self, id: str) -> ParkedMessage | None:
        """The parked message ``id``, or ``None``."""
        async with self._lock:
            _, taken = await self._scan(self.scan_limit)
            try:
                return next((p for p in map(self._read, taken) if p.id == id), None)
            finally:
                await self._give_back(taken)

    async def replay(self, ids: Sequence[str] | None, *, ttl: float | None) -> int:
        """Publish the parked messages ``ids`` (``None``: all) to the main queue again with a
        fresh envelope (enqueued now, valid for ``ttl`` seconds, attempt 1, same idempotency
        key, history kept plus ``replayed``); returns how many. Each is removed from the
        parked queue only after its new copy is confirmed."""
        if ttl is not None and not 0 < ttl < math.inf:
            raise ValueError("ttl must be None or positive and finite")
        return await self._each(ids, self._replay_one, ttl)

    async def purge(self, ids: Sequence[str] | None) -> int:
        """Delete the parked messages ``ids`` (``None``: all); returns how many."""
        if ids is None:
            async with self._lock:
                queue = await self.channel.declare_queue(self.name, passive=True)
                done = await queue.purge()
                return int(done.message_count or 0)
        return await self._each(ids, None, None)

    async def _each(self, ids: Sequence[str] | None, action: Any, ttl: float | None) -> int:
        wanted = None if ids is None else set(ids)
        count = 0
        started = self.wall()
        async with self._lock:
            _, taken = await self._scan(self.scan_limit)
            keep: list[AbstractIncomingMessage] = []
            try:
                while taken:
                    message = taken.pop(0)
                    parked = self._read(message)
                    if wanted is not None and parked.id not in wanted:
                        keep.append(message)
                        continue
                    if wanted is None and (parked.parked_at or 0.0) >= started:
                        keep.append(message)  # parked again while this runs: not twice
                        continue
                    if action is not None:
                        await action(parked, message, ttl)
                    await message.ack()
                    count += 1
            finally:
                await self._give_back(keep + taken)
        return count

    async def _replay_one(
        self, parked: ParkedMessage, message: AbstractIncomingMessage, ttl: float | None
    ) -> None:
        fresh = parked.replay_envelope(self.wall(), ttl)
        headers = {**_user_headers(message.headers), **fresh.encode()}  # values as they were
        await _publish(self.channel, self.queue, _copy(parked.body, headers, message), self.timeout)

    def __repr__(self) -> str:
        return f"ParkedQueue({self.name!r})"
