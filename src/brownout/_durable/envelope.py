"""The envelope brownout stamps on a message and reads back: when it was enqueued (wall clock,
the one clock producer and consumer share), until when its result is useful, which attempt it
is, its idempotency key, priority, caller and operation, and what happened to it before.

Carried as message headers (AMQP headers, Redis Stream fields) with text values, so any
language can read them; `encode` writes them and `decode` reads them strictly: a field that is
present and malformed is an `EnvelopeError` naming it, never a guess.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .._context import RequestContext
from .._errors import BrownoutError
from .._priority import Priority
from .._propagation import ATTEMPT_HEADER, IDEMPOTENCY_HEADER, PRIORITY_HEADER

__all__ = [
    "ATTEMPT_FIELD",
    "CALLER_FIELD",
    "ENQUEUED_AT_FIELD",
    "ENVELOPE_FIELDS",
    "HISTORY_FIELD",
    "KEY_FIELD",
    "MAX_HISTORY",
    "OPERATION_FIELD",
    "PRIORITY_FIELD",
    "VALID_UNTIL_FIELD",
    "Envelope",
    "EnvelopeError",
    "HistoryEntry",
]

ENQUEUED_AT_FIELD = "brownout-enqueued-at"
"""Wall-clock time (Unix seconds, decimal) of the first enqueue; kept across retries."""
VALID_UNTIL_FIELD = "brownout-valid-until"
"""Wall-clock time (Unix seconds) after which the result is no longer useful."""
ATTEMPT_FIELD = ATTEMPT_HEADER
"""1 for the first delivery of the work, 2 for its first retry, and so on."""
KEY_FIELD = IDEMPOTENCY_HEADER
"""The same on every attempt, so a handler or its dependency can deduplicate."""
PRIORITY_FIELD = PRIORITY_HEADER
CALLER_FIELD = "brownout-caller"
OPERATION_FIELD = "brownout-operation"
HISTORY_FIELD = "brownout-history"
"""JSON list of the last `MAX_HISTORY` events: ``[{"at": t, "event": e, "detail": d}]``."""
ENVELOPE_FIELDS = (
    ENQUEUED_AT_FIELD,
    VALID_UNTIL_FIELD,
    ATTEMPT_FIELD,
    KEY_FIELD,
    PRIORITY_FIELD,
    CALLER_FIELD,
    OPERATION_FIELD,
    HISTORY_FIELD,
)

MAX_HISTORY = 16
"""History entries kept (the newest): a message retried forever must not grow forever."""
_MAX_TEXT = 256  # caller, operation, key and history details are labels, not payloads
_MAX_ATTEMPT = 1_000_000
_EPOCH_MAX = 32_503_680_000.0  # year 3000: a larger time is a corrupt field, not a date


class EnvelopeError(BrownoutError, ValueError):
    """A message's envelope is missing a required field or has a malformed one."""

    def __init__(self, field_name: str, detail: str) -> None:
        super().__init__(f"{field_name}: {detail}")
        self.field = field_name
        self.detail = detail


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One thing that happened to a message: retried, parked, replayed."""

    at: float
    """Wall-clock time (Unix seconds)."""
    event: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Envelope:
    """What brownout knows about one message. Immutable; `next_attempt` and `with_history`
    return copies."""

    enqueued_at: float
    """Wall-clock time of the first enqueue (Unix seconds)."""
    valid_until: float | None = None
    """Wall-clock time after which the work is useless; ``None``: no deadline of its own."""
    attempt: int = 1
    idempotency_key: str | None = None
    priority: Priority = Priority.CRITICAL
    caller: str = "unknown"
    operation: str = "unknown"
    history: tuple[HistoryEntry, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 <= self.enqueued_at <= _EPOCH_MAX:
            raise EnvelopeError(ENQUEUED_AT_FIELD, f"not a Unix time: {self.enqueued_at!r}")
        if self.valid_until is not None and not 0 <= self.valid_until <= _EPOCH_MAX:
            raise EnvelopeError(VALID_UNTIL_FIELD, f"not a Unix time: {self.valid_until!r}")
        if not 1 <= self.attempt <= _MAX_ATTEMPT:
            raise EnvelopeError(ATTEMPT_FIELD, f"must be 1..{_MAX_ATTEMPT}: {self.attempt!r}")

    @classmethod
    def stamp(
        cls,
        now: float,
        context: RequestContext | None = None,
        *,
        ttl: float | None = None,
        idempotency_key: str | None = None,
        operation: str | None = None,
    ) -> Envelope:
        """The envelope of new work enqueued at wall-clock ``now`` from ``context`` (the
        current request's): valid for the request's remaining budget or ``ttl``, whichever is
        shorter; the request's priority, caller and idempotency key (a fresh unguessable one
        when it has none)."""
        left = context.remaining() if context is not None else None
        if ttl is not None:
            if not 0 < ttl < math.inf:
                raise ValueError("ttl must be positive and finite")
            left = ttl if left is None else min(left, ttl)
        key = idempotency_key
        if key is None and context is not None:
            key = context.idempotency_key
        return cls(
            enqueued_at=now,
            valid_until=None if left is None else now + max(0.0, left),
            idempotency_key=key if key is not None else secrets.token_hex(16),
            priority=context.priority if context is not None else Priority.CRITICAL,
            caller=context.caller if context is not None else "unknown",
            operation=operation
            if operation is not None
            else (context.operation if context is not None else "unknown"),
        )

    def age(self, now: float) -> float:
        """Seconds since the first enqueue by wall clock ``now`` (0 when the producer's clock
        is ahead of this one)."""
        return max(0.0, now - self.enqueued_at)

    def remaining(self, now: float) -> float | None:
        """Seconds until ``valid_until`` by wall clock ``now`` (negative once past)."""
        return None if self.valid_until is None else self.valid_until - now

    def next_attempt(self, now: float, event: str, detail: str = "") -> Envelope:
        """The envelope of the next attempt, with what happened recorded."""
        return replace(self.with_history(now, event, detail), attempt=self.attempt + 1)

    def with_history(self, now: float, event: str, detail: str = "") -> Envelope:
        entry = HistoryEntry(now, event, detail[:_MAX_TEXT])
        return replace(self, history=(*self.history, entry)[-MAX_HISTORY:])

    def encode(self) -> dict[str, str]:
        """The envelope as text headers (`ENVELOPE_FIELDS`; absent fields left out)."""
        out = {
            ENQUEUED_AT_FIELD: repr(self.enqueued_at),
            ATTEMPT_FIELD: str(self.attempt),
            PRIORITY_FIELD: self.priority.name.lower(),
            CALLER_FIELD: self.caller,
            OPERATION_FIELD: self.operation,
        }
        if self.valid_until is not None:
            out[VALID_UNTIL_FIELD] = repr(self.valid_until)
        if self.idempotency_key is not None:
            out[KEY_FIELD] = self.idempotency_key
        if self.history:
            out[HISTORY_FIELD] = json.dumps(
                [{"at": h.at, "event": h.event, "detail": h.detail} for h in self.history],
                separators=(",", ":"),
            )
        return out

    @classmethod
    def decode(cls, headers: Mapping[str, Any]) -> Envelope:
        """Read an envelope from message headers (text or bytes values).

        Raises `EnvelopeError` naming the field when ``brownout-enqueued-at`` is missing or a
        present field is malformed; optional fields that are absent take their defaults.
        """
        get = headers.get
        raw = get(ENQUEUED_AT_FIELD)
        if raw is None:
            raise EnvelopeError(ENQUEUED_AT_FIELD, "missing: not a message brownout enqueued")
        enqueued_at = _time(ENQUEUED_AT_FIELD, raw)
        raw = get(VALID_UNTIL_FIELD)
        valid_until = None if raw is None else _time(VALID_UNTIL_FIELD, raw)
        raw = get(ATTEMPT_FIELD)
        attempt = 1 if raw is None else _attempt(raw)
        raw = get(PRIORITY_FIELD)
        priority = Priority.CRITICAL if raw is None else _priority(raw)
        raw = get(HISTORY_FIELD)
        # The fields were checked one by one: build the instance without `__post_init__`.
        new = _NEW(_EnvelopeBuilder)
        new.enqueued_at = enqueued_at
        new.valid_until = valid_until
        new.attempt = attempt
        new.idempotency_key = _label(KEY_FIELD, get(KEY_FIELD))
        new.priority = priority
        new.caller = _label(CALLER_FIELD, get(CALLER_FIELD)) or "unknown"
        new.operation = _label(OPERATION_FIELD, get(OPERATION_FIELD)) or "unknown"
        new.history = () if raw is None else _history(raw)
        new.__class__ = cls  # type: ignore[assignment]
        return new  # type: ignore[return-value]


class _EnvelopeBuilder:
    """`Envelope`'s mutable twin (the same slots, in order), for `Envelope.decode`."""

    __slots__ = tuple(f.name for f in fields(Envelope))

    enqueued_at: float
    valid_until: float | None
    attempt: int
    idempotency_key: str | None
    priority: Priority
    caller: str
    operation: str
    history: tuple[HistoryEntry, ...]


