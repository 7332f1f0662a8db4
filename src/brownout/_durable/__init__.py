"""Durable queues: the envelope, the decisions and the broker-independent producer and
consumer halves (standard library only; the broker adapters live in `integrations`)."""

from .backlog import BacklogMonitor
from .envelope import ENVELOPE_FIELDS, Envelope, EnvelopeError, HistoryEntry
from .parked import (
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    PARKED_FIELDS,
    ParkedMessage,
)
from .policy import BacklogBound, MessagePolicy, Park, ParkReason, RetryLater, Run, message_failure
from .runner import (
    Delivery,
    Message,
    MessageBroker,
    MessageHandler,
    MessageRunner,
    Publisher,
)
from .sync_runner import Outcome, SyncHandler, SyncMessageBroker, SyncMessageRunner

__all__ = [
    "ENVELOPE_FIELDS",
    "PARKED_AT_FIELD",
    "PARKED_FIELDS",
    "PARK_DETAIL_FIELD",
    "PARK_REASON_FIELD",
    "BacklogBound",
    "BacklogMonitor",
    "Delivery",
    "Envelope",
    "EnvelopeError",
    "HistoryEntry",
    "Message",
    "MessageBroker",
    "MessageHandler",
    "MessagePolicy",
    "MessageRunner",
    "Outcome",
    "Park",
    "ParkReason",
    "ParkedMessage",
    "Publisher",
    "RetryLater",
    "Run",
    "SyncHandler",
    "SyncMessageBroker",
    "SyncMessageRunner",
    "message_failure",
]
