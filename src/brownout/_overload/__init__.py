"""Overload: local resource signals and the manager that turns them into shedding (A7)."""

from .manager import DEFAULT_LEVELS, OverloadLevel, OverloadManager
from .signals import (
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
    "DEFAULT_LEVELS",
    "EventLoopLag",
    "FileDescriptors",
    "FunctionSignal",
    "InFlight",
    "MemoryPressure",
    "OverloadLevel",
    "OverloadManager",
    "QueueAge",
    "Signal",
    "cgroup_memory_limit",
]
