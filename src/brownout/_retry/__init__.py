"""Outbound resilience primitives: backoff, retry budgets, retry policy, circuit breaker,
client-side throttling and the unknown-outcome ledger (R1-R6, D6, A6).

Standard library only: the Redis ledger (`brownout.RedisOutcomeLedger`) never imports redis.
"""

from .backoff import Backoff, DecorrelatedJitterBackoff, ExponentialBackoff
from .breaker import BreakerState, CircuitBreaker, default_is_failure
from .budget import GrpcRetryThrottle, RetryAllowance, RetryBudget
from .classify import (
    RETRYABLE_GRPC_CODES,
    RETRYABLE_HTTP_STATUSES,
    Classifier,
    Failure,
    ResponseError,
    RetriesExhausted,
    StopReason,
    TransientError,
    classify,
    parse_pushback,
)
from .idempotency import (
    InMemoryOutcomeLedger,
    OutcomeLedger,
    OutcomeRecord,
    OutcomeState,
    Reconciler,
)
from .policy import AttemptFn, RetryPolicy, RetrySlots, new_idempotency_key
from .throttle import ClientThrottle

__all__ = [
    "RETRYABLE_GRPC_CODES",
    "RETRYABLE_HTTP_STATUSES",
    "AttemptFn",
    "Backoff",
    "BreakerState",
    "CircuitBreaker",
    "Classifier",
    "ClientThrottle",
    "DecorrelatedJitterBackoff",
    "ExponentialBackoff",
    "Failure",
    "GrpcRetryThrottle",
    "InMemoryOutcomeLedger",
    "OutcomeLedger",
    "OutcomeRecord",
    "OutcomeState",
    "Reconciler",
    "ResponseError",
    "RetriesExhausted",
    "RetryAllowance",
    "RetryBudget",
    "RetryPolicy",
    "RetrySlots",
    "StopReason",
    "TransientError",
    "classify",
    "default_is_failure",
    "new_idempotency_key",
    "parse_pushback",
]
