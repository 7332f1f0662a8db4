"""Live state no event carries, pulled at read time: `Observable`, `Gauge` and the known names.

In-flight, queue depth, oldest queue age, retry-budget balance and the like are read from
registered objects when a reader asks (`Stats.watch`, `Stats.watch_gauge`), so the hot path
never pays for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

__all__ = ["BREAKER_STATES", "GAUGE_KINDS", "Gauge", "GaugeFn", "Observable"]

GAUGE_KINDS = (
    "in_flight",
    "limit",
    "queue_depth",
    "queue_oldest_age",
    "retry_budget_balance",
    "breaker_state",
    "overload_level",
    "degraded_mode_active",
    "degraded_mode_active_seconds",
    "degraded_mode_max_seconds",
    "quota_fallback_active",
    "fleet_holders",
    "fleet_store_failures",
    "fleet_fallback_active",
    "backlog_depth",
    "backlog_oldest_age",
)
"""Gauge names exporters know how to name and describe. Observables may report these (with a
``source`` label, or ``mode`` for degraded modes); other names are exported generically."""

BREAKER_STATES = ("closed", "open", "half_open")

Gauge = tuple[str, Mapping[str, str], float]
"""(name, labels, value): one reading of live state."""


@runtime_checkable
class Observable(Protocol):
    """Something with live state worth exporting, read at scrape time (never on the hot path).

    A `Bulkhead` would yield ``("in_flight", {"source": name}, n)``, ``("limit", ...)``,
    ``("queue_depth", ...)`` and ``("queue_oldest_age", ...)``; a `RetryBudget`
    ``("retry_budget_balance", {"source": name}, tokens)``.
    """

    def gauges(self) -> Iterable[Gauge]: ...


class GaugeFn:
    """One gauge read from a function (`Stats.watch_gauge`)."""

    __slots__ = ("fn", "labels", "name")

    def __init__(self, name: str, labels: Mapping[str, str], fn: Callable[[], float]) -> None:
        self.name = name
        self.labels = dict(labels)
        self.fn = fn

    def gauges(self) -> Iterable[Gauge]:
        yield (self.name, self.labels, float(self.fn()))
