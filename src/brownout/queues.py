"""Queue disciplines for the requests a `brownout.Bulkhead` makes wait.

FIFO, LIFO, CoDel, adaptive LIFO and priority CoDel; `WaitQueue` is the protocol for writing
your own, `QueueItem` what it holds, `rank_of` the order work is served in and
`priority_of_rank` the priority of a rank.
"""

from ._admission.queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    QueueItem,
    WaitQueue,
    priority_of_rank,
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
    "priority_of_rank",
    "rank_of",
]
