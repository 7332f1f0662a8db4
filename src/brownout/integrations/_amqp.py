"""What RabbitMQ adapters share: the queue layout (retry buckets, parked queue), confirmed
copies, and the core's `brownout.durable.MessageBroker` and `brownout.durable.Delivery` on
aio-pika. `brownout.integrations.aio_pika` and `brownout.integrations.faststream` (whose
deliveries are aio-pika's too) both use it, so their queues and parked messages are the same.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

try:
    import aio_pika
    import aiormq
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, DeliveryMode
except ModuleNotFoundError as _error:  # pragma: no cover - depends on the environment
    from .._extras import missing_extra

    raise missing_extra("brownout.integrations.aio_pika", "rabbitmq", _error) from _error

from .._durable import (
    ENVELOPE_FIELDS,
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    PARKED_FIELDS,
    Envelope,
    EnvelopeError,
    MessageRunner,
)
from .._errors import BrownoutError
from ..events import MessageRetried

__all__ = [
    "BROKER_HEADERS",
    "OWN_HEADERS",
    "PARK_ID_FIELD",
    "RETRY_DELAYS",
    "AmqpBroker",
    "AmqpDelivery",
    "NotConfirmed",
    "amqp_field",
    "check_confirms",
    "copy_message",
    "declare_side_queues",
    "headers_of",
    "parked_queue",
    "publish_confirmed",
    "restamp_redelivery",
    "retry_queue",
    "user_headers",
]

RETRY_DELAYS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
"""The retry queues' delays (seconds): a retry waits for the smallest one at least as long as
the policy's delay (the largest when longer)."""
PARK_ID_FIELD = "brownout-park-id"
"""The parked copy's id in ``<queue>.parked`` (RabbitMQ messages have no id of their own)."""

# broker-set headers a copy must not carry back (RabbitMQ adds them on dead-lettering)
BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-delivery-count",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
OWN_HEADERS = frozenset(ENVELOPE_FIELDS) | frozenset(PARKED_FIELDS) | {PARK_ID_FIELD}


class NotConfirmed(BrownoutError, RuntimeError):
    """RabbitMQ did not confirm a publish (nack, unroutable, or the channel closed): the
    message may not be stored."""

    def __init__(self, queue: str, detail: str) -> None:
        super().__init__(f"RabbitMQ did not confirm a message to {queue!r}: {detail}")
        self.queue = queue
        self.detail = detail


def retry_queue(queue: str, delay: float) -> tuple[str, float]:
    """The retry queue for ``delay`` seconds and its bucket's delay."""
    bucket = next((d for d in RETRY_DELAYS if d >= delay), RETRY_DELAYS[-1])
    return f"{queue}.retry.{round(bucket * 1000)}", bucket


def parked_queue(queue: str) -> str:
    """The name of ``queue``'s parked queue."""
    return f"{queue}.parked"


async def declare_side_queues(channel: AbstractChannel, queue: str) -> None:
    """Declare ``queue``'s retry queues and parked queue (not ``queue`` itself)."""
    for delay in RETRY_DELAYS:
        name, bucket = retry_queue(queue, delay)
        await channel.declare_queue(
            name,
            durable=True,
            arguments={
                "x-message-ttl": round(bucket * 1000),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
            },
        )
    await channel.declare_queue(parked_queue(queue), durable=True)


_NO_HEADERS: Mapping[str, Any] = MappingProxyType({})


