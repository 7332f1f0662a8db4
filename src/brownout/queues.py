"""Queue disciplines for the requests a `brownout.Bulkhead` makes wait.

FIFO, LIFO, CoDel, adaptive LIFO and priority CoDel; `WaitQueue` is the protocol for writing
your own, `QueueItem` what it holds and `rank_of` the order priorities are served in.
"""

from ._admission.queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    QueueItem,
    WaitQueue,
    rank_of,
)

__all__ = [
    "AdaptiveLifoQueue",
    "CoDelQueue",
    "FifoQueue",
    "LifoQueue",
    "PriorityCoDelQueue",
    "QueueItem",
    "WaitQueue",
    "rank_of",
]
