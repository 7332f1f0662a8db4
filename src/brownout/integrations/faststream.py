"""FastStream (RabbitMQ) middleware: brownout's durable-queue rules for FastStream apps.

::

    broker = RabbitBroker("amqp://guest:guest@127.0.0.1:5672/")
    broker.add_middleware(BrownoutMiddleware(broker, queues=["orders"], ttl=60))

    @broker.subscriber(RabbitQueue("orders", durable=True))
    async def handle(body: bytes) -> None: ...   # runs inside brownout's request context

On publish to one of ``queues`` the middleware stamps the envelope from the current request
context (`brownout.durable.Publisher`); on consume from one of them it hands the delivery to
a `brownout.durable.MessageRunner`, which decides: park it (expired, too old, out of
attempts, malformed), or run the FastStream handler with the message's remaining time, then
acknowledge, retry later or park. It only translates: the queue layout, the confirmed
copies and the redelivery counting are those of `brownout.integrations.aio_pika`, so
`brownout.integrations.aio_pika.ParkedQueue` and ``brownout queue`` work on its parked
messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

try:
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
    from faststream import BaseMiddleware, ContextRepo, PublishCommand, PublishType, StreamMessage
    from faststream.rabbit import RabbitBroker
except ModuleNotFoundError as _error:  # pragma: no cover - depends on the environment
    from .._extras import missing_extra

    raise missing_extra(__name__, "faststream", _error) from _error

from .._admission import Bulkhead
from .._clock import Clock, default_clock
from .._durable import Message, MessagePolicy, MessageRunner, Publisher
from .._durable.envelope import ENQUEUED_AT_FIELD
from ..events import EventHub, hub
from ._amqp import AmqpBroker, AmqpDelivery, declare_side_queues, restamp_redelivery

__all__ = ["BrownoutMiddleware"]

_Next = Callable[[Any], Awaitable[Any]]


class _FastStreamDelivery(AmqpDelivery):
    """An aio-pika delivery with the FastStream call that runs its handler."""

    __slots__ = ("call_next", "result", "stream_message")

    def __init__(
        self, raw: AbstractIncomingMessage, stream_message: StreamMessage[Any], call_next: _Next
    ) -> None:
        super().__init__(raw)
        self.stream_message = stream_message
        self.call_next = call_next
        self.result: Any = None


async def _run_handler(message: Message) -> None:
    delivery: _FastStreamDelivery = message.delivery
    delivery.result = await delivery.call_next(delivery.stream_message)


class BrownoutMiddleware:
    """A FastStream broker middleware (give it to ``broker.add_middleware``) for the RabbitMQ
    queues named in ``queues``; messages of other queues pass through untouched.

    - **publish** to one of ``queues``: the envelope is stamped from the current request
      context (remaining budget, or ``ttl`` when shorter; priority, caller, idempotency key)
      and a `brownout.events.MessagePublished` emitted. A publish that already carries an
      envelope (a copy brownout re-enqueues) keeps it.
    - **consume** from one of ``queues``: `brownout.durable.MessageRunner` with ``policy``
      and ``bulkhead`` decides; the handler runs inside brownout's request context with the
      message's remaining time. The delivery is acknowledged only after success or after its
      retry or parked copy is confirmed, on a channel of its own that the middleware opens on
      ``broker``'s connection (publisher confirms, ``timeout`` seconds each). It declares
      ``<queue>.retry.<ms>`` and ``<queue>.parked`` on first use; FastStream declares
      ``<queue>`` itself. If a copy cannot be stored the delivery is returned to the queue.

    Keep the subscriber's prefetch (``RabbitQueue``'s channel ``prefetch_count``) at the
    bulkhead's limit, and FastStream's default ``ack_policy``: the middleware acknowledges.
    """

    def __init__(
        self,
        broker: RabbitBroker,
        *,
        queues: Collection[str],
        policy: MessagePolicy | None = None,
        bulkhead: Bulkhead | None = None,
        ttl: float | None = None,
        timeout: float | None = 10.0,
        events: EventHub = hub,
        wall: Callable[[], float] = time.time,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(queues, str):
            raise TypeError("queues must be a collection of queue names, not one string")
        self.broker = broker
        self.queues = frozenset(queues)
        self.policy = policy if policy is not None else MessagePolicy()
        self.bulkhead = bulkhead
        self.ttl = ttl
        self.timeout = timeout
        self.events = events
        self.wall = wall
        self.clock = clock if clock is not None else default_clock()
        self._channel: AbstractChannel | None = None
        self._opening: asyncio.Lock | None = None
        self._runners: dict[str, MessageRunner] = {}

    def __call__(self, msg: Any, /, *, context: ContextRepo) -> BaseMiddleware:
        """FastStream's middleware factory protocol: one scope per message or publish."""
        return _Scope(msg, context=context, owner=self)

    async def _runner(self, queue: str) -> MessageRunner:
        channel = self._channel
        if channel is None or channel.is_closed:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                channel = self._channel
                if channel is None or channel.is_closed:
                    connection = await self.broker.connect()
                    if not hasattr(connection, "channel"):
                        raise RuntimeError(
                            "BrownoutMiddleware needs a RabbitBroker connected to RabbitMQ, "
                            "where it stores retry and parked copies; FastStream's "
                            "TestRabbitBroker has no connection: test against a real broker"
                        )
                    channel = await connection.channel()  # confirms: aio-pika's default
                    self._channel = channel
                    self._runners.clear()  # their brokers hold the closed channel
        runner = self._runners.get(queue)
        if runner is None:
            await declare_side_queues(channel, queue)
            runner = self._runners[queue] = MessageRunner(
                _run_handler,
                AmqpBroker(channel, queue, self.timeout, self.wall),
                queue=queue,
                policy=self.policy,
                bulkhead=self.bulkhead,
                events=self.events,
                wall=self.wall,
                clock=self.clock,
            )
        return runner

    async def close(self) -> None:
        """Close the middleware's channel (the broker's connection stays open)."""
        channel, self._channel = self._channel, None
        self._runners.clear()
        if channel is not None and not channel.is_closed:
            await channel.close()

    def __repr__(self) -> str:
        return f"BrownoutMiddleware(queues={sorted(self.queues)!r}, policy={self.policy!r})"


