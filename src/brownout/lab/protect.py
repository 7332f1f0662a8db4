"""How the lab protects the demo's front service: brownout's public API and nothing else.

This is the whole difference between the ``unprotected`` and the protected configurations, and
it is what a user adds to their own Starlette or FastAPI app:

- ``fixed``: a `FixedLimit` chosen by load test (the dependency serves 8 at a time; a couple
  more keep it busy while the front's own hop is in flight) and a FIFO queue as long as the
  limit with a 100 ms age bound;
- ``adaptive``: a `Gradient2Limit` with its defaults and the bulkhead's default queue
  (FIFO, as long as the limit, 1 s age bound): no number tuned for this demo.

Both: the caller's budget header is honoured (an internal caller), the route decides the
priority (interactive is ``CRITICAL``, batch ``SHEDDABLE``), and ``/healthz`` bypasses
admission.
"""

from __future__ import annotations

from typing import Any

from brownout import (
    Bulkhead,
    FifoQueue,
    FixedLimit,
    Gradient2Limit,
    InboundDeadlinePolicy,
    Priority,
    Trust,
)
from brownout.edge import EdgePolicy, Route
from brownout.integrations.asgi import BrownoutMiddleware

__all__ = ["FIXED_LIMIT", "protect"]

FIXED_LIMIT = 10
"""The fixed configuration's limit: the dependency's 8 slots plus 2 covering the front's hop."""


def protect(app: Any, mode: str) -> Bulkhead:
    """Add brownout's ASGI middleware to the Starlette ``app`` (``fixed`` or ``adaptive``).

    Returns the bulkhead, so the demo can show its limit and queue at ``/lab/bulkhead``.
    """
    if mode == "fixed":
        bulkhead = Bulkhead(
            "front",
            limit=FixedLimit(FIXED_LIMIT),
            queue=FifoQueue(max_size=FIXED_LIMIT, max_wait=0.1),
        )
    elif mode == "adaptive":
        bulkhead = Bulkhead("front", limit=Gradient2Limit())
    else:
        raise ValueError(f"unknown protection mode {mode!r}")
    policy = EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(default=1.0, maximum=10.0),
        trust=Trust.TRUSTED,
        health_paths=("/healthz", "/lab/bulkhead"),
        routes={
            "/api/interactive": Route(priority=Priority.CRITICAL),
            "/api/batch": Route(priority=Priority.SHEDDABLE),
        },
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    return bulkhead
