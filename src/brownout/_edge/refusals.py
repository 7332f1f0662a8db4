"""Refusals: what the edge answers instead of the handler, in both vocabularies.

For a refusal reason the policy picks an HTTP status and a gRPC code (both tables are here:
`GRPC_CODE_FOR_STATUS`, `STATUS_FOR_GRPC_CODE`), a detail text (`DETAILS`), an RFC 9457
problem body, and the headers (`refusal_headers`) or trailing metadata (`refusal_trailers`)
that say when and whether to come back. Adapters only encode these for their framework.
"""

from __future__ import annotations

import http
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._degrade.modes import DEGRADED_HEADER
from .._errors import Reason
from .._propagation import (
    DO_NOT_RETRY_VALUE,
    GRPC_PUSHBACK_KEY,
    REFUSAL_REASON_KEY,
    RETRY_HEADER,
)
from .protocols import ActiveModes, QuotaAnswer

__all__ = [
    "DEFAULT_DO_NOT_RETRY",
    "DETAILS",
    "GRPC_CODE_FOR_STATUS",
    "PROBLEM_CONTENT_TYPE",
    "STATUS_FOR_GRPC_CODE",
    "Refusal",
    "announced_modes",
    "grpc_code_for_status",
    "problem_body",
    "ratelimit_headers",
    "refusal_headers",
    "refusal_trailers",
    "retry_after_window",
]

PROBLEM_CONTENT_TYPE = "application/problem+json"

_RETRY_AFTER_CAP = 2**31
"""The longest ``Retry-After`` sent, in seconds (RFC 9111's cap on delta-seconds)."""

DETAILS: dict[Reason, str] = {
    Reason.QUEUE_FULL: "The service is at capacity and its wait queue is full.",
    Reason.QUEUE_TIMEOUT: "The request waited too long for capacity.",
    Reason.DEADLINE_TOO_SHORT: "Too little time was left for the request to be useful.",
    Reason.DEADLINE_EXPIRED: "The request's deadline passed before it could be answered.",
    Reason.OVERLOADED: "The service is overloaded and is shedding this priority.",
    Reason.FAIR_SHARE: "This caller already holds its share of the service's capacity.",
    Reason.QUOTA: "The caller exceeded its rate or quota.",
    Reason.BREAKER_OPEN: "A dependency's circuit breaker is open.",
    Reason.BUDGET_EXHAUSTED: "A dependency failed and the retry budget is exhausted.",
    Reason.THROTTLED: "Calls to a dependency are being throttled.",
    Reason.DEPENDENCY_UNAVAILABLE: "An authoritative dependency is unavailable.",
    Reason.DO_NOT_RETRY: "A dependency refused and asked callers not to retry.",
    Reason.OUTCOME_UNKNOWN: (
        "A change was sent to a dependency that never answered; its outcome is unknown. "
        "Reconcile by idempotency key rather than resending."
    ),
    Reason.BACKLOG_FULL: "The queue this work goes to is over its bound; try again later.",
}
"""The default detail text of a refusal, in the problem body (HTTP) and the status details
(gRPC); `EdgePolicy.details` overrides it per reason."""

DEFAULT_DO_NOT_RETRY = frozenset(
    {Reason.BUDGET_EXHAUSTED, Reason.DO_NOT_RETRY, Reason.OUTCOME_UNKNOWN}
)
"""Reasons whose refusals say "do not retry": a retry layer already gave up on them."""

# google.rpc.Code's HTTP mapping, by `grpc.StatusCode` member name (the core imports no grpc).
STATUS_FOR_GRPC_CODE: dict[str, int] = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}
"""The HTTP equivalent of a gRPC status: how the gRPC edge reads the status a handler ended
its call with (5xx: the service failed; below: an answer)."""

GRPC_CODE_FOR_STATUS: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",  # may mean a change did complete: right for OUTCOME_UNKNOWN too
}
"""The gRPC code a refusal with an HTTP status gets unless `EdgePolicy.grpc_codes` says
otherwise, so ``statuses`` and ``expired_status`` decide for both protocols."""


