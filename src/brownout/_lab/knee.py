"""The knee: the highest offered rate a service keeps up with, found open loop.

Offered load starts at ``start_rps`` and grows by ``factor`` per step until a step is not
kept up with: goodput falls below ``follow`` of what was offered, the success p99 passes the
client deadline, or it passes ``latency_factor`` times the lowest p99 seen (plus a small
floor). The latency test matters in short steps: past the capacity a queue builds, but the
requests it holds still finish within the deadline, so goodput alone follows offered load.
The rates between the last step kept up with and the first that was not are then bisected
``refine`` times (geometric midpoints). The knee is the highest rate kept up with; the lab
uses it as the capacity its load multiples are taken of.

`find_knee` takes the measurement as a function, so the search is tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .scenario_file import CapacitySpec

__all__ = ["Knee", "KneeStep", "find_knee"]

_BELOW_START = 4
"""Times the start rate is divided by ``factor`` when even it is not kept up with."""


_LATENCY_FLOOR_MS = 20.0
"""Latency growth below this is noise on a shared host, not a queue."""


@dataclass(frozen=True)
class KneeStep:
    """One rate tried."""

    rate: float
    offered_per_s: float
    goodput_per_s: float
    success_p99_ms: float | None
    kept_up: bool


@dataclass(frozen=True)
class Knee:
    """The search's result: ``capacity`` (req/s) and every rate tried, in order."""

    capacity: float
    steps: tuple[KneeStep, ...]
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "why": self.why,
            "steps": [asdict(s) for s in self.steps],
        }


Measure = Callable[[float], tuple[float, float, float | None]]
"""Offer ``rate`` req/s for one step; (offered/s, goodput/s, success p99 ms or None)."""


def find_knee(
    measure: Measure,
    spec: CapacitySpec,
    deadline_ms: float,
    on_step: Callable[[KneeStep], None] | None = None,
) -> Knee:
    """Search for the knee (see the module docstring); `RuntimeError` when no rate is kept
    up with."""
    steps: list[KneeStep] = []
    lowest: list[float] = []

    def attempt(rate: float) -> bool:
        offered, goodput, p99 = measure(rate)
        if p99 is not None:
            lowest[:] = [min([p99, *lowest])]
        ok = (
            offered > 0
            and goodput >= spec.follow * offered
            and p99 is not None
            and p99 <= deadline_ms
            and p99 <= max(spec.latency_factor * lowest[0], lowest[0] + _LATENCY_FLOOR_MS)
        )
        step = KneeStep(round(rate, 1), offered, goodput, p99, ok)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        return ok

    good: float | None = None
    bad: float | None = None
    rate = spec.start_rps
    if not attempt(rate):
        bad = rate
        for _ in range(_BELOW_START):
            rate /= spec.factor
            if attempt(rate):
                good = rate
                break
            bad = rate
        if good is None:
            raise RuntimeError(
                f"no offered rate from {rate:.1f} to {spec.start_rps:g} req/s was kept up with "
                f"(goodput >= {spec.follow:.0%} of offered, p99 within the deadline and "
                f"{spec.latency_factor:g}x the lowest p99)"
            )
    else:
        good = rate
        while bad is None:
            rate = good * spec.factor
            if rate > spec.max_rps:
                return Knee(round(good, 1), tuple(steps), f"kept up to max_rps {spec.max_rps:g}")
            if attempt(rate):
                good = rate
            else:
                bad = rate
    for _ in range(spec.refine):
        mid = math.sqrt(good * bad)
        if attempt(mid):
            good = mid
        else:
            bad = mid
    why = f"kept up with {good:.1f} req/s, not with {bad:.1f}"
    return Knee(round(good, 1), tuple(steps), why)
