"""What the blocking HTTP clients (requests, urllib3) share: one request as one
`Dependency.call_blocking`, and each attempt's headers, timeouts and outcome.

Both send through urllib3, so a failure is read once, here: a connection that was never made
(refused, a connect timeout, DNS) proves nothing was sent; anything after it (a read timeout,
a reset, a server that hung up) may have been applied. The rules themselves (which methods are
safe, which answers the retry layer sees, what the caller gets) are `brownout._retry.outbound`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

try:
    import urllib3
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "urllib3", e) from e

from .._context import current, current_deadline
from .._dependency import Dependency
from .._propagation import IDEMPOTENCY_HEADER, BudgetSigner, outbound_headers
from .._retry.classify import ResponseError, RetriesExhausted, TransientError
from .._retry.outbound import answer_for_caller, is_idempotent

__all__ = [
    "BlockingClient",
    "attempt_headers",
    "attempt_timeouts",
    "failed_attempt",
    "never_sent",
]

R = TypeVar("R")


class BlockingClient:
    """The settings both blocking adapters take, and their one call per request."""

    __slots__ = ("dependency", "errors", "return_exhausted", "safe_methods", "signer")

    def __init__(
        self,
        dependency: Dependency | None,
        *,
        errors: type[Exception],
        name: str,
        safe_methods: Collection[str],
        signer: BudgetSigner | None,
        return_exhausted: bool,
    ) -> None:
        self.dependency = dependency if dependency is not None else Dependency(name)
        self.safe_methods = frozenset(m.upper() for m in safe_methods)
        self.signer = signer
        self.return_exhausted = return_exhausted
        self.errors = errors

    def send(
        self,
        method: str,
        headers: Mapping[str, Any] | None,
        kind: type[R],
        attempt: Callable[..., R],
        *args: Any,
        idempotent: bool | None = None,
    ) -> R:
        """``attempt(*args)`` as one `Dependency.call_blocking`: the method rule (or
        ``idempotent``) decides whether it is a mutation, whose key is the request's own
        ``Idempotency-Key`` when it has one. An answer this layer does not retry (a 404, a
        500 without retries) is returned as ``kind``; so is the last one of
        `RetriesExhausted` with ``return_exhausted``. A transport failure the dependency
        does not retry is the client's own error (one of ``errors``), as without brownout."""
        safe = is_idempotent(method.upper(), self.safe_methods, idempotent)
        key = None if safe or headers is None else headers.get(IDEMPOTENCY_HEADER)
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        try:
            return self.dependency.call_blocking(
                attempt, *args, idempotent=safe, idempotency_key=key
            )
        except (ResponseError, RetriesExhausted) as error:
            answer = answer_for_caller(error, kind, return_exhausted=self.return_exhausted)
            if answer is None:
                raise
            return answer
        except TransientError as error:
            cause = error.__cause__
            if isinstance(cause, self.errors):
                raise cause from None
            raise

    def headers(self) -> dict[str, str]:
        return attempt_headers(self.signer)


def attempt_headers(signer: BudgetSigner | None = None) -> dict[str, str]:
    """The headers of the attempt running now: its budget, priority, number and key."""
    # Inside an attempt the context's deadline already is the attempt's budget.
    return outbound_headers(ctx=current(), signer=signer)


def attempt_timeouts(
    connect: float | None, read: float | None
) -> tuple[float | None, float | None]:
    """The caller's ``(connect, read)`` timeouts capped at the attempt's budget (the smaller
    one wins; ``None``: no bound of the caller's)."""
    deadline = current_deadline()
    if deadline is None:
        return connect, read
    budget = deadline.remaining()
    budget = budget if budget > 0.0 else 0.0
    return (
        budget if connect is None or connect > budget else connect,
        budget if read is None or read > budget else read,
    )


def never_sent(error: BaseException) -> bool:
    """Whether urllib3's ``error`` (or one it wraps) proves the request never left: the
    connection was never made (refused, timed out, a name that does not resolve)."""
    if isinstance(error, urllib3.exceptions.MaxRetryError) and error.reason is not None:
        error = error.reason
    return isinstance(error, urllib3.exceptions.ConnectTimeoutError)


def failed_attempt(error: BaseException, *, sent: bool) -> TransientError:
    """The retry layer's view of a transport failure (``sent``: it may have been applied)."""
    return TransientError(f"{type(error).__name__}: {error}", sent=sent)
