"""Graceful degradation (G1 to G4): declared degraded modes, stale content, fail-closed guards.

- `DegradedMode` / `DegradedModes`: modes declared before the incident, entered and left by
  overload level, signal or hand, with dwell and hysteresis; their names reach the caller in
  the ``brownout-degraded`` header and the problem body's ``degraded`` field.
- `StaleCache`: stale-while-revalidate for *content*, single flight, bounded, age reported.
- `FailClosedGuard`: authoritative data is never degraded; failure raises `FailClosed`.
- `drill`: force modes on and fail dependencies, catching fallbacks that call the failed
  service (G3).
"""

from .drill import (
    Drill,
    DrillFailed,
    DrillOutage,
    FallbackCalledFailedDependency,
    dependency_call,
    depends_on,
    drill,
    fallback_scope,
)
from .guard import FailClosedGuard
from .modes import DEGRADED_HEADER, DegradedMode, DegradedModes, LevelSource
from .stale import STALE_AGE_HEADER, Served, StaleCache, stale_headers

__all__ = [
    "DEGRADED_HEADER",
    "STALE_AGE_HEADER",
    "DegradedMode",
    "DegradedModes",
    "Drill",
    "DrillFailed",
    "DrillOutage",
    "FailClosedGuard",
    "FallbackCalledFailedDependency",
    "LevelSource",
    "Served",
    "StaleCache",
    "dependency_call",
    "depends_on",
    "drill",
    "fallback_scope",
    "stale_headers",
]
