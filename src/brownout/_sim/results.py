"""What a simulation measured: per layer, per time bucket, and the verdict on invariants.

A layer is a service (all its instances) or a class of arrivals (the clients). Per bucket:
``offered`` (requests that reached it, retries included), ``admitted`` (got a worker; for
clients: sent), ``shed`` (refused by its own admission; for clients: by their own guards),
``retried`` (offered requests that were retries), ``completed`` (answered with success while
the caller still waited: completed in deadline), ``failed`` (answered with an error),
``late`` (succeeded after the caller gave up), ``wasted`` (worker-seconds spent on requests
someone up the chain had already given up on), ``busy`` (worker-seconds of work) and
``waited`` (seconds requests waited in the instances' worker queues).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model import Invariant, System

__all__ = ["COUNTS", "Result", "Series", "Verdict"]

COUNTS = ("offered", "admitted", "shed", "retried", "completed", "failed", "late")
SECONDS = ("wasted", "busy", "waited")


class Series:
    """One layer's counters, one list entry per bucket."""

    __slots__ = (
        "admitted",
        "busy",
        "completed",
        "failed",
        "late",
        "n",
        "name",
        "offered",
        "retried",
        "shed",
        "waited",
        "wasted",
    )

    def __init__(self, name: str, n: int) -> None:
        self.name = name
        self.n = n
        self.offered = [0.0] * n
        self.admitted = [0.0] * n
        self.shed = [0.0] * n
        self.retried = [0.0] * n
        self.completed = [0.0] * n
        self.failed = [0.0] * n
        self.late = [0.0] * n
        self.wasted = [0.0] * n
        self.busy = [0.0] * n
        self.waited = [0.0] * n

    def add(self, counter: list[float], bucket: int, value: float = 1.0) -> None:
        if bucket < self.n:  # (after the end: work the run was cut short in)
            counter[bucket] += value

    def column(self, metric: str) -> list[float]:
        values: list[float] = getattr(self, metric)
        return values

    def total(self, metric: str, first: int = 0, last: int | None = None) -> float:
        return math.fsum(self.column(metric)[first:last])


@dataclass(frozen=True)
class Verdict:
    """One invariant, the value measured, and whether it held."""

    invariant: Invariant
    value: float
    passed: bool

    def describe(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        return f"{mark}  {self.invariant.describe()}: measured {self.value:.4g}"


class Result:
    """Everything one run measured; `metric` reads a layer over a window of time."""

    def __init__(self, system: System, n: int) -> None:
        self.system = system
        self.bucket = system.bucket
        self.duration = system.duration
        self.n = n
        self.layers: dict[str, Series] = {}
        self.verdicts: list[Verdict] = []
        self.wall_seconds = 0.0

    def layer(self, name: str) -> Series:
        series = self.layers.get(name)
        if series is None:
            series = self.layers[name] = Series(name, self.n)
        return series

    def _window(self, start: float, end: float | None) -> tuple[int, int, float]:
        first = max(0, math.floor(start / self.bucket + 1e-9))
        stop = self.duration if end is None else min(end, self.duration)
        last = max(first, math.ceil(stop / self.bucket - 1e-9))
        last = min(last, self.n)
        seconds = (last - first) * self.bucket
        seconds = min(seconds, self.duration - first * self.bucket)
        return first, last, seconds

    def total(self, layer: str, metric: str, start: float = 0.0, end: float | None = None) -> float:
        """The sum of ``metric`` over the buckets of ``[start, end)`` (whole buckets)."""
        first, last, _ = self._window(start, end)
        return self.layers[layer].total(metric, first, last)

    def metric(
        self, layer: str, metric: str, start: float = 0.0, end: float | None = None
    ) -> float:
        """``metric`` of ``layer`` over ``[start, end)``: per second, ``success_ratio``
        (completed / offered; 1.0 when nothing was offered) or ``mean_wait``."""
        first, last, seconds = self._window(start, end)
        series = self.layers[layer]
        if metric == "success_ratio":
            offered = series.total("offered", first, last)
            return 1.0 if offered == 0 else series.total("completed", first, last) / offered
        if metric == "mean_wait":
            admitted = series.total("admitted", first, last)
            return 0.0 if admitted == 0 else series.total("waited", first, last) / admitted
        return series.total(metric, first, last) / seconds if seconds > 0 else 0.0

    def finish(self) -> None:
        """Judge the system's invariants."""
        self.verdicts = []
        for inv in self.system.invariants:
            value = self.metric(inv.layer, inv.metric, inv.start, inv.end)
            ok = (inv.min is None or value >= inv.min) and (inv.max is None or value <= inv.max)
            self.verdicts.append(Verdict(inv, value, ok))

    @property
    def passed(self) -> bool:
        """Every declared invariant held (true when none were declared)."""
        return all(v.passed for v in self.verdicts)

    @property
    def requests(self) -> int:
        """Requests offered at every layer, clients included: the work simulated."""
        return int(sum(s.total("offered") for s in self.layers.values()))

    def table(self, *, every: int = 1) -> str:
        """Per layer, one row per ``every`` buckets: counts per second, wasted and busy in
        worker-seconds per second."""
        lines = []
        columns = (*COUNTS, *SECONDS)
        head = f"{'t (s)':>8} " + " ".join(f"{c:>9}" for c in columns)
        for name, series in self.layers.items():
            lines.append(f"== {name}")
            lines.append(head)
            for first in range(0, self.n, every):
                last = min(self.n, first + every)
                seconds = min((last - first) * self.bucket, self.duration - first * self.bucket)
                cells = " ".join(f"{series.total(c, first, last) / seconds:>9.1f}" for c in columns)
                lines.append(f"{first * self.bucket:>8g} {cells}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "duration": self.duration,
            "bucket": self.bucket,
            "seed": self.system.seed,
            "metadata": dict(self.system.metadata),
            "wall_seconds": self.wall_seconds,
            "requests": self.requests,
            "layers": {
                name: {c: series.column(c) for c in (*COUNTS, *SECONDS)}
                for name, series in self.layers.items()
            },
            "invariants": [
                {
                    "invariant": v.invariant.describe(),
                    "layer": v.invariant.layer,
                    "metric": v.invariant.metric,
                    "min": v.invariant.min,
                    "max": v.invariant.max,
                    "start": v.invariant.start,
                    "end": v.invariant.end,
                    "value": v.value,
                    "passed": v.passed,
                }
                for v in self.verdicts
            ],
            "passed": self.passed,
        }
