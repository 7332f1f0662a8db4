"""Settings no primitive can use are refused with ValueError when the object is made.

NaN compares false with everything, so a check written as ``x <= 0`` lets it through and the
object then misbehaves quietly: a NaN queue age bound or probe interval never fires, a NaN
smoothing or backoff turns a limit into NaN, a NaN estimator ``k`` gives estimates no deadline
is refused by (D7), a NaN memory cap never evicts. Infinity does the same where a finite
bound is the point (A3: queues bounded in age; windows that must slide), or overflowed an
int (`RetryBudget`). The retry primitives' own cases are in test_retry_window_properties.py,
the overload manager's in test_overload.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from brownout import InMemoryOutcomeLedger, InMemoryQuotaStore, RetryBudget, StaleCache, Stats
from brownout._retry.window import SlidingCounters
from brownout._stats import LabelCap, TopKLabels
from brownout.limits import AIMDLimit, Gradient2Limit, LatencyEstimator, VegasLimit
from brownout.queues import AdaptiveLifoQueue, CoDelQueue, FifoQueue, LifoQueue, PriorityCoDelQueue
from brownout.testing import ManualClock

NAN, INF = math.nan, math.inf


def stale_cache(*, max_entries: float = 8, max_staleness: float = 2.0) -> object:
    return StaleCache(max_entries=max_entries, fresh_for=1.0, max_staleness=max_staleness)


CASES: list[tuple[str, Callable[[], object]]] = [
    # queues (A3, A4)
    ("fifo-max-wait-nan", lambda: FifoQueue(8, NAN)),
    ("fifo-max-wait-inf", lambda: FifoQueue(8, INF)),
    ("fifo-max-size-inf", lambda: FifoQueue(INF, 1.0)),
    ("lifo-max-wait-inf", lambda: LifoQueue(8, INF)),
    ("codel-interval-inf", lambda: CoDelQueue(8, 1.0, interval=INF)),
    ("codel-target-nan", lambda: CoDelQueue(8, 1.0, target=NAN)),
    ("adaptive-lifo-interval-nan", lambda: AdaptiveLifoQueue(8, 1.0, interval=NAN)),
    ("priority-codel-interval-inf", lambda: PriorityCoDelQueue(8, 1.0, interval=INF)),
    # limits (A5)
    ("aimd-increase-nan", lambda: AIMDLimit(increase=NAN)),
    ("aimd-increase-negative", lambda: AIMDLimit(increase=-1.0)),
    ("aimd-timeout-nan", lambda: AIMDLimit(timeout=NAN)),
    ("gradient-smoothing-nan", lambda: Gradient2Limit(smoothing=NAN)),
    ("gradient-smoothing-negative", lambda: Gradient2Limit(smoothing=-0.5)),
    ("gradient-tolerance-nan", lambda: Gradient2Limit(tolerance=NAN)),
    ("gradient-queue-size-nan", lambda: Gradient2Limit(queue_size=NAN)),
    ("gradient-probe-interval-nan", lambda: Gradient2Limit(probe_interval=NAN)),
    ("gradient-probe-interval-inf", lambda: Gradient2Limit(probe_interval=INF)),
    ("gradient-probe-jitter-one", lambda: Gradient2Limit(probe_jitter=1.0)),
    ("gradient-drop-backoff-nan", lambda: Gradient2Limit(drop_backoff=NAN)),
    ("gradient-drop-backoff-one", lambda: Gradient2Limit(drop_backoff=1.0)),
    ("gradient-early-gap-nan", lambda: Gradient2Limit(early_probe_gap=NAN)),
    ("gradient-short-window-zero", lambda: Gradient2Limit(short_window=0)),
    ("vegas-smoothing-nan", lambda: VegasLimit(smoothing=NAN)),
    ("vegas-smoothing-two", lambda: VegasLimit(smoothing=2.0)),
    ("vegas-probe-samples-zero", lambda: VegasLimit(probe_samples=0)),
    # the latency estimate (D7)
    ("estimator-k-nan", lambda: LatencyEstimator(k=NAN)),
    ("estimator-k-negative", lambda: LatencyEstimator(k=-1.0)),
    ("estimator-min-samples-zero", lambda: LatencyEstimator(min_samples=0)),
    ("estimator-max-operations-nan", lambda: LatencyEstimator(max_operations=NAN)),
    # windows and budgets (R3)
    ("window-inf", lambda: SlidingCounters(1, window=INF, clock=ManualClock())),
    ("window-nan", lambda: SlidingCounters(1, window=NAN, clock=ManualClock())),
    ("budget-min-per-second-inf", lambda: RetryBudget(min_per_second=INF)),  # OverflowError
    ("budget-min-per-second-nan", lambda: RetryBudget(min_per_second=NAN)),
    ("budget-window-inf", lambda: RetryBudget(window=INF)),  # was OverflowError
    # memory caps (bounded per-caller state, label sets and ledgers)
    ("ledger-max-entries-nan", lambda: InMemoryOutcomeLedger(NAN)),
    ("quota-store-max-keys-nan", lambda: InMemoryQuotaStore(max_keys=NAN)),
    ("label-cap-nan", lambda: LabelCap(NAN)),
    ("top-k-nan", lambda: TopKLabels(NAN)),
    ("stats-max-series-negative", lambda: Stats(max_series=-1)),
    ("stats-max-series-nan", lambda: Stats(max_series=NAN)),
    ("stale-cache-max-entries-nan", lambda: stale_cache(max_entries=NAN)),
    # G2: how stale is declared and bounded
    ("stale-cache-max-staleness-inf", lambda: stale_cache(max_staleness=INF)),
    ("stats-max-callers-nan", lambda: Stats(max_callers=NAN)),
]


@pytest.mark.parametrize("build", [pytest.param(b, id=i) for i, b in CASES])
def test_unusable_settings_are_refused_with_value_error(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


def test_the_defaults_and_ordinary_settings_are_still_accepted() -> None:
    """The checks refuse only what cannot work: defaults and edge values still build."""
    FifoQueue(1, 1e-6)
    CoDelQueue(8, 1.0, target=0.1, interval=0.1)
    AIMDLimit(increase=0.5, timeout=2.0)
    Gradient2Limit(smoothing=1.0, tolerance=1.0, queue_size=0, probe_jitter=0.0)
    VegasLimit(smoothing=0.01, early_probe_gap=0.0)
    LatencyEstimator(k=0.0, min_samples=1)
    RetryBudget(min_per_second=0.0, window=0.5, buckets=1)
    Stats(max_series=1, max_callers=1)
