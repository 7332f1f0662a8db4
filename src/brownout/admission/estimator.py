"""Per-operation latency estimates, for deadline-aware admission (D7).

`LatencyEstimator` keeps, for each operation, an exponentially weighted moving average of the
service time of successful runs and of its mean absolute deviation. ``estimate(op)`` answers
``mean + k * deviation`` once ``min_samples`` were seen (``None`` before: no estimate, no
refusal), so a `Bulkhead` can refuse at entry work whose remaining time cannot cover the
expected queue wait plus service time, and re-check when it leaves the queue.

Memory is bounded: at most ``max_operations`` operations are tracked; a new operation beyond
that evicts the least recently *added* one (an unbounded label set must not grow memory).
"""

from __future__ import annotations

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

    __slots__ = ("_ops", "alpha", "estimates", "k", "max_operations", "min_samples")

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
        if max_operations < 1:
            raise ValueError("max_operations must be at least 1")
        self.alpha = alpha
        self.k = k
        self.min_samples = min_samples
        self.max_operations = max_operations
        self._ops: dict[str, _Ewma] = {}
        self.estimates: dict[str, float] = {}
        """Current estimate per operation that has ``min_samples``: what `estimate` answers,
        kept ready so the admission hot path pays one dict lookup. Read-only for callers."""

    def observe(self, operation: str, seconds: float) -> None:
        """Record the service time of one successful run of ``operation``."""
        e = self._ops.get(operation)
        if e is None:
            if len(self._ops) >= self.max_operations:
                oldest = next(iter(self._ops))
                del self._ops[oldest]
                self.estimates.pop(oldest, None)
            e = self._ops[operation] = _Ewma(seconds)
        else:
            a = self.alpha
            diff = seconds - e.mean
            e.mean += a * diff
            e.dev += a * ((diff if diff >= 0 else -diff) - e.dev)
            e.count += 1
        if e.count >= self.min_samples:
            self.estimates[operation] = e.mean + self.k * e.dev

    def estimate(self, operation: str) -> float | None:
        """Expected service time of ``operation`` in seconds, or ``None`` when unknown."""
        return self.estimates.get(operation)

    def operations(self) -> list[str]:
        """Operations currently tracked."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)