def grpc_code_for_status(status: int) -> str:
    """The gRPC code name of a refusal answered with HTTP ``status`` (UNAVAILABLE, which
    invites a later retry, for a status without an equivalent)."""
    return GRPC_CODE_FOR_STATUS.get(status, "UNAVAILABLE")


class Refusal(NamedTuple):
    """A refusal ready to be written by an adapter.

    ``retry_after`` is the jittered estimate in seconds (``None``: do not send one);
    ``do_not_retry`` asks callers not to retry (``brownout-retry: never`` /
    ``grpc-retry-pushback-ms: -1``); ``body`` is the RFC 9457 problem document; ``detail``
    and ``grpc_code`` are what a gRPC edge ends the call with.
    """

    status: int
    reason: Reason
    body: bytes
    retry_after: float | None
    do_not_retry: bool
    degraded: tuple[str, ...]
    quota: QuotaAnswer | None = None
    estimate: float | None = None
    """The un-jittered estimate ``retry_after`` was drawn from."""
    detail: str = ""
    grpc_code: str = "UNAVAILABLE"
    """A `grpc.StatusCode` member name."""
    retry_after_whole: int | None = None
    """``Retry-After`` in whole seconds, drawn by the policy (`retry_after_window`)."""

    def retry_after_header(self) -> str | None:
        """``Retry-After`` in whole seconds (`retry_after_seconds`); ``None`` without an
        estimate."""
        seconds = self.retry_after_seconds()
        return None if seconds is None else str(seconds)

    def retry_after_seconds(self) -> int | None:
        """`retry_after_header` as a number (adapters that write bytes look it up): the
        policy's draw from `retry_after_window`; for a refusal built without one, the
        jittered value rounded, never below the estimate rounded up, at least 1."""
        ra = self.retry_after
        if ra is None:
            return None
        whole = self.retry_after_whole
        if whole is not None:
            return whole
        estimate = self.estimate
        floor = math.ceil(estimate) if estimate is not None else 1
        seconds = round(ra)
        if seconds < floor:
            seconds = floor
        return seconds if seconds >= 1 else 1  # max(1, floor, round(ra)), without the call

    def grpc_details(self) -> str:
        """The status details of a gRPC refusal: the detail, and the degraded modes."""
        if self.degraded:
            return f"{self.detail} (degraded: {', '.join(self.degraded)})"
        return self.detail


def retry_after_window(estimate: float, jitter: float, u: float) -> int:
    """``Retry-After`` in whole seconds for an ``estimate`` (seconds), a ``jitter`` fraction and
    a uniform random ``u`` in ``[0, 1)``: uniform over the whole seconds of
    ``[ceil(estimate), ceil(estimate * (1 + jitter)) + 1]`` (at least 1; without jitter the
    estimate rounded up). Whole seconds would otherwise erase a sub-second jitter: for 0.3 s
    every refusal said 1 and its callers came back within the same second. The ``+ 1`` spreads
    them over the next second too; the mean stays below ``estimate * (1 + jitter / 2) + 2``.
    Taking the same ``u`` as the jittered estimate keeps the header and gRPC's pushback in
    milliseconds in the same order."""
    if not estimate <= _RETRY_AFTER_CAP:  # (and NaN: an estimate nobody can act on)
        estimate = _RETRY_AFTER_CAP if estimate > 0.0 else 0.0
    lo = math.ceil(estimate) if estimate > 1.0 else 1
    if not jitter > 0.0:
        return lo
    hi = math.ceil(estimate * (1.0 + jitter)) + 1
    if hi > _RETRY_AFTER_CAP:
        hi = _RETRY_AFTER_CAP
    if hi <= lo:  # (an estimate so large that the product rounds to it)
        return lo
    seconds = lo + int(u * (hi - lo + 1))
    return seconds if seconds <= hi else hi