def headers_of(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(raw) if raw else {}


def user_headers(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        k: v for k, v in headers_of(raw).items() if k not in OWN_HEADERS and k not in BROKER_HEADERS
    }


def amqp_field(value: Any) -> Any:
    """A header value as the AMQP encoder takes it (it refuses the ``bytes`` it decodes)."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {str(k): amqp_field(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [amqp_field(v) for v in value]
    return value


def copy_message(body: bytes, headers: dict[str, Any], like: Any = None) -> aio_pika.Message:
    return aio_pika.Message(
        body,
        headers={k: amqp_field(v) for k, v in headers.items()},
        delivery_mode=DeliveryMode.PERSISTENT,
        content_type=getattr(like, "content_type", None),
        content_encoding=getattr(like, "content_encoding", None),
        correlation_id=getattr(like, "correlation_id", None),
        message_id=getattr(like, "message_id", None),
        type=getattr(like, "type", None),
        app_id=getattr(like, "app_id", None),
    )


async def publish_confirmed(
    channel: AbstractChannel, queue: str, message: aio_pika.Message, wait: float | None
) -> None:
    """Publish to ``queue`` through the default exchange; return once confirmed."""
    try:
        result = await channel.default_exchange.publish(
            message, routing_key=queue, mandatory=True, timeout=wait
        )
    except aiormq.exceptions.DeliveryError as error:
        raise NotConfirmed(queue, f"nacked: {error}") from error
    except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError) as error:
        raise NotConfirmed(queue, f"{type(error).__name__}: {error}") from error
    except TimeoutError as error:
        raise NotConfirmed(queue, f"no confirm within {wait} s") from error
    if not isinstance(result, aiormq.spec.Basic.Ack):
        raise NotConfirmed(queue, "unroutable (does the queue exist? see declare())")


def check_confirms(channel: AbstractChannel) -> None:
    if getattr(channel, "publisher_confirms", True) is False:
        raise ValueError("the channel needs publisher confirms: channel(publisher_confirms=True)")


class AmqpDelivery:
    """An aio-pika delivery as the core's `brownout.durable.Delivery`."""

    __slots__ = ("headers", "message", "redeliveries")

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message
        self.headers: Mapping[str, Any] = message.headers or _NO_HEADERS  # read, never written
        count = self.headers.get("x-delivery-count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            self.redeliveries = count
        else:  # a classic queue: see restamp_redelivery
            self.redeliveries = 1 if message.redelivered else 0

    @property
    def body(self) -> bytes:
        return self.message.body


class AmqpBroker:
    """The core's `brownout.durable.MessageBroker` on one channel with confirms."""

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        timeout: float | None,
        wall: Callable[[], float],
    ) -> None:
        self.channel = channel
        self.queue = queue
        self.timeout = timeout
        self.wall = wall

    async def ack(self, delivery: AmqpDelivery) -> None:
        await delivery.message.ack()

    async def retry_later(self, delivery: AmqpDelivery, envelope: Envelope, delay: float) -> None:
        name, _ = retry_queue(self.queue, delay)
        headers = {**user_headers(delivery.headers), **envelope.encode()}
        await publish_confirmed(
            self.channel, name, copy_message(delivery.body, headers, delivery.message), self.timeout
        )

    async def park(
        self, delivery: AmqpDelivery, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        if envelope is not None:
            headers = {**user_headers(delivery.headers), **envelope.encode()}
        else:  # unreadable: keep what came, for whoever inspects it
            headers = {
                k: v
                for k, v in delivery.headers.items()
                if k not in PARKED_FIELDS and k not in BROKER_HEADERS
            }
        headers[PARK_REASON_FIELD] = reason
        headers[PARK_DETAIL_FIELD] = detail[:1000]
        headers[PARKED_AT_FIELD] = repr(self.wall())
        headers[PARK_ID_FIELD] = secrets.token_hex(8)
        message = copy_message(delivery.body, headers, delivery.message)
        await publish_confirmed(self.channel, parked_queue(self.queue), message, self.timeout)


async def restamp_redelivery(runner: MessageRunner, queue: str, delivery: AmqpDelivery) -> bool:
    """Count a classic queue's redelivery in the envelope: re-enqueue the message as its
    next attempt instead of running it. Its ``redelivered`` flag says "at least once
    before", never how often, so without this a message that kills every consumer
    would come back as the same attempt forever. False when there is nothing to count."""
    if "x-delivery-count" in delivery.headers or not delivery.message.redelivered:
        return False
    try:
        envelope = Envelope.decode(delivery.headers)
    except EnvelopeError:
        return False  # the runner parks it (or runs it, ``on_malformed="run"``)
    now = runner.wall()
    following = envelope.next_attempt(now, "redelivered", "its consumer stopped before the ack")
    await runner.broker.retry_later(delivery, following, 0.0)
    await runner.broker.ack(delivery)
    if runner.events.enabled:
        runner.events.emit(
            MessageRetried(
                runner.clock.now(),
                queue,
                envelope.operation,
                envelope.priority,
                envelope.caller,
                attempt=following.attempt,
                delay=0.0,
                cause="redelivered",
                budget_exhausted=False,
                deferred=False,
            )
        )
    return True
