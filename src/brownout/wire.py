"""The wire: header names, codecs and the rules an adapter applies to what crosses it.

For writing an adapter for a framework brownout does not cover: the budget and gRPC timeout
codecs, the outbound headers for the current request, how an answer is classified for retry
(`classify`, `parse_pushback`), the rules the bundled client adapters share (`SAFE_METHODS`,
`is_idempotent`, `needs_retry_layer`, `http_answer_error`, `answer_for_caller`,
`attempt_budget`), and the marker calls drills rely on (`dependency_call`).
"""

from ._context import attach, detach
from ._degrade import DEGRADED_HEADER, STALE_AGE_HEADER, dependency_call, stale_headers
from ._priority import parse_priority
from ._propagation import (
    ATTEMPT_HEADER,
    BUDGET_HEADER,
    DO_NOT_RETRY_VALUE,
    ENVOY_TIMEOUT_HEADER,
    GRPC_PUSHBACK_KEY,
    GRPC_TIMEOUT_HEADER,
    IDEMPOTENCY_HEADER,
    PRIORITY_HEADER,
    REFUSAL_REASON_KEY,
    RETRY_HEADER,
    SIGNED_BUDGET_HEADER,
    bind_idempotency_key,
    context_headers,
    decode_attempt,
    decode_budget_ms,
    decode_grpc_timeout,
    decode_idempotency_key,
    encode_budget_ms,
    encode_grpc_timeout,
    outbound_headers,
)
from ._retry import (
    RETRYABLE_GRPC_CODES,
    RETRYABLE_HTTP_STATUSES,
    Failure,
    classify,
    default_is_failure,
    new_idempotency_key,
    parse_pushback,
)
from ._retry.outbound import (
    SAFE_METHODS,
    answer_for_caller,
    attempt_budget,
    http_answer_error,
    is_idempotent,
    needs_retry_layer,
)

__all__ = [
    "ATTEMPT_HEADER",
    "BUDGET_HEADER",
    "DEGRADED_HEADER",
    "DO_NOT_RETRY_VALUE",
    "ENVOY_TIMEOUT_HEADER",
    "GRPC_PUSHBACK_KEY",
    "GRPC_TIMEOUT_HEADER",
    "IDEMPOTENCY_HEADER",
    "PRIORITY_HEADER",
    "REFUSAL_REASON_KEY",
    "RETRYABLE_GRPC_CODES",
    "RETRYABLE_HTTP_STATUSES",
    "RETRY_HEADER",
    "SAFE_METHODS",
    "SIGNED_BUDGET_HEADER",
    "STALE_AGE_HEADER",
    "Failure",
    "answer_for_caller",
    "attach",
    "attempt_budget",
    "bind_idempotency_key",
    "classify",
    "context_headers",
    "decode_attempt",
    "decode_budget_ms",
    "decode_grpc_timeout",
    "decode_idempotency_key",
    "default_is_failure",
    "dependency_call",
    "detach",
    "encode_budget_ms",
    "encode_grpc_timeout",
    "http_answer_error",
    "is_idempotent",
    "needs_retry_layer",
    "new_idempotency_key",
    "outbound_headers",
    "parse_priority",
    "parse_pushback",
    "stale_headers",
]
