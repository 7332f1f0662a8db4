"""Overload signals a `brownout.OverloadManager` reads to choose its level.

Each reads one resource and returns a pressure in [0, 1]; `FunctionSignal` wraps your own
function, `Signal` is the protocol. `LoopLag` is the event-loop probe a bulkhead shares.
"""

from ._admission.loop_lag import LoopLag
from ._overload import (
    EventLoopLag,
    FileDescriptors,
    FunctionSignal,
    InFlight,
    MemoryPressure,
    QueueAge,
    Signal,
    cgroup_memory_limit,
)

__all__ = [
    "EventLoopLag",
    "FileDescriptors",
    "FunctionSignal",
    "InFlight",
    "LoopLag",
    "MemoryPressure",
    "QueueAge",
    "Signal",
    "cgroup_memory_limit",
]
