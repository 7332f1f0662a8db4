"""Durable queues without hidden load: bounded, aged and parked work (issue 26's core).

A producer stamps each message with an `Envelope` (enqueued-at, valid-until, attempt,
idempotency key, priority, caller) and is refused (`brownout.Rejected`, ``backlog_full``)
while the queue is over its `BacklogBound`. A consumer runs a message only while it can
still be useful (`MessagePolicy`), inside brownout's request context with the message's
remaining time, retries transient failures later under a retry budget, and parks the rest
with a `ParkReason`, never dropping it. The broker adapters (`brownout.integrations.aio_pika`,
`brownout.integrations.redis_streams`) only translate; `MessageRunner` and `Publisher` are the
broker-independent halves they drive.
"""

from ._durable import (
    ENVELOPE_FIELDS,
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    PARKED_FIELDS,
    BacklogBound,
    BacklogMonitor,
    Delivery,
    Envelope,
    EnvelopeError,
    HistoryEntry,
    Message,
    MessageBroker,
    MessageHandler,
    MessagePolicy,
    MessageRunner,
    Outcome,
    Park,
    ParkedMessage,
    ParkReason,
    Publisher,
    RetryLater,
    Run,
    SyncHandler,
    SyncMessageBroker,
    SyncMessageRunner,
    message_failure,
)

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
