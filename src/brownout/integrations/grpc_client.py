"""grpc.aio client interceptor: calls through a `Dependency` (D3, D4, D5, D6, R1-R5).

::

    channel = grpc.aio.insecure_channel(
        target, interceptors=brownout_interceptors(payments, idempotent_methods={...})
    )

(grpc.aio files each interceptor object under one call kind only, so
`brownout_interceptors` returns one per kind: `BrownoutClientInterceptor` for unary-unary and
the three streaming ones, sharing the dependency.)

Unary-unary calls run as one `Dependency.call` each; every attempt:

- gets its budget from the dependency (``min(timeout, remaining - reserve)``); too little time
  left raises `brownout.Rejected` (``DEADLINE_TOO_SHORT``) before anything is sent;
- is sent with the call's timeout set to that budget (gRPC carries it as ``grpc-timeout``,
  D3) and metadata ``brownout-priority``, ``brownout-attempt`` and ``idempotency-key``;
- is classified: ``UNAVAILABLE`` is retried, honouring ``grpc-retry-pushback-ms`` from the
  trailing metadata (negative: never retry, R1); ``DEADLINE_EXCEEDED`` is a sent, unanswered
  attempt (retried only for idempotent or keyed calls; a mutation ending so raises
  `brownout.UnknownOutcome`); every other code (``FAILED_PRECONDITION``,
  ``INVALID_ARGUMENT``, ...) is raised unchanged as the `grpc.aio.AioRpcError` it was.

gRPC has no safe methods: a call is a mutation (keyed, and an unknown outcome when sent and
unanswered) unless its full name (``/pkg.Service/Method``) is in ``idempotent_methods``.
When this layer retried and gave up, the call raises `brownout._retry.RetriesExhausted`; the
edge interceptor turns it into ``UNAVAILABLE`` with ``grpc-retry-pushback-ms: -1`` so callers
upstream do not retry again.

Streaming calls get the budget, timeout and metadata (and are refused before sending when too
little time is left) but are neither retried nor counted by the breaker or bulkhead: a stream
cannot be replayed, and it outlives the interceptor.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

try:
    import grpc
    import grpc.aio
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "grpc", e) from e

from .._context import RequestContext, current
from .._dependency import Dependency
from .._errors import DeadlineExceeded
from .._propagation import (
    ATTEMPT_HEADER,
    GRPC_PUSHBACK_KEY,
    IDEMPOTENCY_HEADER,
    PRIORITY_HEADER,
    REFUSAL_REASON_KEY,
    context_headers,
    note_outbound,
)
from .._retry.classify import ResponseError, TransientError, parse_pushback
from .._retry.outbound import answer_for_caller, attempt_budget

__all__ = [
    "BrownoutClientInterceptor",
    "BrownoutStreamStreamInterceptor",
    "BrownoutStreamUnaryInterceptor",
    "BrownoutUnaryStreamInterceptor",
    "brownout_interceptors",
]

_OURS = frozenset({ATTEMPT_HEADER, IDEMPOTENCY_HEADER, PRIORITY_HEADER})


def _method_name(method: str | bytes) -> str:
    return method.decode("ascii", "replace") if isinstance(method, bytes) else method


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    if metadata is None:
        return None
    for item in metadata:
        if item[0] == key:
            value = item[1]
            return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return None


_NEVER_CONNECTED = ("failed to connect to all addresses", "DNS resolution failed")
"""How grpc words an UNAVAILABLE for a call that never left the client. Any other
UNAVAILABLE without a server's pushback may be a connection lost mid-call (grpc says
"Stream removed (Socket closed)" when the server dies in the handler): gRPC's status code
guide warns it is not always safe to retry non-idempotent calls then, so such a call counts
as sent and unanswered (R2: an unkeyed mutation is not resent; D6: its outcome is unknown)."""


def _rpc_failure(error: grpc.aio.AioRpcError) -> Exception:
    """Translate a finished call's error for the retry policy."""
    code = error.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransientError(f"DEADLINE_EXCEEDED: {error.details()}", sent=True)
    trailers = error.trailing_metadata()
    pushback = _metadata_value(trailers, GRPC_PUSHBACK_KEY)
    retry_after, never = (
        parse_pushback({GRPC_PUSHBACK_KEY: pushback}) if pushback is not None else (None, False)
    )
    detail = error.details() or ""
    return ResponseError(
        grpc_code=code.name,
        retry_after=retry_after,
        do_not_retry=never,
        response=error,
        detail=detail,
        answered=code is not grpc.StatusCode.UNAVAILABLE
        or pushback is not None
        or _metadata_value(trailers, REFUSAL_REASON_KEY) is not None
        or detail.startswith(_NEVER_CONNECTED),
    )


_CUT_SLACK = 0.005
"""How late after its grpc-timeout a DEADLINE_EXCEEDED may be seen and still be this
attempt's own deadline (the loop's turn, the server's answer on loopback)."""


def _wire_allowance(budget: float) -> float:
    """What to take off ``budget`` seconds before giving it to grpc as ``timeout=``, so that
    the ``grpc-timeout`` it sends is not longer (D1: a hop never gets more time than its
    caller has left).

    grpc core rounds a timeout *up* when it writes the header: to the next millisecond, then
    to 10 ms from 1 s, to 100 ms from 10 s, to whole seconds from 100 s, to 10 s from 1,000 s
    (grpc's ``Timeout::FromMillis``), and so on, each step at most a hundredth of the value. A
    server therefore sees up to one step plus a millisecond more than the client asked for:
    1.0 s arrives as 1.009 s, 60 s as 60.099 s, 1,000.5 s as 1,009.999 s (grpcio 1.85 on
    loopback). Taking that step off first keeps the callee within the caller's deadline, at a
    cost of at most the same step."""
    step = 0.001
    while budget >= step * 1000 and step < 1e9:  # (an infinite budget stops at 1e9 s)
        step *= 10
    allowance = step + 0.001
    return allowance if budget > 2 * allowance else budget / 2


