"""`ClientThrottle`: client-side adaptive throttling (the Google SRE book's formula).

Each client tracks, over a sliding window, how many ``requests`` it attempted and how many the
dependency ``accepts`` (answered without an overload refusal). When the dependency starts
refusing, the client refuses locally, before sending, with probability::

    max(0, (requests - K * accepts) / (requests + 1))

With ``K = 2`` the client keeps sending up to twice what the dependency accepts, so the
dependency still sees enough traffic to show it has recovered, while most doomed requests cost
nothing on the wire. Locally refused requests count as requests, so the probability rises
while the dependency stays down and falls as accepts come back.
"""

from __future__ import annotations

import math
import random
import threading

from .._clock import Clock, default_clock
from .._context import current
from .._errors import Reason, Rejected
from ..events import EventHub, RequestShed, hub
from .window import SlidingCounters

__all__ = ["ClientThrottle"]

_REQUESTS = 0
_ACCEPTS = 1


class ClientThrottle:
    """Refuse locally (``Rejected(Reason.THROTTLED)``) in proportion to recent refusals.

    ``window`` seconds of history in ``buckets`` slices (the SRE book uses two minutes);
    ``rng`` is injectable for deterministic tests.
    """

    __slots__ = ("_clock", "_counters", "_events", "_lock", "k", "name", "rng")

    def __init__(
        self,
        k: float = 2.0,
        *,
        window: float = 120.0,
        buckets: int = 60,
        name: str = "throttle",
        rng: random.Random | None = None,
        clock: Clock | None = None,
        events: EventHub = hub,
    ) -> None:
        # Also refuses NaN and inf, which would switch the throttle off silently (inf * 0 is
        # NaN); a caller who wants no throttle passes none.
        if not 1.0 <= k < math.inf:
            raise ValueError(
                "K must be finite and >= 1 (K < 1 refuses traffic the dependency accepts)"
            )
        self.k = k
        self.name = name
        self.rng = rng or random.Random()
        self._clock = clock or default_clock()
        self._counters = SlidingCounters(2, window=window, buckets=buckets, clock=self._clock)
        self._events = events
        self._lock = threading.Lock()  # a blocking Dependency counts from many threads

    def probability(self) -> float:
        """The current local rejection probability."""
        with self._lock:
            totals = self._counters.sums()
            requests = totals[_REQUESTS]
            accepts = totals[_ACCEPTS]
        p = (requests - self.k * accepts) / (requests + 1)
        return p if p > 0.0 else 0.0

    def check(self) -> None:
        """Count a request; refuse it with the current probability (before it is sent)."""
        counters = self._counters
        with self._lock:
            slot = counters.advance()
            totals = counters.totals
            requests = totals[_REQUESTS]
            accepts = totals[_ACCEPTS]
            slot[_REQUESTS] += 1
            totals[_REQUESTS] += 1
        excess = requests - self.k * accepts
        if excess > 0.0 and self.rng.random() < excess / (requests + 1):
            if self._events.enabled:
                ctx = current()
                self._events.emit(
                    RequestShed(
                        self._clock.now(),
                        self.name,
                        ctx.operation,
                        ctx.priority,
                        ctx.caller,
                        Reason.THROTTLED,
                        ctx.remaining(),
                        0.0,
                    )
                )
            raise Rejected(Reason.THROTTLED, f"{self.name}: dependency is refusing requests")

    def record_accept(self) -> None:
        """The dependency accepted a request (answered anything but an overload refusal)."""
        with self._lock:
            self._counters.add(_ACCEPTS)

    @property
    def requests(self) -> int:
        with self._lock:
            return self._counters.sums()[_REQUESTS]

    @property
    def accepts(self) -> int:
        with self._lock:
            return self._counters.sums()[_ACCEPTS]

    def __repr__(self) -> str:
        return f"ClientThrottle(k={self.k}, p={self.probability():.3f})"
