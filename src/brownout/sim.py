"""The simulator: brownout's real policy objects on a virtual-time asyncio loop.

Describe a system (`System`: `Service` nodes with instances and workers, `Call` edges with
a `Dependency` factory, `Arrivals`, `Fault` timeline, `Invariant` bounds) in Python or in a
TOML file (`load`), and `simulate` it: the `Bulkhead`, limits, queues, `RetryPolicy`,
`RetryBudget`, `CircuitBreaker`, `ClientThrottle`, `Dependency` and deadlines you give it run
unchanged on a `VirtualLoop`, deterministically for a seed. The `Result` has per-layer
counters over time and the verdict on the invariants. ``brownout sim FILE`` runs a file.
"""

from ._sim import (
    Arrivals,
    Build,
    Call,
    Constant,
    Deadlock,
    Exponential,
    Fault,
    Invariant,
    LogNormal,
    ModelError,
    Problem,
    Result,
    Series,
    Service,
    System,
    Unbudgeted,
    Uniform,
    Verdict,
    VirtualLoop,
    load,
    loads,
    run,
    simulate,
    validate,
)

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
