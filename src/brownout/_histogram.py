"""`LatencyHistogram`: fixed log-spaced buckets, so memory is constant however many samples.

A plain data structure with no observability behind it: the wait queues record time in queue
in one, and the `Stats` sink keeps its latency tables in them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = ["LatencyHistogram"]


def _default_bounds() -> tuple[float, ...]:
    # 100 us .. ~100 s, 8 buckets per decade: quantiles within ~15% relative error.
    return tuple(round(1e-4 * 10 ** (i / 8), 9) for i in range(0, 6 * 8 + 1))


_BOUNDS = _default_bounds()


class LatencyHistogram:
    """A fixed-bucket latency histogram (seconds) with quantile estimates.

    Buckets are log-spaced, so memory is constant however many samples arrive.
    """

    __slots__ = ("bounds", "count", "counts", "max", "sum")

    def __init__(self, bounds: tuple[float, ...] = _BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds
        if seconds > self.max:
            self.max = seconds

    def observe_all(self, values: Sequence[float]) -> None:
        """Observe every value (a batch from a tally)."""
        if not values:
            return
        counts = self.counts
        bounds = self.bounds
        for seconds in values:
            counts[bisect.bisect_left(bounds, seconds)] += 1
        self.count += len(values)
        self.sum += math.fsum(values)
        top = max(values)
        if top > self.max:
            self.max = top

    def observe_many(self, seconds: float, n: int) -> None:
        """``n`` observations of the same value (e.g. zero queue waits from a tally)."""
        if n <= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, seconds)] += n
        self.count += n
        self.sum += seconds * n
        if seconds > self.max:
            self.max = seconds

    def quantile(self, q: float) -> float:
        """Estimate the ``q`` quantile (0..1) by interpolating inside the bucket; NaN if empty."""
        if self.count == 0:
            return math.nan
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                lo = self.bounds[i - 1] if i > 0 else 0.0
                hi = self.bounds[i] if i < len(self.bounds) else self.max
                hi = min(hi, self.max) if self.max > lo else hi
                return lo + (hi - lo) * ((rank - seen) / n)
            seen += n
        return self.max

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with +Inf: Prometheus' shape."""
        out: list[tuple[float, int]] = []
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), list(self.counts)):
            acc += n
            out.append((bound, acc))
        return out

    def merge(self, other: LatencyHistogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different buckets")
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.count += other.count
        self.sum += other.sum
        self.max = max(self.max, other.max)
