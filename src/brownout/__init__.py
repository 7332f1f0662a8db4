"""brownout: keep a service's goodput at capacity under overload.

Serve what can be served within each caller's deadline, shed the rest early and cheaply,
retry in one layer under a budget, degrade optional features in declared ways, and show all
of it in metrics. The names below are the public API; everything else is an implementation
detail that may change.
"""

from importlib import metadata as _metadata

from .admission import (
    AdaptiveLifoQueue,
    AIMDLimit,
    Bulkhead,
    CoDelQueue,
    FifoQueue,
    FixedLimit,
    Gradient2Limit,
    LatencyEstimator,
    LifoQueue,
    Permit,
    PriorityCoDelQueue,
    VegasLimit,
)
from .clock import Clock, LoopClock, ManualClock, MonotonicClock
from .context import (
    RequestContext,
    bind,
    check_deadline,
    current,
    deadline,
    remaining,
    request,
)
from .deadline import Deadline, call_budget
from .degrade import DegradedMode, DegradedModes, FailClosedGuard, StaleCache
from .dependency import Dependency
from .errors import (
    BrownoutError,
    DeadlineExceeded,
    FailClosed,
    HeaderError,
    Reason,
    Rejected,
    UnknownOutcome,
)
from .events import Event, EventHub, Sink, hub
from .overload import (
    EventLoopLag,
    FileDescriptors,
    InFlight,
    MemoryPressure,
    OverloadLevel,
    OverloadManager,
    QueueAge,
)
from .priority import Priority
from .propagation import BudgetSigner, InboundDeadlinePolicy, Trust
from .quota import InMemoryQuotaStore, Quota, QuotaDecision, RedisQuotaStore
from .retry import (
    CircuitBreaker,
    ClientThrottle,
    DecorrelatedJitterBackoff,
    ExponentialBackoff,
    GrpcRetryThrottle,
    ResponseError,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    TransientError,
)
from .stats import Stats

try:  # the version is written once, in pyproject.toml; installing puts it in the metadata
    __version__ = _metadata.version("brownout")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "AIMDLimit",
    "AdaptiveLifoQueue",
    "BrownoutError",
    "BudgetSigner",
    "Bulkhead",
    "CircuitBreaker",
    "ClientThrottle",
    "Clock",
    "CoDelQueue",
    "Deadline",
    "DeadlineExceeded",
    "DecorrelatedJitterBackoff",
    "DegradedMode",
    "DegradedModes",
    "Dependency",
    "Event",
    "EventHub",
    "EventLoopLag",
    "ExponentialBackoff",
    "FailClosed",
    "FailClosedGuard",
    "FifoQueue",
    "FileDescriptors",
    "FixedLimit",
    "Gradient2Limit",
    "GrpcRetryThrottle",
    "HeaderError",
    "InFlight",
    "InMemoryQuotaStore",
    "InboundDeadlinePolicy",
    "LatencyEstimator",
    "LifoQueue",
    "LoopClock",
    "ManualClock",
    "MemoryPressure",
    "MonotonicClock",
    "OverloadLevel",
    "OverloadManager",
    "Permit",
    "Priority",
    "PriorityCoDelQueue",
    "QueueAge",
    "Quota",
    "QuotaDecision",
    "Reason",
    "RedisQuotaStore",
    "Rejected",
    "RequestContext",
    "ResponseError",
    "RetriesExhausted",
    "RetryBudget",
    "RetryPolicy",
    "Sink",
    "StaleCache",
    "Stats",
    "TransientError",
    "Trust",
    "UnknownOutcome",
    "VegasLimit",
    "__version__",
    "bind",
    "call_budget",
    "check_deadline",
    "current",
    "deadline",
    "hub",
    "remaining",
    "request",
]