_NEW = object.__new__
_MAX_RAW = _MAX_TEXT * 64


def _text(name: str, value: object) -> str:
    # the common cases first: well-formed bytes (AMQP) or text
    if type(value) is bytes and len(value) <= _MAX_RAW:
        try:
            return value.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise EnvelopeError(name, "not UTF-8") from None
    if type(value) is str and len(value) <= _MAX_RAW:
        return value.strip()
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise EnvelopeError(name, "not UTF-8") from None
    if not isinstance(value, str):
        raise EnvelopeError(name, f"not text: {type(value).__name__}")
    if len(value) > _MAX_RAW:
        raise EnvelopeError(name, f"longer than {_MAX_RAW} characters")
    return value.strip()


def _label(name: str, value: object) -> str | None:
    if value is None:
        return None
    text = _text(name, value)
    if len(text) > _MAX_TEXT or not text.isprintable():
        raise EnvelopeError(name, f"must be printable text of at most {_MAX_TEXT} characters")
    return text or None


def _time(name: str, value: object) -> float:
    text = _text(name, value)
    try:
        t = float(text)
    except ValueError:
        raise EnvelopeError(name, f"not a number: {text[:40]!r}") from None
    if not 0 <= t <= _EPOCH_MAX:  # also NaN and infinities
        raise EnvelopeError(name, f"not a Unix time: {text[:40]!r}")
    return t


