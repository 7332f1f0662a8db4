"""A parked message as the tools that work with parking see it, whatever the broker.

Each adapter's parked store (a parked queue on RabbitMQ, a parked stream on Redis) keeps the
body, the envelope headers, the user's headers and three fields of its own: why, what
happened, and when (wall clock). `ParkedMessage.from_headers` reads them back the same way
for every broker, leniently: a parked message is there to be inspected, so an unreadable
envelope is ``None``, not an error.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._priority import Priority
from .envelope import ENVELOPE_FIELDS, Envelope, EnvelopeError

__all__ = [
    "PARKED_AT_FIELD",
    "PARKED_FIELDS",
    "PARK_DETAIL_FIELD",
    "PARK_REASON_FIELD",
    "ParkedMessage",
]

PARK_REASON_FIELD = "brownout-park-reason"
"""A `ParkReason` value (``expired``, ``too_old``, ``attempts``, ``failed``, ``malformed``)."""
PARK_DETAIL_FIELD = "brownout-park-detail"
"""What happened, for a human (the error, how late)."""
PARKED_AT_FIELD = "brownout-parked-at"
"""Wall-clock time (Unix seconds) the message was parked."""
PARKED_FIELDS = (PARK_REASON_FIELD, PARK_DETAIL_FIELD, PARKED_AT_FIELD)


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """One parked message: what `list` and `get` of a parked store return."""

    id: str
    """The broker's id for it in the parked store (a stream entry id, a message id)."""
    body: bytes
    envelope: Envelope | None
    """``None`` when the envelope is missing or unreadable (parked as ``malformed``)."""
    reason: str
    detail: str
    headers: Mapping[str, str] = field(default_factory=dict)
    """The message's own headers: neither the envelope's nor parking's fields."""
    parked_at: float | None = None
    """Wall-clock time it was parked (Unix seconds); ``None`` when not recorded."""

    @classmethod
    def from_headers(cls, id: str, body: bytes, headers: Mapping[Any, Any]) -> ParkedMessage:
        """Read a parked copy's fields (text or bytes keys and values)."""
        fields = {_text(k): _text(v) for k, v in headers.items()}
        try:
            envelope: Envelope | None = Envelope.decode(fields)
        except EnvelopeError:
            envelope = None
        try:
            parked_at: float | None = float(fields.get(PARKED_AT_FIELD, "nan"))
        except ValueError:
            parked_at = None
        if parked_at is not None and not math.isfinite(parked_at):
            parked_at = None
        skip = set(ENVELOPE_FIELDS) | set(PARKED_FIELDS)
        return cls(
            id=id,
            body=body,
            envelope=envelope,
            reason=fields.get(PARK_REASON_FIELD, "unknown"),
            detail=fields.get(PARK_DETAIL_FIELD, ""),
            headers={k: v for k, v in fields.items() if k not in skip},
            parked_at=parked_at,
        )

    def replay_envelope(self, now: float, ttl: float | None) -> Envelope:
        """The envelope a replay enqueues at wall-clock ``now``: attempt 1, valid for ``ttl``
        seconds (``None``: no deadline of its own), the same idempotency key (a fresh one for
        a message parked without a readable envelope), its history plus ``replayed``."""
        old = self.envelope
        fresh = Envelope(
            enqueued_at=now,
            valid_until=None if ttl is None else now + ttl,
            attempt=1,
            idempotency_key=old.idempotency_key if old is not None else secrets.token_hex(16),
            priority=old.priority if old is not None else Priority.CRITICAL,
            caller=old.caller if old is not None else "unknown",
            operation=old.operation if old is not None else "unknown",
            history=old.history if old is not None else (),
        )
        return fresh.with_history(now, "replayed", f"was parked: {self.reason}")

    def __repr__(self) -> str:
        return f"ParkedMessage(id={self.id!r}, reason={self.reason!r}, parked_at={self.parked_at})"
