"""Per-operation latency estimates, for deadline-aware admission (D7).

`LatencyEstimator` keeps, for each operation, an exponentially weighted moving average of the
service time of successful runs and of its mean absolute deviation. ``estimate(op)`` answers
``mean + k * deviation`` once ``min_samples`` were seen (``None`` before: no estimate, no
refusal), so a `Bulkhead` can refuse at entry work whose remaining time cannot cover the
expected queue wait plus service time, and re-check when it leaves the queue.

Memory is bounded: at most ``max_operations`` operations are tracked. An operation seen once
is on trial; its second sample makes it established. A new operation beyond the bound evicts
the oldest operation on trial, and only when none is on trial the established operation
observed least recently. So operations named from input (a classifier that labels by raw
path, a scan of distinct URLs) churn among themselves and cannot push out the estimates of
the operations a service really serves.
"""

from __future__ import annotations

import math

__all__ = ["LatencyEstimator"]


class _Ewma:
    __slots__ = ("count", "dev", "mean")

    def __init__(self, first: float) -> None:
        self.mean = first
        self.dev = 0.0
        self.count = 1


class LatencyEstimator:
    """EWMA service time per operation, bounded in the number of operations.

    ``alpha`` is the weight of a new sample (0.1: about the last 10-20 samples matter).
    ``k`` widens the estimate by that many mean absolute deviations (0: the mean; the default
    0 refuses only work that would be late *on average*, which keeps false refusals rare).
    """

    __slots__ = ("_ops", "_trial", "alpha", "estimates", "k", "max_operations", "min_samples")

    def __init__(
        self,
        *,
        alpha: float = 0.1,
        k: float = 0.0,
        min_samples: int = 5,
        max_operations: int = 256,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if not 1 <= max_operations < math.inf:
            raise ValueError("max_operations must be at least 1 (and finite)")
        # A NaN or negative k makes NaN or too-low estimates: deadlines never refused (D7).
        if not (0 <= k < math.inf and 1 <= min_samples < math.inf):
            raise ValueError("k must be finite and >= 0, min_samples at least 1")
        self.alpha = alpha
        self.k = k
        self.min_samples = min_samples
        self.max_operations = max_operations
        self._trial: dict[str, _Ewma] = {}
        """Operations with one sample, oldest first: the first to go when a new one comes."""
        self._ops: dict[str, _Ewma] = {}
        """Operations with two samples or more, least recently observed first."""
        self.estimates: dict[str, float] = {}
        """Current estimate per operation that has ``min_samples``: what `estimate` answers,
        kept ready so the admission hot path pays one dict lookup. Read-only for callers."""

    def observe(self, operation: str, seconds: float) -> None:
        """Record the service time of one successful run of ``operation``."""
        ops = self._ops
        e = ops.pop(operation, None)
        if e is None:
            e = self._trial.pop(operation, None)
            if e is None:
                if len(ops) + len(self._trial) >= self.max_operations:
                    self._evict()
                e = self._trial[operation] = _Ewma(seconds)
                if e.count >= self.min_samples:
                    self.estimates[operation] = e.mean
                return
        a = self.alpha
        diff = seconds - e.mean
        e.mean += a * diff
        e.dev += a * ((diff if diff >= 0 else -diff) - e.dev)
        e.count += 1
        ops[operation] = e  # (re)inserted last: the most recently observed
        if e.count >= self.min_samples:
            self.estimates[operation] = e.mean + self.k * e.dev

    def _evict(self) -> None:
        victims = self._trial or self._ops
        oldest = next(iter(victims))
        del victims[oldest]
        self.estimates.pop(oldest, None)

    def estimate(self, operation: str) -> float | None:
        """Expected service time of ``operation`` in seconds, or ``None`` when unknown."""
        return self.estimates.get(operation)

    def operations(self) -> list[str]:
        """Operations currently tracked: established ones (least recently observed first),
        then those on trial (oldest first)."""
        return [*self._ops, *self._trial]

    def __len__(self) -> int:
        return len(self._ops) + len(self._trial)
