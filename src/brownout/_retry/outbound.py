"""The rules every outbound client adapter shares, stated once.

Which requests are safe to resend (`SAFE_METHODS`, `is_idempotent`), which answers the retry
layer must see (`needs_retry_layer`, `http_answer_error`), what the caller gets when the
retry layer is done with an answer (`answer_for_caller`), and how long one attempt may take
(`attempt_budget`). The adapters (httpx, aiohttp, grpc.aio) only translate their framework's
objects to and from these.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import TypeVar

from .._deadline import Deadline, call_budget
from .classify import ResponseError, RetriesExhausted, TransientError, parse_pushback

__all__ = [
    "ATTEMPT_EDGE",
    "SAFE_METHODS",
    "answer_for_caller",
    "attempt_budget",
    "http_answer_error",
    "is_idempotent",
    "needs_retry_layer",
]

T = TypeVar("T")

SAFE_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
"""HTTP methods without side effects (RFC 9110): retried freely, never an unknown outcome."""

ATTEMPT_EDGE = 0.001
"""The smallest reserve an attempt keeps back (seconds): it always ends before its request,
or the request's own cancellation wins the race and an unknown outcome goes unrecorded."""


def is_idempotent(method: str, safe_methods: Collection[str], override: object = None) -> bool:
    """Whether a request may be repeated without a key: ``override`` when given (a request's
    own flag), else whether its method is one of ``safe_methods``."""
    return bool(override) if override is not None else method in safe_methods


def needs_retry_layer(status: int) -> bool:
    """Whether an HTTP answer goes to the retry layer (5xx and 429: retried when retryable,
    counted by the breaker) instead of straight back to the caller."""
    return status >= 500 or status == 429


def http_answer_error(status: int, headers: Mapping[str, str], response: object) -> ResponseError:
    """The `ResponseError` for an HTTP answer the retry layer must see, with its pushback
    (``Retry-After``, ``brownout-retry: never``) read from ``headers``."""
    retry_after, never = parse_pushback(headers)
    return ResponseError(status, retry_after=retry_after, do_not_retry=never, response=response)


def answer_for_caller(
    error: BaseException, kind: type[T], *, return_exhausted: bool = False
) -> T | None:
    """What the caller gets instead of ``error`` (``None``: re-raise ``error``), when it is
    the framework's own ``kind``: the answer of a `ResponseError` this layer does not retry;
    the last answer of `RetriesExhausted` when ``return_exhausted``; the framework error
    behind a `TransientError` (gRPC callers see grpc's errors unchanged)."""
    if isinstance(error, ResponseError):
        found: object = error.response
    elif isinstance(error, RetriesExhausted) and return_exhausted:
        found = error.response
    elif isinstance(error, TransientError):
        found = error.__cause__
    else:
        return None
    return found if isinstance(found, kind) else None


def attempt_budget(
    timeout: float | None,
    *,
    reserve: float,
    min_useful: float,
    deadline: Deadline | None,
) -> float | None:
    """How long one attempt may take, as `brownout.Dependency` gives each attempt: the
    dependency's ``timeout`` capped at the deadline's remaining time less the reserve (at
    least `ATTEMPT_EDGE`); ``None`` for no bound. Too little left raises `brownout.Rejected`
    (``DEADLINE_TOO_SHORT``, or ``DEADLINE_EXPIRED``) before anything is sent."""
    if deadline is None:
        return timeout
    budget = call_budget(
        math.inf if timeout is None else timeout,
        reserve=reserve if reserve > ATTEMPT_EDGE else ATTEMPT_EDGE,
        min_useful=min_useful,
        deadline=deadline,
    )
    return None if budget == math.inf else budget
