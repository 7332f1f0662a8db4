"""Which failures are worth another attempt (R2), expressed without any client library.

The core never imports httpx or grpc. Adapters translate what their library saw into one of
two exceptions, and the retry policy classifies those (plus a few standard-library errors):

* `TransientError`: a failure worth retrying that produced no answer, e.g. a connection
  refused before anything was sent (``sent=False``) or a connection lost mid-request.
* `ResponseError`: the dependency *answered* with a failure status (HTTP status and/or gRPC
  code), with its pushback: ``Retry-After`` / ``grpc-retry-pushback-ms`` and the do-not-retry
  marker (``brownout-retry: never``, or a negative pushback).

A classifier maps an exception to a `Failure`: transient or not, whether the request may have
been sent, whether the server answered (an answer means the outcome is known), and the
server's pushback. Users extend classification with their own callable, consulted first.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from .._errors import BrownoutError, DeadlineExceeded, Reason, Rejected
from .._propagation import DO_NOT_RETRY_VALUE, GRPC_PUSHBACK_KEY, RETRY_HEADER

__all__ = [
    "RETRYABLE_GRPC_CODES",
    "RETRYABLE_HTTP_STATUSES",
    "Failure",
    "FailureClassifier",
    "ResponseError",
    "RetriesExhausted",
    "StopReason",
    "TransientError",
    "classify",
    "parse_pushback",
]

RETRYABLE_HTTP_STATUSES: frozenset[int] = frozenset({429, 502, 503, 504})
"""HTTP statuses that say "try again later": throttled, bad gateway, unavailable, gateway
timeout. Every other 4xx (validation, conflict, not found) and 500 are not retried."""
RETRYABLE_GRPC_CODES: frozenset[str] = frozenset({"UNAVAILABLE"})
"""gRPC codes retried by default (R2): UNAVAILABLE only; never FAILED_PRECONDITION,
INVALID_ARGUMENT and the like."""
_REFUSED_HTTP = frozenset({429, 503})  # the server refused the work: it was not applied
_GATEWAY_TIMEOUT = 504


class TransientError(BrownoutError):
    """A failure worth retrying that produced no answer from the dependency.

    ``sent=False`` means the request certainly never left (connection refused, DNS failure),
    so even a non-idempotent call may be resent. ``sent=True`` (the default) means it may have
    reached the server: only idempotent or keyed calls are retried, and a mutation ending this
    way has an unknown outcome (D6).
    """

    def __init__(
        self, detail: str = "", *, sent: bool = True, retry_after: float | None = None
    ) -> None:
        super().__init__(detail or "transient failure")
        self.sent = sent
        self.retry_after = retry_after


class ResponseError(BrownoutError):
    """The dependency answered with a failure: an HTTP ``status`` and/or a gRPC ``grpc_code``.

    ``retry_after`` is the server's pushback in seconds (``Retry-After``,
    ``grpc-retry-pushback-ms``); ``do_not_retry`` is its "never retry" marker (R1).
    ``response`` keeps the library's response object for the caller.
    ``answered=False``: the status was made up by the client library, not sent by the
    dependency (grpc reports a connection lost mid-call as ``UNAVAILABLE``): the request may
    have been applied (R2, D6).
    """

    def __init__(
        self,
        status: int | None = None,
        *,
        grpc_code: str | None = None,
        retry_after: float | None = None,
        do_not_retry: bool = False,
        response: object = None,
        detail: str = "",
        answered: bool = True,
    ) -> None:
        what = f"HTTP {status}" if status is not None else f"gRPC {grpc_code}"
        super().__init__(f"{what}: {detail}" if detail else what)
        self.status = status
        self.grpc_code = grpc_code
        self.retry_after = retry_after
        self.do_not_retry = do_not_retry
        self.response = response
        self.answered = answered


class Failure:
    """How the retry policy sees one failed attempt."""

    __slots__ = ("answered", "do_not_retry", "retry_after", "sent", "transient")

    def __init__(
        self,
        *,
        transient: bool,
        sent: bool = True,
        answered: bool = False,
        retry_after: float | None = None,
        do_not_retry: bool = False,
    ) -> None:
        self.transient = transient
        """Another attempt may succeed."""
        self.sent = sent
        """The request may have reached the dependency (and been applied)."""
        self.answered = answered
        """The dependency answered, so the outcome is known (not applied, or failed)."""
        self.retry_after = retry_after
        """Server pushback: wait at least this long before retrying."""
        self.do_not_retry = do_not_retry
        """The server (or a lower retry layer) asked not to retry at all."""

    @property
    def outcome_unknown(self) -> bool:
        """Sent but unanswered: a mutation in this state may or may not have been applied."""
        return self.sent and not self.answered

    def __repr__(self) -> str:
        return (
            f"Failure(transient={self.transient}, sent={self.sent}, answered={self.answered}, "
            f"retry_after={self.retry_after}, do_not_retry={self.do_not_retry})"
        )


FailureClassifier = Callable[[BaseException], "Failure | None"]
"""A user classifier: a `Failure` for errors it knows, ``None`` to fall back to `classify`."""

_NOT_SENT = Failure(transient=True, sent=False)
_LOST = Failure(transient=True, sent=True)
_PERMANENT = Failure(transient=False, sent=True, answered=True)
_LOCAL = Failure(transient=False, sent=False, answered=True)
_LOWER_LAYER_GAVE_UP = Failure(transient=False, sent=True, answered=True, do_not_retry=True)


def classify(error: BaseException) -> Failure:
    """The default classification (R2).

    Transient: `TransientError`; `ResponseError` with HTTP 429/502/503/504 or gRPC
    UNAVAILABLE (a 504 is a gateway's: sent and unanswered, its outcome unknown); connection
    refused (not sent); connection reset/aborted and timeouts (sent, unanswered). Not
    transient: every other answer (4xx validation, 500, FAILED_PRECONDITION,
    INVALID_ARGUMENT), local refusals (`Rejected`), and any other exception.
    ``asyncio.CancelledError`` is never retried (the policy does not even catch it). A
    `Rejected` with ``DO_NOT_RETRY`` (a lower retry layer already gave up) stops retries.
    """
    if isinstance(error, ResponseError):
        transient = (error.status is not None and error.status in RETRYABLE_HTTP_STATUSES) or (
            error.grpc_code is not None and error.grpc_code in RETRYABLE_GRPC_CODES
        )
        # A gateway's 504 says only that its upstream did not answer in time: the mutation
        # behind it may have been applied, so its outcome is unknown (D6), not known.
        answered = error.answered and error.status != _GATEWAY_TIMEOUT
        return Failure(
            transient=transient,
            sent=not answered
            or (error.status not in _REFUSED_HTTP and error.grpc_code != "UNAVAILABLE"),
            answered=answered,
            retry_after=error.retry_after,
            do_not_retry=error.do_not_retry,
        )
    if isinstance(error, TransientError):
        if error.retry_after is None:
            return _LOST if error.sent else _NOT_SENT
        return Failure(transient=True, sent=error.sent, retry_after=error.retry_after)
    if isinstance(error, Rejected):
        return _LOWER_LAYER_GAVE_UP if error.reason is Reason.DO_NOT_RETRY else _LOCAL
    if isinstance(error, ConnectionRefusedError):
        return _NOT_SENT
    if isinstance(error, (DeadlineExceeded, TimeoutError, ConnectionError, EOFError)):
        return _LOST
    if isinstance(error, asyncio.CancelledError):  # pragma: no cover - BaseException anyway
        return _LOCAL
    return _PERMANENT


_PUSHBACK_MAX_MS = 2**31 - 1
"""The largest ``grpc-retry-pushback-ms`` gRPC reads (a 32-bit integer); beyond it the value is
unparseable, which gRFC A6 reads as "do not retry"."""
_RETRY_AFTER_CAP = 2**31
"""RFC 9111 (delta-seconds): a value too large to represent is read as 2^31 seconds."""
_OWS = " \t"


def _header_text(value: object) -> str | None:
    """A header value as ASCII text without surrounding whitespace; ``None`` if it is not."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("latin-1")  # what httpx does with header bytes
    if not isinstance(value, str) or not value.isascii():
        return None
    return value.strip(_OWS)


def _decimal(text: str, limit: int) -> int | None:
    """``text`` as a decimal integer, ``limit + 1`` if it is larger than ``limit``; ``None``
    unless it is ASCII digits only. Stricter than ``int()``, which takes ``+``, ``-``, ``_``,
    non-ASCII digits and spaces, and cheap on a value of 100,000 digits."""
    if not text.isdigit():  # (ASCII already checked, and "" is not digits)
        return None
    significant = text.lstrip("0")
    if len(significant) > len(str(limit)):
        return limit + 1
    return min(int(significant or "0"), limit + 1)


def _grpc_pushback(value: object) -> tuple[float | None, bool]:
    text = _header_text(value)
    if text is None:
        return None, True
    ms = _decimal(text, _PUSHBACK_MAX_MS)
    if ms is None or ms > _PUSHBACK_MAX_MS:  # negative or malformed, or too large
        return None, True
    return ms / 1000.0, False


def _retry_after(value: object) -> float | None:
    text = _header_text(value)
    if text is None:
        return None
    seconds = _decimal(text, _RETRY_AFTER_CAP)
    if seconds is not None:
        return float(min(seconds, _RETRY_AFTER_CAP))
    try:
        when = email.utils.parsedate_to_datetime(text)
        if when.tzinfo is None:  # RFC 5322's "-0000": UTC, not this machine's local time
            when = when.replace(tzinfo=datetime.UTC)
        # An HTTP date is wall-clock by definition: this is its one meaningful reading.
        delay = when.timestamp() - time.time()
    except (TypeError, ValueError, OverflowError, IndexError):
        return None  # not a date (email.utils raises any of these on malformed input)
    return min(max(0.0, delay), float(_RETRY_AFTER_CAP))


def _values(headers: Mapping[str, Any], name: str) -> list[object]:
    """Every value of header ``name``: a multidict's ``getall`` (aiohttp), httpx's
    ``get_list``, else ``get``, whose value may itself be a list or tuple (gRPC metadata)."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, ()))
    get_list = getattr(headers, "get_list", None)
    if get_list is not None:
        return list(get_list(name))
    value = headers.get(name)
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _elements(values: list[object]) -> list[str | None]:
    """The comma-separated elements of every value (RFC 9110 lists); ``None`` for a value
    that is not ASCII text."""
    out: list[str | None] = []
    for value in values:
        text = _header_text(value)
        if text is None:
            out.append(None)
        else:
            out.extend(part.strip(_OWS) for part in text.split(","))
    return out


def _longest_retry_after(values: list[object]) -> float | None:
    waits: list[float] = []
    for value in values:
        wait = _retry_after(value)
        if wait is None:  # a list joined with commas (an HTTP date has a comma of its own)
            text = _header_text(value) or ""
            parts = [_retry_after(part) for part in text.split(",")] if "," in text else []
            waits.extend(w for w in parts if w is not None)
        else:
            waits.append(wait)
    return max(waits) if waits else None


def parse_pushback(headers: Mapping[str, Any]) -> tuple[float | None, bool]:
    """Read a response's pushback: ``(retry_after_seconds or None, do_not_retry)``.

    Honours ``brownout-retry: never``; ``grpc-retry-pushback-ms`` (gRFC A6: a non-negative
    decimal integer of milliseconds; a negative, malformed or unparseable one, including one
    beyond gRPC's 32-bit range, means do not retry); ``Retry-After`` as delta-seconds or an
    HTTP date, capped at 2^31 seconds (RFC 9111) and ignored when it is neither.
    Repeated headers (several lines, or one comma-joined line): ``never`` in any element
    wins; of several pushbacks the longest wait wins, and any unparseable gRPC pushback means
    do not retry. ``headers`` is a mapping with lower-case keys (httpx, grpc metadata) or a
    case-insensitive multidict (aiohttp); a value may be a list of the header's values.
    Total: any value, ``str`` or ``bytes``, gives an answer; it never raises, and a
    ``retry_after`` is always finite, between 0 and 2^31.
    """
    markers = _elements(_values(headers, RETRY_HEADER))
    if any(m is not None and m.lower() == DO_NOT_RETRY_VALUE for m in markers):
        return None, True
    pushbacks = _elements(_values(headers, GRPC_PUSHBACK_KEY))
    if pushbacks:
        longest = 0.0
        for element in pushbacks:
            wait, never = _grpc_pushback(element)
            if never or wait is None:
                return None, True
            longest = max(longest, wait)
        return longest, False
    return _longest_retry_after(_values(headers, "retry-after")), False


class StopReason(StrEnum):
    """Why the retry layer stopped retrying a transient failure."""

    ATTEMPTS = "attempts"
    """The attempt limit was reached."""
    BUDGET = "budget"
    """The retry budget had no tokens (R3)."""
    DEADLINE = "deadline"
    """Backoff + expected attempt time + reserve would not fit the remaining deadline (R4)."""
    DO_NOT_RETRY = "do_not_retry"
    """The dependency (or a lower retry layer) asked not to retry (R1)."""
    CONCURRENT_RETRIES = "concurrent_retries"
    """Too many calls to this dependency were already retrying (A6)."""
    PUSHBACK = "pushback"
    """The dependency asked to wait longer than the policy's ``max_pushback``."""
    REFUSED = "refused"
    """A local guard (breaker, throttle, bulkhead, deadline) refused the retry attempt."""


class RetriesExhausted(Rejected):
    """The retry layer gave up on a transient failure: callers upstream must NOT retry (R1).

    A `Rejected` with ``Reason.DO_NOT_RETRY``: edges answer it with 503 and the do-not-retry
    marker (``brownout-retry: never`` / ``grpc-retry-pushback-ms: -1``), so only one layer
    retries. ``error`` is the original failure (also ``__cause__``), ``response`` the library
    response when the failure was an answer, ``attempts`` how many attempts were sent, and
    ``stopped_by`` why retrying stopped.
    """

    def __init__(self, error: BaseException, *, attempts: int, stopped_by: StopReason) -> None:
        super().__init__(
            Reason.DO_NOT_RETRY,
            f"gave up after {attempts} attempt(s) ({stopped_by.value}): {error!r}",
        )
        self.error = error
        self.attempts = attempts
        self.stopped_by = stopped_by

    @property
    def response(self) -> object:
        """The dependency's response object, when the last failure was an answer."""
        return self.error.response if isinstance(self.error, ResponseError) else None
