"""What the load generator counts: one `Tally` per traffic class and measurement window.

Every offered request ends in exactly one outcome, so ``offered == sum(outcomes)`` is an
invariant the tests check. Success latency and refusal latency are kept apart (O3): a fast
503 must never make the success figures look better.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OUTCOMES", "Tally", "percentile"]

OUTCOMES = (
    "ok",
    "ok_late",
    "r429",
    "r503",
    "r504",
    "other_status",
    "errors",
    "timeouts_sent",
    "timeouts_unsent",
)
"""The outcomes of an offered request; exactly one per request.

- ``ok``: 2xx within the client deadline (goodput);
- ``ok_late``: 2xx after the client deadline (useless work);
- ``r429`` / ``r503`` / ``r504``: refusals and server-side expiry;
- ``other_status``: any other HTTP status;
- ``errors``: connection failures, resets, unparseable responses;
- ``timeouts_sent``: the client deadline passed while waiting for the response;
- ``timeouts_unsent``: the deadline passed before a connection was free (the pool was full).
"""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(slots=True)
class Tally:
    """Counts and latencies for one traffic class in one window of one step."""

    offered: int = 0
    sent: int = 0
    ok: int = 0
    ok_late: int = 0
    r429: int = 0
    r503: int = 0
    r504: int = 0
    other_status: int = 0
    errors: int = 0
    timeouts_sent: int = 0
    timeouts_unsent: int = 0
    success_latency: list[float] = field(default_factory=list)
    refusal_latency: list[float] = field(default_factory=list)
    shed_reasons: dict[str, int] = field(default_factory=dict)
    degraded: int = 0
    """Responses marked ``brownout-degraded`` (whatever their status): a degraded mode was on."""
    degraded_ok: int = 0
    """Of ``ok``, those marked degraded: goodput served in a degraded mode (G3)."""

    @property
    def resolved(self) -> int:
        """Requests that reached an outcome."""
        return sum(getattr(self, name) for name in OUTCOMES)

    @property
    def refused(self) -> int:
        return self.r429 + self.r503

    @property
    def expired(self) -> int:
        """Deadline ran out: at the client (sent or not, or a 2xx that came too late) or at
        the server (504)."""
        return self.timeouts_sent + self.timeouts_unsent + self.ok_late + self.r504

    def add(self, other: Tally) -> None:
        """Fold ``other`` into this tally."""
        for name in ("offered", "sent", "degraded", "degraded_ok", *OUTCOMES):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.success_latency.extend(other.success_latency)
        self.refusal_latency.extend(other.refusal_latency)
        for reason, n in other.shed_reasons.items():
            self.shed_reasons[reason] = self.shed_reasons.get(reason, 0) + n

    @classmethod
    def merged(cls, tallies: Iterable[Tally]) -> Tally:
        total = cls()
        for t in tallies:
            total.add(t)
        return total

    def summary(self, seconds: float) -> dict[str, Any]:
        """Rates per second over ``seconds`` and latency percentiles in milliseconds."""
        per_s = 1.0 / seconds if seconds > 0 else 0.0

        def ms(values: list[float], q: float) -> float | None:
            p = percentile(values, q)
            return None if p is None else round(p * 1000, 2)

        return {
            "offered": self.offered,
            "sent": self.sent,
            **{name: getattr(self, name) for name in OUTCOMES},
            "offered_per_s": round(self.offered * per_s, 1),
            "goodput_per_s": round(self.ok * per_s, 1),
            "degraded": self.degraded,
            "degraded_ok": self.degraded_ok,
            "degraded_goodput_per_s": round(self.degraded_ok * per_s, 1),
            "degraded_per_s": round(self.degraded * per_s, 1),
            "refused": self.refused,
            "expired": self.expired,
            "shed_reasons": dict(sorted(self.shed_reasons.items())),
            "success_p50_ms": ms(self.success_latency, 0.50),
            "success_p99_ms": ms(self.success_latency, 0.99),
            "refusal_p50_ms": ms(self.refusal_latency, 0.50),
            "refusal_p99_ms": ms(self.refusal_latency, 0.99),
        }
