"""A `Bulkhead`, its limit and its queue from a settings table (docs/configuration.md).

``limit`` is an integer (a `FixedLimit`), an algorithm's name, or a table with ``kind`` and
the algorithm's own arguments; ``queue`` is a discipline's name or a table with ``kind``.
"""

from __future__ import annotations

from typing import Any

from .._settings import Section
from .bulkhead import Bulkhead
from .limits import AIMDLimit, FixedLimit, Gradient2Limit, Limit, VegasLimit
from .queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    WaitQueue,
)

__all__ = ["LIMITS", "QUEUES", "bulkhead_from", "limit_from", "queue_from"]

LIMITS: dict[str, type[Any]] = {
    "fixed": FixedLimit,
    "aimd": AIMDLimit,
    "gradient2": Gradient2Limit,
    "vegas": VegasLimit,
}
QUEUES: dict[str, type[WaitQueue]] = {
    "fifo": FifoQueue,
    "lifo": LifoQueue,
    "codel": CoDelQueue,
    "adaptive_lifo": AdaptiveLifoQueue,
    "priority_codel": PriorityCoDelQueue,
}


def limit_from(sec: Section, key: str = "limit") -> Limit | None:
    """The limit at ``key`` of ``sec``: an integer is a `FixedLimit`; default `Gradient2Limit`.
    ``None`` when there was a problem (recorded in ``sec``)."""
    value = sec.data.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        sec.has(key)
        limit: Limit | None = sec.build(FixedLimit, value)
        return limit
    table = sec.variant(key, "gradient2")
    if table is None:
        return None
    cls = table.kind(LIMITS)
    if cls is None:
        return None
    built: Limit | None = table.build(cls, **table.kwargs(cls))
    return built


def queue_from(sec: Section, key: str = "queue") -> WaitQueue | None:
    """The wait queue at ``key`` of ``sec`` (``None``: absent, the bulkhead's default)."""
    table = sec.variant(key, None)
    if table is None:
        return None
    cls = table.kind(QUEUES)
    if cls is None:
        return None
    return table.build(cls, **table.kwargs(cls))


def bulkhead_from(sec: Section, name: str, **code: Any) -> Bulkhead | None:
    """A `Bulkhead` from table ``sec`` (its ``name`` key, else ``name``); ``code`` holds the
    constructor's non-settings arguments (clock, events, estimator...)."""
    limit = limit_from(sec)
    queue = queue_from(sec)
    kwargs = sec.kwargs(Bulkhead, skip=("limit", "queue"))
    kwargs.setdefault("name", name)
    if limit is None:
        return None
    return sec.build(Bulkhead, limit=limit, queue=queue, **kwargs, **code)
