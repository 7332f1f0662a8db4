"""How the lab protects the demo's front service: brownout's public API and nothing else.

This is the whole difference between the ``unprotected`` and the protected configurations, and
it is what a user adds to their own Starlette or FastAPI app:

- ``fixed``: a `FixedLimit` chosen by load test (the dependency serves 8 at a time; a couple
  more keep it busy while the front's own hop is in flight) and a FIFO queue as long as the
  limit with a 100 ms age bound;
- ``adaptive``: a `Gradient2Limit` with its defaults and the bulkhead's default queue
  (`PriorityCoDelQueue`: as long as the current limit, CoDel per priority class, so batch
  absorbs the shedding): no number tuned for this demo.

The sync front (`brownout._lab.sync_front`, Flask under gunicorn) gets the same protection
through `protect_wsgi`: brownout's WSGI middleware and a `ThreadBulkhead` with the same limit
and queue.

All: the caller's budget header is honoured (an internal caller), the route decides the
priority (interactive is ``CRITICAL``, batch ``SHEDDABLE``), and ``/healthz`` bypasses
admission.

Outbound (the retry-storm, partial-errors and outage scenarios' ``/api/outbound`` route): the
protected front calls the dependency through `BrownoutClientMiddleware` and one `Dependency`
(`outbound_dependency`): 3 attempts under a `RetryBudget`, a `CircuitBreaker` whose recovery
admits a few jittered half-open probes, and the do-not-retry marker upstream when it gives
up (R1). The unprotected front retries naively instead (demo.py).

Degradation (the degraded scenario's ``/api/recommendations`` route): the protected front
declares a `DegradedMode` ``recommendations``, entered when the dependency gets slow, that
serves recommendations from a `StaleCache` (or a local default) without waiting on the
dependency; the edge announces it in the ``brownout-degraded`` header (G2, G3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from brownout import (
    Bulkhead,
    CircuitBreaker,
    DegradedMode,
    DegradedModes,
    Dependency,
    EdgePolicy,
    ExponentialBackoff,
    InboundDeadlinePolicy,
    Priority,
    RetryBudget,
    RetryPolicy,
    Route,
    Stats,
    ThreadBulkhead,
    Trust,
)
from brownout.events import hub
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit, Gradient2Limit
from brownout.queues import FifoQueue

__all__ = [
    "DEMO_MODES",
    "FIXED_LIMIT",
    "OUTBOUND_ATTEMPTS",
    "RETRY_RATIO",
    "degraded_modes",
    "expose_metrics",
    "outbound_dependency",
    "outbound_session",
    "protect",
    "protect_wsgi",
]

FIXED_LIMIT = 10
"""The fixed configuration's limit: the dependency's 8 slots plus 2 covering the front's hop."""


OUTBOUND_ATTEMPTS = 3
"""Attempts per call to the dependency, the original included (the naive front uses the same)."""
RETRY_RATIO = 0.2
"""Retries allowed per original call (`RetryBudget` ratio), plus a small reserve."""
DEMO_MODES = ("recommendations",)
"""Degraded modes the demo front declares (``brownout lab --drill MODE`` forces one on)."""


def outbound_dependency() -> Dependency:
    """The protected front's guard for calls to the dependency (R1-R5).

    3 attempts with jittered exponential backoff, under a budget of 20% of originals plus 5
    per second over a 2 s window (short, so the lab's 3 s steps reach its steady state); a
    breaker that opens at 50% failures over the last 50 calls, stays open 1 s +/- 50% jitter
    and then lets 3 probes through (no synchronized wave when the dependency returns).
    """
    return Dependency(
        "backend",
        retry=RetryPolicy(
            OUTBOUND_ATTEMPTS,
            budget=RetryBudget(RETRY_RATIO, min_per_second=5.0, window=2.0),
            backoff=ExponentialBackoff(0.01, cap=0.1),
            name="backend",
        ),
        breaker=CircuitBreaker(
            failure_rate=0.5,
            window=50,
            minimum_calls=20,
            open_for=1.0,
            open_jitter=0.5,
            half_open_probes=3,
            name="backend",
        ),
    )