def _wire_timeout(budget: float) -> float:
    """The ``timeout=`` to give grpc for ``budget`` seconds (see `_wire_allowance`)."""
    return budget - _wire_allowance(budget)


def _details(
    details: grpc.aio.ClientCallDetails, ctx: RequestContext, timeout: float | None
) -> grpc.aio.ClientCallDetails:
    """The call details of one attempt: timeout capped at the budget (less what grpc adds on
    the wire), brownout metadata."""
    if timeout is not None:
        timeout = _wire_timeout(timeout)
    if details.timeout is not None and (timeout is None or details.timeout < timeout):
        timeout = details.timeout
    note_outbound(ctx, timeout)  # (tracing: the budget on the span, `enable_tracing`)
    metadata = grpc.aio.Metadata()
    if details.metadata is not None:
        for k, v in details.metadata:
            if k not in _OURS:
                metadata.add(k, v)
    for k, v in context_headers(ctx).items():
        metadata.add(k, v)
    return grpc.aio.ClientCallDetails(
        details.method, timeout, metadata, details.credentials, details.wait_for_ready
    )


class BrownoutClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Runs each unary-unary call through a `Dependency`: budget, guards, retries (R1-R5).

    ``dependency``: the downstream's `Dependency` (default: one named ``name``, no timeout,
    no retries). ``idempotent_methods``: full method names safe to repeat without a key.
    """

    def __init__(
        self,
        dependency: Dependency | None = None,
        *,
        name: str = "grpc",
        idempotent_methods: Collection[str] = (),
    ) -> None:
        self.dependency = dependency if dependency is not None else Dependency(name)
        self.idempotent_methods = frozenset(idempotent_methods)

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        method = _method_name(client_call_details.method)
        try:
            return await self.dependency.call(
                self._attempt,
                continuation,
                client_call_details,
                request,
                idempotent=method in self.idempotent_methods,
                idempotency_key=_metadata_value(client_call_details.metadata, IDEMPOTENCY_HEADER),
            )
        except (ResponseError, TransientError) as error:
            # The caller sees gRPC's own error for what this layer does not retry.
            answer = answer_for_caller(error, grpc.aio.AioRpcError)
            if answer is None:
                raise
            raise answer from None

    @staticmethod
    async def _attempt(
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        ctx = current()
        deadline = ctx.deadline
        timeout = deadline.remaining() if deadline is not None else None
        call = await continuation(_details(details, ctx, timeout), request)
        try:
            await call
        except grpc.aio.AioRpcError as error:
            if (
                error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                and deadline is not None
                and timeout is not None
                and deadline.remaining() <= _wire_allowance(timeout) + _CUT_SLACK
            ):
                # The grpc-timeout we sent ran out, one rounding step before the attempt's
                # budget (`_wire_timeout`): the attempt's deadline expired, as the deadline
                # scope would report a moment later. Raised as such, so that callers (and
                # the edge above: 504, counted expired) see the same as on the HTTP clients.
                raise DeadlineExceeded("the deadline expired; the call was cut") from error
            raise _rpc_failure(error) from error
        return call  # finished: awaiting it again gives the response; metadata stays readable


class _StreamingBudget:
    """Streaming calls: the dependency's budget as timeout, metadata, refusal before sending."""

    def __init__(self, dependency: Dependency) -> None:
        self.dependency = dependency

    def _stream_details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        dep = self.dependency
        ctx = current()
        # The same budget a unary attempt gets from the dependency (`attempt_budget`).
        budget = attempt_budget(
            dep.timeout, reserve=dep.reserve, min_useful=dep.min_useful, deadline=ctx.deadline
        )
        return _details(details, ctx, budget)


class BrownoutUnaryStreamInterceptor(_StreamingBudget, grpc.aio.UnaryStreamClientInterceptor):
    """Unary-stream calls: budget as timeout, brownout metadata; not retried."""

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._stream_details(client_call_details), request)


class BrownoutStreamUnaryInterceptor(_StreamingBudget, grpc.aio.StreamUnaryClientInterceptor):
    """Stream-unary calls: budget as timeout, brownout metadata; not retried."""

    async def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._stream_details(client_call_details), request_iterator)


class BrownoutStreamStreamInterceptor(_StreamingBudget, grpc.aio.StreamStreamClientInterceptor):
    """Stream-stream calls: budget as timeout, brownout metadata; not retried."""

    async def intercept_stream_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._stream_details(client_call_details), request_iterator)


def brownout_interceptors(
    dependency: Dependency | None = None,
    *,
    name: str = "grpc",
    idempotent_methods: Collection[str] = (),
) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind, sharing ``dependency``: pass them all to the channel."""
    unary = BrownoutClientInterceptor(dependency, name=name, idempotent_methods=idempotent_methods)
    dep = unary.dependency
    return [
        unary,
        BrownoutUnaryStreamInterceptor(dep),
        BrownoutStreamUnaryInterceptor(dep),
        BrownoutStreamStreamInterceptor(dep),
    ]
