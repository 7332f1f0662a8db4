"""The in-memory quota store: GCRA state per key in one process, with bounded memory.

State is one float per key, kept in least-recently-used order. A key whose bucket is full
again (its TAT has passed) carries no information, so it is *idle* and dropped: a few idle
keys are swept every few decisions, and all idle keys at the LRU end are swept before a new key
is stored, then the first idle key among the ``_SWEEP_LIMIT`` least recently used. When those
are all still draining, the least recently used one is evicted anyway (that caller gets a fresh
burst); `evicted_active` counts those, so an undersized store shows up in metrics instead of in
memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import islice

from .._clock import Clock, default_clock
from .gcra import GcraOutcome, GcraPolicy, decide

__all__ = ["InMemoryQuotaStore"]

_SWEEP_EVERY = 16
"""Decisions between two sweeps of idle keys at the LRU end ..."""
_SWEEP_LIMIT = 32
"""... and at most this many keys per sweep: twice the rate keys can arrive, so idle keys
drain, while no single decision pays for a long sweep."""


class InMemoryQuotaStore:
    """GCRA state for up to ``max_keys`` keys in this process (the embedded default store).

    Decisions are synchronous and O(1) amortised; there is no I/O, so it never fails and
    never needs a fallback. One store serves one `Quota` (keys of two quotas would collide).
    """

    __slots__ = ("_clock", "_countdown", "_tats", "evicted_active", "evicted_idle", "max_keys")

    shared = False
    """Not shared between processes: each instance enforces its own limit."""

    def __init__(self, max_keys: int = 100_000, *, clock: Clock | None = None) -> None:
        if not 1 <= max_keys < math.inf:  # (NaN too: memory stays bounded)
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._clock = clock if clock is not None else default_clock()
        self._tats: OrderedDict[str, float] = OrderedDict()
        self._countdown = _SWEEP_EVERY
        self.evicted_idle = 0
        """Keys dropped because their bucket was full again (lossless)."""
        self.evicted_active = 0
        """Keys dropped while still draining because the store was full (forgives a debt)."""

    @property
    def clock(self) -> Clock:
        return self._clock

    def __len__(self) -> int:
        return len(self._tats)

    def decide_now(self, key: str, policy: GcraPolicy, cost: int = 1) -> GcraOutcome:
        """Decide one request for ``key`` at the store clock's now (synchronous)."""
        now = self._clock.now()
        tats = self._tats
        self._countdown -= 1
        if not self._countdown:
            self._countdown = _SWEEP_EVERY
            self._sweep(now, _SWEEP_LIMIT)
        tat = tats.get(key)
        outcome = decide(policy, tat, now, cost)
        if outcome.allowed:
            if tat is None:
                if len(tats) >= self.max_keys:
                    self._make_room(now)
            else:
                tats.move_to_end(key)
            tats[key] = outcome.tat
        return outcome

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        """The `QuotaStore` protocol: same as `decide_now` (``budget`` is irrelevant here)."""
        return self.decide_now(key, policy, cost)

    def clear(self) -> None:
        """Forget every key."""
        self._tats.clear()

    def _sweep(self, now: float, limit: int) -> None:
        tats = self._tats
        while limit and tats:
            key, tat = next(iter(tats.items()))
            if tat > now:
                return
            del tats[key]
            self.evicted_idle += 1
            limit -= 1

    def _make_room(self, now: float) -> None:
        self._sweep(now, len(self._tats))
        tats = self._tats
        if len(tats) >= self.max_keys:
            # Recency is not TAT order (costs differ): an idle key may sit right behind a
            # draining one at the LRU end. Look a bounded way past it before forgiving a debt.
            for key, tat in islice(tats.items(), _SWEEP_LIMIT):
                if tat <= now:
                    del tats[key]
                    self.evicted_idle += 1
                    return
            tats.popitem(last=False)
            self.evicted_active += 1