def _attempt(value: object) -> int:
    text = _text(ATTEMPT_FIELD, value)
    if not text.isdigit() or len(text) > 7 or not 1 <= int(text) <= _MAX_ATTEMPT:
        raise EnvelopeError(ATTEMPT_FIELD, f"not an attempt number 1..{_MAX_ATTEMPT}")
    return int(text)


def _priority(value: object) -> Priority:
    if value is None:
        return Priority.CRITICAL
    text = _text(PRIORITY_FIELD, value).upper()
    try:
        return Priority[text]
    except KeyError:
        names = ", ".join(p.name.lower() for p in Priority)
        raise EnvelopeError(PRIORITY_FIELD, f"not one of {names}") from None


def _history(value: object) -> tuple[HistoryEntry, ...]:
    if value is None:
        return ()
    text = _text(HISTORY_FIELD, value)
    try:
        items = json.loads(text)
    except ValueError:
        raise EnvelopeError(HISTORY_FIELD, "not JSON") from None
    if not isinstance(items, list):
        raise EnvelopeError(HISTORY_FIELD, "not a JSON list")
    out: list[HistoryEntry] = []
    for item in items[-MAX_HISTORY:]:
        if not isinstance(item, dict):
            raise EnvelopeError(HISTORY_FIELD, "an entry is not an object")
        at, event, detail = item.get("at"), item.get("event"), item.get("detail", "")
        if (
            not isinstance(at, int | float)
            or isinstance(at, bool)
            or not 0 <= at <= _EPOCH_MAX
            or not isinstance(event, str)
            or not isinstance(detail, str)
        ):
            raise EnvelopeError(HISTORY_FIELD, "an entry needs at (time), event and detail")
        out.append(HistoryEntry(float(at), event[:_MAX_TEXT], detail[:_MAX_TEXT]))
    return tuple(out)
