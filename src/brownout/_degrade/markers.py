"""Context markers that let the degradation pieces check each other's rules.

A fallback, a cache load and a fail-closed guard each mark the context they run in, so that
a drill can tell "a fallback called the failed dependency" (G3), and a guard can refuse to be
served through a cache (G4). The markers are contextvars: they follow ``await`` and tasks.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = [
    "cache_loading",
    "fallback_marks",
    "guarding",
    "in_fallback",
    "note_fallback_served",
    "reset_fallback_marks",
    "served_by_fallback",
    "set_fallback_marks",
]

in_fallback: ContextVar[str | None] = ContextVar("brownout_in_fallback", default=None)
"""The name of the degraded mode whose fallback is running, or ``None``."""

cache_loading: ContextVar[str | None] = ContextVar("brownout_cache_loading", default=None)
"""The name of the `StaleCache` whose loader is running, or ``None``."""

guarding: ContextVar[str | None] = ContextVar("brownout_guarding", default=None)
"""What a `FailClosedGuard` is reading (e.g. ``"authorization"``), or ``None``."""

served_by_fallback: ContextVar[list[str] | None] = ContextVar(
    "brownout_served_by_fallback", default=None
)
"""Set by the edge to a fresh list per request (when degraded modes are configured): the names
of the modes whose fallback answered during the request. The edge then keeps that answer out of
the adaptive limit's latency samples: a fallback's speed says nothing about the dependency."""


# Bound once for other modules' hot paths (see `brownout._context.get_current`).
set_fallback_marks = served_by_fallback.set
reset_fallback_marks = served_by_fallback.reset
fallback_marks = served_by_fallback.get


def note_fallback_served(mode: str) -> None:
    """Record that ``mode``'s fallback answered (a no-op outside an edge that asks).

    Each mode is listed once: a task spawned by the request inherits the list and may serve
    fallbacks long after it, so the list is bounded by the modes, not by the calls."""
    marks = served_by_fallback.get()
    if marks is not None and mode not in marks:
        marks.append(mode)
