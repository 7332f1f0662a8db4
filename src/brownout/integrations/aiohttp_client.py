"""aiohttp client middleware: every request through a `Dependency` (D2, D4, D5, D6, R1-R5).

::

    session = aiohttp.ClientSession(middlewares=(BrownoutClientMiddleware(payments),))

Uses aiohttp's client middlewares (aiohttp 3.12+). Behaves like the httpx adapter
(`brownout.integrations.httpx`): each attempt gets its budget from the dependency
(``min(timeout, remaining - reserve)``), refused with `brownout.Rejected`
(``DEADLINE_TOO_SHORT``) before anything is sent when too little is left; it sends the budget
(``brownout-budget-ms``), priority, attempt number and idempotency key; the dependency's
deadline scope cancels the attempt at the end of its budget (a middleware cannot change the
session's ``ClientTimeout``, whose timer is already running; cancellation is the stronger
bound). 429/502/503/504 are retried with ``Retry-After`` honoured, ``brownout-retry: never``
is never retried, connection failures before sending are transient, and a mutation (any
method but GET, HEAD, OPTIONS, TRACE) that was sent and never answered raises
`brownout.UnknownOutcome` with its idempotency key.

The caller gets the response for answers this layer does not retry, and
`brownout._retry.RetriesExhausted` when it retried and gave up (``return_exhausted=True``
returns the last response instead). Error responses (5xx, 429) are read before they are
returned, which frees their connection for the retry.
"""

from __future__ import annotations

from collections.abc import Collection

try:
    from aiohttp import (
        ClientConnectionError,
        ClientConnectorError,
        ClientHandlerType,
        ClientPayloadError,
        ClientRequest,
        ClientResponse,
        ConnectionTimeoutError,
    )
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "aiohttp", e) from e

from .._dependency import Dependency
from .._propagation import (
    IDEMPOTENCY_HEADER,
    BudgetSigner,
    outbound_headers,
)
from .._retry.classify import ResponseError, RetriesExhausted, TransientError
from .._retry.outbound import (
    SAFE_METHODS,
    answer_for_caller,
    http_answer_error,
    is_idempotent,
    needs_retry_layer,
)

__all__ = ["SAFE_METHODS", "BrownoutClientMiddleware"]

# Failures that prove the request never left this process: resending cannot apply it twice.
_NOT_SENT = (ClientConnectorError, ConnectionTimeoutError)
# Failures after the request may have reached the server (includes the socket read timeout).
_MAYBE_SENT = (ClientConnectionError, ClientPayloadError)


class BrownoutClientMiddleware:
    """An aiohttp client middleware applying a `Dependency`'s budget, guards and retries.

    ``dependency``: the downstream's `Dependency` (default: one named ``name`` with no timeout
    and no retries, which still propagates deadlines and records unknown outcomes).
    ``safe_methods``: methods treated as free of side effects. ``signer``: also send a signed
    budget for a callee outside the trust boundary (D3).
    """

    __slots__ = ("dependency", "return_exhausted", "safe_methods", "signer")

    def __init__(
        self,
        dependency: Dependency | None = None,
        *,
        name: str = "http",
        safe_methods: Collection[str] = SAFE_METHODS,
        signer: BudgetSigner | None = None,
        return_exhausted: bool = False,
    ) -> None:
        self.dependency = dependency if dependency is not None else Dependency(name)
        self.safe_methods = frozenset(m.upper() for m in safe_methods)
        self.signer = signer
        self.return_exhausted = return_exhausted

    async def __call__(self, request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        idempotent = is_idempotent(request.method, self.safe_methods)
        key = None if idempotent else request.headers.get(IDEMPOTENCY_HEADER)
        try:
            return await self.dependency.call(
                self._attempt, request, handler, idempotent=idempotent, idempotency_key=key
            )
        except (ResponseError, RetriesExhausted) as error:
            answer = answer_for_caller(
                error, ClientResponse, return_exhausted=self.return_exhausted
            )
            if answer is None:
                raise
            return answer

    async def _attempt(self, request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        # Inside an attempt the context's deadline already is the attempt's budget.
        request.headers.update(outbound_headers(signer=self.signer))
        try:
            response = await handler(request)
        except _NOT_SENT as e:
            raise TransientError(f"{type(e).__name__}: {e}", sent=False) from e
        except _MAYBE_SENT as e:
            raise TransientError(f"{type(e).__name__}: {e}", sent=True) from e
        if not needs_retry_layer(response.status):
            return response
        try:
            # Reading to the end frees the connection for a retry and keeps the body for the
            # caller; release() would too, but then aiohttp refuses to read the body at all.
            await response.read()
        except _MAYBE_SENT as e:  # lost while reading the answer: as if lost before it
            response.release()
            raise TransientError(f"{type(e).__name__}: {e}", sent=True) from e
        except BaseException:
            response.release()
            raise
        raise http_answer_error(response.status, response.headers, response)
