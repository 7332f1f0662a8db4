"""`InMemoryIdempotencyStore`: keys, leases and answers in one process, bounded.

Two ordered tables: keys being run (with their lease end) and completed answers (with their
expiry). At ``max_entries`` the oldest completed answer is evicted to make room; a running key
is never evicted (its handler may still apply its effect), so when running keys alone fill it
the new key is refused with `IdempotencyStoreUnavailable` and the layer's ``on_outage`` rule
applies. Expired answers and ended leases are dropped when met and from the tables' heads.
"""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from .._clock import Clock, default_clock
from .model import Claim, ClaimState, IdempotencyStoreUnavailable, StoredResponse

__all__ = ["InMemoryIdempotencyStore"]

_SWEEP = 4
"""Expired entries dropped from each table's head per write: bounded work per request."""


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    until: float
    """Lease end (running) or expiry (completed), on the store's clock."""
    token: str = ""
    response: StoredResponse | None = None


class InMemoryIdempotencyStore:
    """An `IdempotencyStore` in process memory (tests, single-process services).

    At most ``max_entries`` keys, running and completed together; ``evicted`` counts completed
    answers dropped to stay within it, ``refused`` the keys refused because running keys alone
    filled it.
    """

    __slots__ = ("_clock", "_done", "_running", "evicted", "max_entries", "refused")

    def __init__(self, max_entries: int = 10_000, *, clock: Clock | None = None) -> None:
        if not 1 <= max_entries < math.inf:  # (NaN too: memory stays bounded)
            raise ValueError("max_entries must be >= 1")
        self.max_entries = int(max_entries)
        self._clock = clock or default_clock()
        self._running: OrderedDict[str, _Entry] = OrderedDict()
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._running) + len(self._done)

    def _sweep(self, now: float) -> None:
        for table in (self._running, self._done):
            for _ in range(_SWEEP):
                if not table:
                    break
                key, entry = next(iter(table.items()))
                if entry.until > now:
                    break
                del table[key]

    async def begin(self, key: str, fingerprint: str, lease: float) -> Claim:
        now = self._clock.now()
        running = self._running.get(key)
        if running is not None:
            if running.until > now:
                if running.fingerprint != fingerprint:
                    return Claim(ClaimState.MISMATCH, key, fingerprint)
                return Claim(
                    ClaimState.IN_PROGRESS, key, fingerprint, retry_after=running.until - now
                )
            del self._running[key]  # the lease ended: a later attempt may run it
        done = self._done.get(key)
        if done is not None:
            if done.until > now:
                if done.fingerprint != fingerprint:
                    return Claim(ClaimState.MISMATCH, key, fingerprint)
                return Claim(ClaimState.REPLAY, key, fingerprint, response=done.response)
            del self._done[key]
        self._sweep(now)
        while len(self) >= self.max_entries and self._done:
            self._done.popitem(last=False)
            self.evicted += 1
        if len(self) >= self.max_entries:
            self.refused += 1
            raise IdempotencyStoreUnavailable(
                f"idempotency store full: {len(self._running)} keys running "
                f"at max_entries={self.max_entries}"
            )
        token = secrets.token_hex(8)
        self._running[key] = _Entry(fingerprint, now + lease, token)
        return Claim(ClaimState.RUN, key, fingerprint, token=token)

    async def complete(self, claim: Claim, response: StoredResponse, ttl: float) -> bool:
        now = self._clock.now()
        entry = self._running.get(claim.key)
        if entry is None or entry.token != claim.token or entry.until <= now:
            return False
        del self._running[claim.key]
        self._done[claim.key] = _Entry(claim.fingerprint, now + ttl, response=response)
        while len(self) > self.max_entries and self._done:
            self._done.popitem(last=False)
            self.evicted += 1
        return True

    async def release(self, claim: Claim) -> None:
        entry = self._running.get(claim.key)
        if entry is not None and entry.token == claim.token:
            del self._running[claim.key]

    def abandon(self, claim: Claim) -> None:
        """Nothing to do: the key stays locked until its lease ends."""

    def __repr__(self) -> str:
        return f"InMemoryIdempotencyStore(max_entries={self.max_entries}, entries={len(self)})"