def _subscriber_queue(context: ContextRepo) -> str | None:
    handler = context.get_local("handler_")
    name = getattr(getattr(handler, "queue", None), "name", None)
    return name if isinstance(name, str) else None


class _Scope(BaseMiddleware):
    """One message's or one publish's pass through the middleware."""

    def __init__(self, msg: Any, /, *, context: ContextRepo, owner: BrownoutMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(self, call_next: _Next, msg: StreamMessage[Any]) -> Any:
        queue = _subscriber_queue(self.context)
        raw = msg.raw_message
        if queue not in self.owner.queues or not isinstance(raw, AbstractIncomingMessage):
            return await call_next(msg)
        assert queue is not None
        delivery = _FastStreamDelivery(raw, msg, call_next)
        try:
            runner = await self.owner._runner(queue)
            if not await restamp_redelivery(runner, queue, delivery):
                await runner.process(delivery)
        except BaseException:
            # the broker failed (or we were cancelled): RabbitMQ delivers the message again
            with contextlib.suppress(Exception):
                await raw.nack(requeue=True)
            raise
        return delivery.result

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        if (
            not isinstance(cmd, PublishCommand)
            or cmd.publish_type is not PublishType.PUBLISH
            or cmd.destination not in self.owner.queues
            or ENQUEUED_AT_FIELD in cmd.headers
        ):
            return await call_next(cmd)
        owner = self.owner
        result: Any = None

        async def send(_body: bytes, headers: dict[str, str]) -> None:
            nonlocal result
            cmd.add_headers(headers, override=True)
            result = await call_next(cmd)

        # the body stays in ``cmd`` (FastStream serializes it later); the core only stamps
        publisher = Publisher(
            cmd.destination,
            send,
            ttl=owner.ttl,
            events=owner.events,
            wall=owner.wall,
            clock=owner.clock,
        )
        await publisher.publish(b"")
        return result
