"""Backoff between attempts: exponential with full jitter, or decorrelated jitter; capped (R1).

Jitter spreads the retries of many clients that failed at the same moment, so they do not
arrive together again. The random source is injectable (a `random.Random`) so tests are
deterministic. Backoffs are stateless and can be shared: the previous delay is passed in.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

__all__ = ["Backoff", "DecorrelatedJitterBackoff", "ExponentialBackoff"]


class Backoff(Protocol):
    """Decides how long to wait before a retry."""

    def delay(self, retry: int, previous: float) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the first retry).

        ``previous`` is the delay used before the previous retry (0.0 before the first).
        """
        ...


class ExponentialBackoff:
    """``min(cap, base * multiplier ** (retry - 1))``, with full jitter by default.

    Full jitter draws uniformly from ``[0, that]`` (the AWS "full jitter" variant and gRPC's
    A6 retry backoff); ``jitter=False`` returns the exponential value itself (for tests and
    for callers that add their own spread).
    """

    __slots__ = ("base", "cap", "jitter", "multiplier", "rng")

    def __init__(
        self,
        base: float = 0.05,
        *,
        multiplier: float = 2.0,
        cap: float = 2.0,
        jitter: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        # Also refuses NaN and inf: 0 * inf is NaN, and an infinite delay would sleep forever.
        if not (0 <= base < math.inf and 0 <= cap < math.inf and 1 <= multiplier < math.inf):
            raise ValueError("base and cap must be finite and >= 0, multiplier finite and >= 1")
        self.base = base
        self.multiplier = multiplier
        self.cap = cap
        self.jitter = jitter
        self.rng = rng or random.Random()

    def ceiling(self, retry: int) -> float:
        """The un-jittered delay for retry ``retry``: the top of the jitter range."""
        if retry < 1:
            retry = 1
        # Exponent grows without bound; stop multiplying once past the cap.
        value = self.base
        for _ in range(retry - 1):
            value *= self.multiplier
            if value >= self.cap:
                return self.cap
        return min(value, self.cap)

    def delay(self, retry: int, previous: float = 0.0) -> float:
        top = self.ceiling(retry)
        return self.rng.uniform(0.0, top) if self.jitter else top

    def __repr__(self) -> str:
        return (
            f"ExponentialBackoff(base={self.base}, multiplier={self.multiplier}, "
            f"cap={self.cap}, jitter={self.jitter})"
        )


class DecorrelatedJitterBackoff:
    """``min(cap, uniform(base, 3 * previous))``: each delay depends on the one before.

    The "decorrelated jitter" of the AWS architecture blog: spreads clients well while growing
    roughly exponentially, without the long tail of near-zero delays full jitter produces.
    """

    __slots__ = ("base", "cap", "rng")

    def __init__(
        self, base: float = 0.05, *, cap: float = 2.0, rng: random.Random | None = None
    ) -> None:
        if not 0 <= base <= cap < math.inf:  # also refuses NaN and an infinite sleep
            raise ValueError("need 0 <= base <= cap < inf")
        self.base = base
        self.cap = cap
        self.rng = rng or random.Random()

    def delay(self, retry: int, previous: float = 0.0) -> float:
        high = max(self.base, previous * 3.0)
        return min(self.cap, self.rng.uniform(self.base, high))

    def __repr__(self) -> str:
        return f"DecorrelatedJitterBackoff(base={self.base}, cap={self.cap})"
