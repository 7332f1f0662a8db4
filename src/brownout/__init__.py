"""brownout: keep a service's goodput at capacity under overload.

Serve what can be served within each caller's deadline, shed the rest early and cheaply,
retry in one layer under a budget, degrade optional features in declared ways, and show all
of it in metrics.

The names below are what a service author needs. Specialists live in a few public modules:
`brownout.limits` and `brownout.queues` (admission's algorithms), `brownout.signals`
(overload signals), `brownout.events` (the typed decisions exporters consume),
`brownout.wire` (header names and codecs, for writing an adapter), `brownout.testing`
(virtual time and drills), and the adapters under `brownout.integrations` and
`brownout.export`. Every other module is private. docs/api.md says what is stable.
"""

from ._admission import Bulkhead, Permit, ThreadBulkhead
from ._clock import Clock, LoopClock, MonotonicClock
from ._context import (
    RequestContext,
    bind,
    call_budget,
    check_deadline,
    current,
    deadline,
    remaining,
    request,
    statement_timeout_ms,
)
from ._database import DatabasePolicy, IdempotencyTable
from ._deadline import Deadline
from ._degrade import (
    DegradedMode,
    DegradedModes,
    FailClosedGuard,
    Served,
    StaleCache,
    depends_on,
    fallback_scope,
)
from ._dependency import Dependency
from ._edge import Classification, EdgePolicy, Route, SlowedRejections
from ._errors import (
    AlreadyApplied,
    BrownoutError,
    DeadlineExceeded,
    FailClosed,
    HeaderError,
    Reason,
    Rejected,
    UnknownOutcome,
)
from ._fleet import (
    BlockingInMemoryLeaseStore,
    BlockingLeaseStore,
    BlockingRedisLeaseStore,
    FleetLease,
    FleetLimit,
    InMemoryLeaseStore,
    LeaseExpired,
    LeaseStore,
    LeaseStoreUnavailable,
    LeaseUnfenced,
    RedisLeaseStore,
    ThreadFleetLease,
    ThreadFleetLimit,
)
from ._overload import OverloadLevel, OverloadManager
from ._priority import Priority
from ._propagation import BudgetSigner, InboundBudget, InboundDeadlinePolicy, Trust
from ._quota import (
    InMemoryQuotaStore,
    Quota,
    QuotaDecision,
    QuotaKeyUnusable,
    QuotaStore,
    QuotaStoreUnavailable,
    RedisQuotaStore,
)
from ._retry import (
    Backoff,
    BreakerState,
    CircuitBreaker,
    ClientThrottle,
    DecorrelatedJitterBackoff,
    ExponentialBackoff,
    GrpcRetryThrottle,
    InMemoryOutcomeLedger,
    OutcomeLedger,
    OutcomeState,
    Reconciler,
    ResponseError,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    StopReason,
    TransientError,
)
from ._retry.idempotency import OutcomeLedgerFull
from ._retry.ledger_redis import RedisOutcomeLedger
from ._settings import ConfigError, load_config
from ._stats import Stats
from ._version import VERSION as __version__

__all__ = [
    "AlreadyApplied",
    "Backoff",
    "BlockingInMemoryLeaseStore",
    "BlockingLeaseStore",
    "BlockingRedisLeaseStore",
    "BreakerState",
    "BrownoutError",
    "BudgetSigner",
    "Bulkhead",
    "CircuitBreaker",
    "Classification",
    "ClientThrottle",
    "Clock",
    "ConfigError",
    "DatabasePolicy",
    "Deadline",
    "DeadlineExceeded",
    "DecorrelatedJitterBackoff",
    "DegradedMode",
    "DegradedModes",
    "Dependency",
    "EdgePolicy",
    "ExponentialBackoff",
    "FailClosed",
    "FailClosedGuard",
    "FleetLease",
    "FleetLimit",
    "GrpcRetryThrottle",
    "HeaderError",
    "IdempotencyTable",
    "InMemoryLeaseStore",
    "InMemoryOutcomeLedger",
    "InMemoryQuotaStore",
    "InboundBudget",
    "InboundDeadlinePolicy",
    "LeaseExpired",
    "LeaseStore",
    "LeaseStoreUnavailable",
    "LeaseUnfenced",
    "LoopClock",
    "MonotonicClock",
    "OutcomeLedger",
    "OutcomeLedgerFull",
    "OutcomeState",
    "OverloadLevel",
    "OverloadManager",
    "Permit",
    "Priority",
    "Quota",
    "QuotaDecision",
    "QuotaKeyUnusable",
    "QuotaStore",
    "QuotaStoreUnavailable",
    "Reason",
    "Reconciler",
    "RedisLeaseStore",
    "RedisOutcomeLedger",
    "RedisQuotaStore",
    "Rejected",
    "RequestContext",
    "ResponseError",
    "RetriesExhausted",
    "RetryBudget",
    "RetryPolicy",
    "Route",
    "Served",
    "SlowedRejections",
    "StaleCache",
    "Stats",
    "StopReason",
    "ThreadBulkhead",
    "ThreadFleetLease",
    "ThreadFleetLimit",
    "TransientError",
    "Trust",
    "UnknownOutcome",
    "__version__",
    "bind",
    "call_budget",
    "check_deadline",
    "current",
    "deadline",
    "depends_on",
    "fallback_scope",
    "load_config",
    "remaining",
    "request",
    "statement_timeout_ms",
]
