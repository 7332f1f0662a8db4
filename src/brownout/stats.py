"""In-memory accounting of every decision: the `Stats` sink (O1, O2, O3).

`Stats` counts offered, queued, admitted, shed (by reason), expired, completed within the
deadline (goodput), completed late (wasted work), failed, abandoned, retried and
budget-exhausted work, split by operation, priority and caller. Latency histograms hold
*useful successes only*: refusals and failures never pollute success latency (O3).

Label sets are bounded (`LabelCap`): after ``max_values`` distinct values of a label, new
values are counted under ``"other"``, so 100,000 distinct callers cannot grow memory or the
metric series count without bound.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

from .events import (
    AttemptRetried,
    BreakerStateChanged,
    DegradedModeChanged,
    Event,
    LimitChanged,
    OutcomeUnknown,
    OverloadLevelChanged,
    QuotaBackendChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
    RetryBudgetExhausted,
)

__all__ = ["COUNTER_KINDS", "LabelCap", "LatencyHistogram", "Stats"]

OTHER = "other"

COUNTER_KINDS = (
    "offered",
    "queued",
    "admitted",
    "shed",
    "shed_false_positive",
    "expired",
    "completed",
    "completed_late",
    "failed",
    "abandoned",
    "retried",
    "budget_exhausted",
    "outcome_unknown",
)
"""Every counter `Stats` keeps. ``completed`` is goodput (useful successes)."""


class LabelCap:
    """Maps label values to themselves until ``max_values`` are known, then to ``"other"``."""

    __slots__ = ("_known", "max_values")

    def __init__(self, max_values: int = 100) -> None:
        if max_values < 1:
            raise ValueError("max_values must be >= 1")
        self.max_values = max_values
        self._known: set[str] = set()

    def __call__(self, value: str) -> str:
        known = self._known
        if value in known:
            return value
        if len(known) < self.max_values:
            known.add(value)
            return value
        return OTHER

    def __len__(self) -> int:
        return len(self._known)


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
        for bound, n in zip((*self.bounds, math.inf), self.counts):
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


Key = tuple[str, str, str, str, str]
"""(kind, operation, priority, caller, reason)."""


class Stats:
    """An event sink that keeps counters, success-latency histograms and state gauges.

    Subscribe it to a hub (``brownout.events.hub.subscribe(Stats())``) or pass it where a sink
    is accepted. Reading is cheap; `snapshot` gives a JSON-able dict.
    """

    def __init__(
        self,
        *,
        max_operations: int = 200,
        max_callers: int = 100,
        max_sources: int = 100,
    ) -> None:
        self.operations = LabelCap(max_operations)
        self.callers = LabelCap(max_callers)
        self.sources = LabelCap(max_sources)
        self.counters: dict[Key, int] = {}
        self.success_latency: dict[tuple[str, str], LatencyHistogram] = {}
        """Latency of useful successes by (operation, priority) (O3)."""
        self.queue_wait: dict[str, LatencyHistogram] = {}
        """Time in queue of admitted work, by source."""
        self.remaining_on_arrival: dict[str, LatencyHistogram] = {}
        """Remaining deadline when work was offered, by source (O2)."""
        self.limits: dict[str, int] = {}
        self.breakers: dict[str, str] = {}
        self.overload_level = 0
        self.degraded_modes: dict[str, bool] = {}
        self.quota_fallback: dict[str, bool] = {}
        self._dispatch: dict[type, Callable[[Any], None]] = {
            RequestOffered: self._offered,
            RequestQueued: self._queued,
            RequestAdmitted: self._admitted,
            RequestShed: self._shed,
            RequestExpired: self._expired,
            RequestCompleted: self._completed,
            RequestFailed: self._failed,
            RequestAbandoned: self._abandoned,
            AttemptRetried: self._retried,
            RetryBudgetExhausted: self._budget_exhausted,
            OutcomeUnknown: self._outcome_unknown,
            LimitChanged: self._limit,
            BreakerStateChanged: self._breaker,
            OverloadLevelChanged: self._overload,
            DegradedModeChanged: self._degraded,
            QuotaBackendChanged: self._quota_backend,
        }

    # -- the sink ---------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        handler = self._dispatch.get(type(event))
        if handler is not None:
            handler(event)

    def _bump(self, kind: str, e: Any, reason: str = "") -> None:
        key = (kind, self.operations(e.operation), e.priority.label, self.callers(e.caller), reason)
        self.counters[key] = self.counters.get(key, 0) + 1

    def _hist(self, table: dict[Any, LatencyHistogram], key: Any) -> LatencyHistogram:
        h = table.get(key)
        if h is None:
            h = table[key] = LatencyHistogram()
        return h

    def _offered(self, e: RequestOffered) -> None:
        self._bump("offered", e)
        if e.remaining is not None:
            self._hist(self.remaining_on_arrival, self.sources(e.source)).observe(e.remaining)

    def _queued(self, e: RequestQueued) -> None:
        self._bump("queued", e)

    def _admitted(self, e: RequestAdmitted) -> None:
        self._bump("admitted", e)
        self._hist(self.queue_wait, self.sources(e.source)).observe(e.queue_wait)

    def _shed(self, e: RequestShed) -> None:
        self._bump("shed", e, e.reason.value)
        if e.false_positive:
            self._bump("shed_false_positive", e, e.reason.value)

    def _expired(self, e: RequestExpired) -> None:
        self._bump("expired", e, e.stage)

    def _completed(self, e: RequestCompleted) -> None:
        if e.useful:
            self._bump("completed", e)
            key = (self.operations(e.operation), e.priority.label)
            self._hist(self.success_latency, key).observe(e.latency)
        else:
            self._bump("completed_late", e)

    def _failed(self, e: RequestFailed) -> None:
        self._bump("failed", e, e.error)

    def _abandoned(self, e: RequestAbandoned) -> None:
        self._bump("abandoned", e)

    def _retried(self, e: AttemptRetried) -> None:
        self._bump("retried", e, e.cause)

    def _budget_exhausted(self, e: RetryBudgetExhausted) -> None:
        self._bump("budget_exhausted", e)

    def _outcome_unknown(self, e: OutcomeUnknown) -> None:
        self._bump("outcome_unknown", e)

    def _limit(self, e: LimitChanged) -> None:
        self.limits[self.sources(e.source)] = e.new

    def _breaker(self, e: BreakerStateChanged) -> None:
        self.breakers[self.sources(e.source)] = e.new

    def _overload(self, e: OverloadLevelChanged) -> None:
        self.overload_level = e.new

    def _degraded(self, e: DegradedModeChanged) -> None:
        self.degraded_modes[e.mode] = e.active

    def _quota_backend(self, e: QuotaBackendChanged) -> None:
        self.quota_fallback[self.sources(e.source)] = e.fallback

    # -- reading ----------------------------------------------------------------------------
    def count(
        self,
        kind: str,
        *,
        operation: str | None = None,
        priority: str | None = None,
        caller: str | None = None,
        reason: str | None = None,
    ) -> int:
        """Sum of one counter over every label set matching the given labels."""
        if kind not in COUNTER_KINDS:
            raise ValueError(f"unknown counter {kind!r}; one of {COUNTER_KINDS}")
        total = 0
        for (k, op, pr, ca, re), n in self.counters.items():
            if (
                k == kind
                and (operation is None or op == operation)
                and (priority is None or pr == priority)
                and (caller is None or ca == caller)
                and (reason is None or re == reason)
            ):
                total += n
        return total

    def latency(
        self, operation: str | None = None, priority: str | None = None
    ) -> LatencyHistogram:
        """Merged success-latency histogram for the matching operation/priority."""
        out = LatencyHistogram()
        for (op, pr), h in self.success_latency.items():
            if (operation is None or op == operation) and (priority is None or pr == priority):
                out.merge(h)
        return out

    def series(self) -> Iterable[tuple[Key, int]]:
        """Every (labels, value) counter pair; exporters read this."""
        return list(self.counters.items())

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able summary: totals per kind and reason, success latency, state gauges."""
        totals: dict[str, int] = dict.fromkeys(COUNTER_KINDS, 0)
        shed_by_reason: dict[str, int] = {}
        for (kind, _op, _pr, _ca, reason), n in self.counters.items():
            totals[kind] += n
            if kind == "shed":
                shed_by_reason[reason] = shed_by_reason.get(reason, 0) + n
        lat = self.latency()
        return {
            "totals": totals,
            "shed_by_reason": shed_by_reason,
            "success_latency": {
                "count": lat.count,
                "p50": lat.quantile(0.5) if lat.count else None,
                "p99": lat.quantile(0.99) if lat.count else None,
            },
            "limits": dict(self.limits),
            "breakers": dict(self.breakers),
            "overload_level": self.overload_level,
            "degraded_modes": dict(self.degraded_modes),
            "quota_fallback": dict(self.quota_fallback),
        }

    def reset(self) -> None:
        """Forget all counts and histograms (label caps keep what they learned)."""
        self.counters.clear()
        self.success_latency.clear()
        self.queue_wait.clear()
        self.remaining_on_arrival.clear()
