"""Durable queues: the envelope, the decisions and the broker-independent producer and
consumer halves (standard library only; the broker adapters live in `integrations`)."""

from .envelope import ENVELOPE_FIELDS, Envelope, EnvelopeError, HistoryEntry
from .policy import BacklogBound, MessagePolicy, Park, ParkReason, RetryLater, Run, message_failure
from .runner import (
    Delivery,
    Message,
    MessageBroker,
    MessageHandler,
    MessageRunner,
    Publisher,
)

__all__ = [
    "ENVELOPE_FIELDS",
    "BacklogBound",
    "Delivery",
    "Envelope",
    "EnvelopeError",
    "HistoryEntry",
    "Message",
    "MessageBroker",
    "MessageHandler",
    "MessagePolicy",
    "MessageRunner",
    "Park",
    "ParkReason",
    "Publisher",
    "RetryLater",
    "Run",
    "message_failure",
]
