"""Admission: limits, bounded wait queues, the `Bulkhead` and latency estimates (A1-A5, D7)."""

from .bulkhead import Bulkhead
from .estimator import LatencyEstimator
from .limits import AIMDLimit, FixedLimit, Gradient2Limit, Limit, VegasLimit
from .permit import Permit
from .queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    QueueItem,
    WaitQueue,
)
from .thread_bulkhead import ThreadBulkhead, ThreadPermit

__all__ = [
    "AIMDLimit",
    "AdaptiveLifoQueue",
    "Bulkhead",
    "CoDelQueue",
    "FifoQueue",
    "FixedLimit",
    "Gradient2Limit",
    "LatencyEstimator",
    "LifoQueue",
    "Limit",
    "Permit",
    "PriorityCoDelQueue",
    "QueueItem",
    "ThreadBulkhead",
    "ThreadPermit",
    "VegasLimit",
    "WaitQueue",
]
