"""What every idempotency store and adapter shares: the stored answer, the claim a store hands
back for a key, the store protocol, and how keys and request fingerprints are read.

A key is the client's token (the IETF HTTPAPI draft's ``Idempotency-Key``: a structured-field
string, ``"8e03978e-..."``; a bare token is accepted too), bound to the authenticated caller:
the store sees a digest of both, so one caller cannot collide with or replay
another's. A fingerprint is ``sha256(method, target, sha256(body))``: the same key with a
different fingerprint is a different request (422), never a replay.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from .._errors import BrownoutError

__all__ = [
    "MAX_KEY_LENGTH",
    "Claim",
    "ClaimState",
    "IdempotencyKeyInvalid",
    "IdempotencyStore",
    "IdempotencyStoreUnavailable",
    "StoredResponse",
    "fingerprint",
    "parse_key",
    "store_key",
]

MAX_KEY_LENGTH = 255
"""The longest key accepted, in characters (a UUID is 36): stores stay bounded per entry."""


class IdempotencyStoreUnavailable(BrownoutError):
    """The idempotency store failed, timed out or is full; the layer's ``on_outage`` decides."""


class IdempotencyKeyInvalid(BrownoutError, ValueError):
    """An ``Idempotency-Key`` that is not a structured-field string (or bare token) of
    printable ASCII, 1 to `MAX_KEY_LENGTH` characters; answered 400. Also raised for a
    database transaction's key that is empty, too long or holds NUL (`IdempotencyTable.key`)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A completed request's answer, replayed byte for byte: status, headers (names in lower
    case, values as sent), body. For gRPC, ``body`` is the serialized response message."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def size(self) -> int:
        """Bytes it takes in a store (roughly): the bound ``max_response`` is checked on it."""
        return len(self.body) + sum(len(k) + len(v) + 4 for k, v in self.headers)


class ClaimState(StrEnum):
    """What a store found for a key."""

    RUN = "run"
    """Nobody holds it: this request holds the lease now, and runs."""
    REPLAY = "replay"
    """It completed with this fingerprint: replay ``response``."""
    IN_PROGRESS = "in_progress"
    """Another request with it holds the lease (409, ``retry_after`` seconds left on it)."""
    MISMATCH = "mismatch"
    """It is held or completed by a request with another fingerprint (422)."""


@dataclass(slots=True)
class Claim:
    """A store's answer to `IdempotencyStore.begin`; for ``RUN``, the lease to complete or
    release (``token`` proves it is still this request's; ``connection`` is the PostgreSQL
    store's connection, inside the open transaction the handler writes through; ``None``
    elsewhere). ``handle`` is the store's own."""

    state: ClaimState
    key: str
    fingerprint: str
    token: str = ""
    response: StoredResponse | None = None
    retry_after: float | None = None
    connection: Any = None
    handle: Any = None


@runtime_checkable
class IdempotencyStore(Protocol):
    """Where keys, leases and stored answers live. Every call raises
    `IdempotencyStoreUnavailable` when the store cannot answer (bounded by its timeout)."""

    async def begin(self, key: str, fingerprint: str, lease: float) -> Claim:
        """Look the key up and, when nobody holds it, take it for ``lease`` seconds (one
        atomic step: two concurrent callers never both get ``RUN``)."""
        ...

    async def complete(self, claim: Claim, response: StoredResponse, ttl: float) -> bool:
        """Store the answer for ``ttl`` seconds and end the lease. ``False``: the lease had
        ended and the key is no longer this claim's (nothing stored)."""
        ...

    async def release(self, claim: Claim) -> None:
        """End the lease without an answer: the next request with the key runs."""
        ...

    def abandon(self, claim: Claim) -> None:
        """The handler was cancelled (deadline, disconnect): its effect is unknown, so the key
        stays locked until the lease ends (the PostgreSQL store rolls the effect back and
        frees it). Must not block: it is called from a cancelled task."""
        ...


def parse_key(raw: str) -> str:
    """The key in an ``Idempotency-Key`` value: a structured-field string (quotes removed,
    ``\\"`` and ``\\\\`` unescaped) or a bare token. Raises `IdempotencyKeyInvalid`."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        inner = text[1:-1]
        out: list[str] = []
        escaped = False
        for ch in inner:
            if escaped:
                if ch not in '"\\':
                    raise IdempotencyKeyInvalid(f"bad escape in Idempotency-Key: \\{ch}")
                out.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                raise IdempotencyKeyInvalid("unescaped quote in Idempotency-Key")
            else:
                out.append(ch)
        if escaped:
            raise IdempotencyKeyInvalid("Idempotency-Key ends in an escape")
        text = "".join(out)
    elif '"' in text:
        raise IdempotencyKeyInvalid("Idempotency-Key has an unbalanced quote")
    if not 1 <= len(text) <= MAX_KEY_LENGTH:
        raise IdempotencyKeyInvalid(
            f"Idempotency-Key must have 1 to {MAX_KEY_LENGTH} characters, not {len(text)}"
        )
    if not all(" " <= ch <= "~" for ch in text):
        raise IdempotencyKeyInvalid("Idempotency-Key must be printable ASCII")
    return text


def store_key(caller: str, key: str) -> str:
    """The name a store keeps ``key`` under for ``caller`` (hex, fixed length)."""
    # length-prefixed: no (caller, key) pair spells another's, whatever the caller holds
    raw = f"{len(caller)}:{caller}\x00{key}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


def fingerprint(method: str, target: str, body: bytes) -> str:
    """The request fingerprint: method, target (path and query) and the body's digest."""
    h = hashlib.sha256()
    h.update(method.upper().encode("ascii", "replace"))
    h.update(b"\n")
    h.update(target.encode("utf-8", "surrogatepass"))
    h.update(b"\n")
    h.update(hashlib.sha256(body).digest())
    return h.hexdigest()
