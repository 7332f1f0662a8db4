"""The simulator: brownout's own policy objects on a virtual-time event loop (`brownout.sim`)."""

from .engine import simulate
from .file import load, loads
from .loop import Deadlock, VirtualLoop, run
from .model import (
    Arrivals,
    Build,
    Call,
    Constant,
    Exponential,
    Fault,
    Invariant,
    LogNormal,
    ModelError,
    Problem,
    Service,
    System,
    Unbudgeted,
    Uniform,
    validate,
)
from .results import Result, Series, Verdict

__all__ = [
    "Arrivals",
    "Build",
    "Call",
    "Constant",
    "Deadlock",
    "Exponential",
    "Fault",
    "Invariant",
    "LogNormal",
    "ModelError",
    "Problem",
    "Result",
    "Series",
    "Service",
    "System",
    "Unbudgeted",
    "Uniform",
    "Verdict",
    "VirtualLoop",
    "load",
    "loads",
    "run",
    "simulate",
    "validate",
]
