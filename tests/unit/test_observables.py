"""Live gauges of outbound components reach Stats at read time (O2, O5)."""

from __future__ import annotations

import brownout
import brownout.testing
from brownout import (
    CircuitBreaker,
    DegradedMode,
    DegradedModes,
    Dependency,
    RetryBudget,
    RetryPolicy,
)


def as_dict(stats: brownout.Stats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in stats.gauges()}


def test_dependency_and_modes_export_their_state() -> None:
    clock = brownout.testing.ManualClock()
    dep = Dependency(
        "payments",
        timeout=1.0,
        retry=RetryPolicy(3, budget=RetryBudget(0.1, min_per_second=2, window=10, clock=clock)),
        breaker=CircuitBreaker(name="payments", clock=clock),
    )
    modes = DegradedModes(
        [DegradedMode("recs", "hide recommendations", max_duration=600.0)], clock=clock
    )
    stats = brownout.Stats()
    stats.watch(dep)
    stats.watch(modes)
    g = as_dict(stats)
    assert g[("retry_budget_balance", (("source", "payments"),))] == 20.0  # 2/s x 10 s reserve
    assert g[("breaker_state", (("source", "payments"), ("state", "closed")))] == 1.0
    assert g[("breaker_state", (("source", "payments"), ("state", "open")))] == 0.0
    assert g[("degraded_mode_active", (("mode", "recs"),))] == 0.0
    assert g[("degraded_mode_max_seconds", (("mode", "recs"),))] == 600.0
    modes.force("recs", on=True)
    clock.advance(30)
    g = as_dict(stats)
    assert g[("degraded_mode_active", (("mode", "recs"),))] == 1.0
    assert g[("degraded_mode_active_seconds", (("mode", "recs"),))] == 30.0
