"""GCRA, the generic cell rate algorithm: a rate limit with a burst, in one number per key.

A key's whole state is its *theoretical arrival time* (TAT): the instant at which the key's
bucket would be full again if nothing more arrived. A request of ``cost`` units moves the
TAT forward by ``cost / rate`` seconds; it is allowed when the new TAT is no further than
``burst / rate`` seconds past now. That is exactly a token bucket of capacity ``burst``
refilled at ``rate`` per second, but with a single float of state and no refill timer, which
is why the same arithmetic fits in a Redis script (`brownout.RedisQuotaStore`).

The functions here are pure: time is an argument, so the property tests run on virtual time
and the Redis script can be checked against them decision by decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["GcraOutcome", "GcraPolicy", "decide"]

MAX_TIME = 1e10
"""The largest time (``|now|``, and a policy's ``burst / rate``) GCRA accepts, in seconds:
317 years, beyond any monotonic or epoch clock. Further out, a float's spacing (2e-6 s here)
starts to swallow emission intervals and the ``rate * t + burst`` bound silently stops
holding (at 1e20 s every request is allowed), so such a time is an error, not a decision."""

_MAX_BURST = 2**53
"""The largest burst a float counts exactly."""


def invalid_cost(cost: float, burst: int) -> ValueError:
    """The error for a cost outside ``1..burst``: every store and `Quota` raise this one, so a
    caller's mistake reads the same whichever backend decides (NaN reads as "not >= 1")."""
    if cost > burst:
        return ValueError(f"cost {cost!r} exceeds burst {burst}: it could never be allowed")
    return ValueError(f"cost must be >= 1, got {cost!r}")


def invalid_time(now: float) -> ValueError:
    """The error for a ``now`` that is not a usable clock reading (see `MAX_TIME`)."""
    return ValueError(f"now must be a finite time within +-{MAX_TIME:g} s, got {now!r}")


@dataclass(frozen=True, slots=True)
class GcraPolicy:
    """A rate limit: ``rate`` units per second on average, up to ``burst`` units at once.

    Over any interval of ``t`` seconds a key is never allowed more than ``rate * t + burst``
    units (the property the tests check).
    """

    rate: float
    burst: int
    interval: float = field(init=False, repr=False, compare=False)
    """Seconds one unit of cost occupies (the emission interval, ``1 / rate``)."""
    tolerance: float = field(init=False, repr=False, compare=False)
    """How far past now a key's TAT may run (``burst / rate``): the burst, in seconds."""

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive finite number, got {self.rate!r}")
        # Chained: a NaN burst fails it too; bounded: a huge int would overflow a float below.
        if not 1 <= self.burst <= _MAX_BURST:
            raise ValueError(f"burst must be >= 1 (and <= 2**53), got {self.burst!r}")
        tolerance = self.burst * (1.0 / self.rate)
        if not tolerance <= MAX_TIME:
            raise ValueError(
                f"burst / rate must be <= {MAX_TIME:g} s (a window beyond any clock), "
                f"got {tolerance!r}"
            )
        # Computed once: decide() runs per request.
        object.__setattr__(self, "interval", 1.0 / self.rate)
        object.__setattr__(self, "tolerance", tolerance)

    def scaled(self, share: int) -> GcraPolicy:
        """This policy divided among ``share`` instances (the local fail-open fallback)."""
        if share < 1:
            raise ValueError("share must be >= 1")
        return GcraPolicy(self.rate / share, max(1, self.burst // share))


class GcraOutcome(NamedTuple):
    """One decision of `decide`.

    ``tat`` is the key's new state (unchanged when refused). ``retry_after`` is the seconds
    until this same request would be allowed (0 when allowed). ``remaining`` is how many
    more unit-cost requests would be allowed right now; ``reset`` is the seconds until the
    key's bucket is full again (after which the key holds no state worth keeping).
    A named tuple: it is built on every decision, and tuples are the cheapest to build.
    """

    allowed: bool
    tat: float
    retry_after: float
    remaining: int
    reset: float


def decide(policy: GcraPolicy, tat: float | None, now: float, cost: int = 1) -> GcraOutcome:
    """Decide one request of ``cost`` units for a key whose state is ``tat`` (None: new key).

    Pure: no clock is read. A refused request does not change the state, so a caller that
    keeps hammering while refused does not push its own recovery further away. A cost outside
    ``1..burst`` or a ``now`` beyond `MAX_TIME` (NaN and infinities included) is a
    ``ValueError``: no decision, no state.
    """
    burst = policy.burst
    if not 1 <= cost <= burst:
        raise invalid_cost(cost, burst)
    # Chained comparisons: NaN fails them, and they cost less than a math.isfinite call.
    if not -MAX_TIME <= now <= MAX_TIME:
        raise invalid_time(now)
    interval = policy.interval
    tolerance = policy.tolerance
    base = now if tat is None or tat < now else tat
    new_tat = base + cost * interval
    # Not ``new_tat - tolerance``: this order is exact for a fresh key (allow_at <= now).
    allow_at = base + (cost - burst) * interval
    # Float round-off: a request due within a millionth of an interval (or a few ulps of the
    # clock's magnitude) is due now; the Redis script uses the same rule. ``remaining`` adds
    # half the slack, so whenever it says n units fit, a request of n units is allowed.
    slack = interval * 1e-6 + abs(base) * 2e-15
    if allow_at - now > slack:
        remaining = int((now + tolerance - base + slack / 2) / interval)
        return GcraOutcome(False, base, allow_at - now, max(remaining, 0), base - now)
    remaining = int((now + tolerance - new_tat + slack / 2) / interval)
    return GcraOutcome(True, new_tat, 0.0, max(remaining, 0), new_tat - now)