def problem_body(
    reason: Reason,
    status: int,
    *,
    detail: str | None = None,
    degraded: tuple[str, ...] = (),
    do_not_retry: bool = False,
) -> bytes:
    """Render an RFC 9457 ``application/problem+json`` document naming the reason."""
    doc: dict[str, Any] = {
        "type": f"urn:brownout:reason:{reason.value}",
        "title": http.HTTPStatus(status).phrase,
        "status": status,
        "detail": detail if detail is not None else DETAILS.get(reason, reason.value),
        "reason": reason.value,
    }
    if do_not_retry:
        doc["retry"] = "never"
    if degraded:
        doc["degraded"] = list(degraded)
    return json.dumps(doc, separators=(",", ":")).encode()


def refusal_headers(refusal: Refusal) -> list[tuple[str, str]]:
    """The HTTP headers of a refusal, names in lower case, without ``content-length``:
    the problem content type, ``retry-after`` (only with an estimate), ``brownout-retry:
    never``, ``brownout-degraded`` and the quota's RateLimit headers."""
    headers = [("content-type", PROBLEM_CONTENT_TYPE)]
    retry_after = refusal.retry_after_header()
    if retry_after is not None:
        headers.append(("retry-after", retry_after))
    if refusal.do_not_retry:
        headers.append((RETRY_HEADER, DO_NOT_RETRY_VALUE))
    if refusal.degraded:
        headers.append((DEGRADED_HEADER, ", ".join(refusal.degraded)))
    if refusal.quota is not None:
        headers.extend((k.lower(), v) for k, v in ratelimit_headers(refusal.quota).items())
    return headers


def refusal_trailers(refusal: Refusal) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a gRPC refusal: ``brownout-reason``, the pushback
    (``-1``: do not retry; else the jittered estimate in ms) and ``brownout-degraded``."""
    out = [(REFUSAL_REASON_KEY, refusal.reason.value)]
    if refusal.do_not_retry:
        out.append((GRPC_PUSHBACK_KEY, "-1"))
    elif refusal.retry_after is not None:
        out.append((GRPC_PUSHBACK_KEY, str(int(refusal.retry_after * 1000))))
    if refusal.degraded:
        out.append((DEGRADED_HEADER, ", ".join(refusal.degraded)))
    return tuple(out)


def ratelimit_headers(decision: Any) -> dict[str, str]:
    """RateLimit headers for a quota decision, without Retry-After (the edge jitters its own).

    A decision that renders its own headers (``headers()``, e.g. `brownout.QuotaDecision`: the
    IETF draft's ``RateLimit`` / ``RateLimit-Policy``) is used as is; otherwise the protocol's
    ``limit`` / ``remaining`` / ``reset`` fields become ``RateLimit-Limit/Remaining/Reset``.
    """
    render = getattr(decision, "headers", None)
    if callable(render):
        return {k: v for k, v in render().items() if k.lower() != "retry-after"}
    out: dict[str, str] = {}
    limit = getattr(decision, "limit", None)
    remaining = getattr(decision, "remaining", None)
    reset = getattr(decision, "reset", None)
    if limit is not None:
        out["RateLimit-Limit"] = str(int(limit))
    if remaining is not None:
        out["RateLimit-Remaining"] = str(max(0, int(remaining)))
    if reset is not None:
        out["RateLimit-Reset"] = str(max(0, math.ceil(reset)))
    return out


def announced_modes(modes: ActiveModes, marks: Sequence[str] | None) -> tuple[str, ...]:
    """The degraded modes a response names in ``brownout-degraded`` (G2), read as it leaves:
    those active now, then any whose fallback answered the request (``marks``, the
    `brownout._degrade.markers.served_by_fallback` list) and has ended since."""
    names = modes.active_names()
    if marks:
        names += tuple(m for m in dict.fromkeys(marks) if m not in names)
    return names