def outbound_session() -> Any:
    """An aiohttp session whose every request goes through `outbound_dependency` (public API:
    `BrownoutClientMiddleware`). Create it inside the running event loop."""
    import aiohttp

    from brownout.integrations.aiohttp_client import BrownoutClientMiddleware

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=100, force_close=False),
        middlewares=(BrownoutClientMiddleware(outbound_dependency()),),
    )


def degraded_modes(dependency_slow: Callable[[], bool]) -> DegradedModes:
    """The demo's declared degraded modes (G1, G2), written before any incident.

    ``recommendations``: serve recommendations from the local stale cache instead of the
    dependency, entered while ``dependency_slow()`` says so (polled every 100 ms), held at
    least 1 s, content at most 60 s old.
    """
    return DegradedModes(
        [
            DegradedMode(
                "recommendations",
                "recommendations come from a local cache (up to 60 s old), not the dependency",
                enter_when=dependency_slow,
                min_dwell=1.0,
                max_staleness=60.0,
                poll_interval=0.1,
            )
        ]
    )


def _bulkhead(mode: str, kind: type[Bulkhead] = Bulkhead) -> Bulkhead:
    """The front's bulkhead in ``mode`` (``fixed`` or ``adaptive``), of class ``kind``."""
    if mode == "fixed":
        return kind(
            "front",
            limit=FixedLimit(FIXED_LIMIT),
            queue=FifoQueue(max_size=FIXED_LIMIT, max_wait=0.1),
        )
    if mode == "adaptive":
        return kind("front", limit=Gradient2Limit())
    raise ValueError(f"unknown protection mode {mode!r}")


def _policy(bulkhead: Bulkhead, degraded: DegradedModes | None = None) -> EdgePolicy:
    return EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(default=1.0, maximum=10.0),
        trust=Trust.TRUSTED,
        health_paths=("/healthz", "/lab/bulkhead"),
        routes={
            "/api/interactive": Route(priority=Priority.CRITICAL),
            "/api/batch": Route(priority=Priority.SHEDDABLE),
            "/api/outbound": Route(priority=Priority.CRITICAL),
            "/api/recommendations": Route(priority=Priority.CRITICAL),
        },
        degraded=degraded,
    )


def protect(app: Any, mode: str, *, degraded: DegradedModes | None = None) -> Bulkhead:
    """Add brownout's ASGI middleware to the Starlette ``app`` (``fixed`` or ``adaptive``).

    Returns the bulkhead, so the demo can show its limit and queue at ``/lab/bulkhead``.
    """
    bulkhead = _bulkhead(mode)
    app.add_middleware(BrownoutMiddleware, policy=_policy(bulkhead, degraded))
    return bulkhead


def expose_metrics(app: Any) -> Any:
    """``app`` with brownout's Prometheus metrics at ``/metrics`` (the lab's server view): a
    `Stats` on the event hub and the exporter, as a user's service exposes them. Opt-in
    (``brownout lab --server-view``): with a sink on the hub the front tallies its events,
    work the demo's figures otherwise leave out. Needs prometheus_client."""
    from prometheus_client import CollectorRegistry

    from brownout.export.prometheus import metrics_middleware, register

    registry = CollectorRegistry()
    stats = Stats()
    hub.subscribe(stats)
    register(stats, registry)
    return metrics_middleware(app, registry=registry)


def protect_wsgi(app: Any, mode: str) -> ThreadBulkhead:
    """The same protection for the sync front's Flask ``app``: brownout's WSGI middleware
    (Flask's rules as routes) and a `ThreadBulkhead` with the same limit and queue."""
    from brownout.integrations.flask import protect as protect_flask

    bulkhead = _bulkhead(mode, ThreadBulkhead)
    protect_flask(app, _policy(bulkhead))
    return cast(ThreadBulkhead, bulkhead)
