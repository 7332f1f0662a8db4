"""httpx client adapter: every request through a `Dependency` (D2, D4, D5, D6, R1-R5).

::

    client = httpx.AsyncClient(
        transport=BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=payments)
    )

`BrownoutTransport` wraps any ``httpx.AsyncBaseTransport`` and uses only its
``handle_async_request`` (the transport interface, so httpx2-style transports work too). Each
request is one `Dependency.call`; each attempt:

- gets its budget from the dependency (``min(timeout, remaining - reserve)``); too little time
  left raises `brownout.Rejected` (``DEADLINE_TOO_SHORT``) *before* anything is sent;
- sends that budget (``brownout-budget-ms``), the priority, the attempt number and the
  idempotency key, and caps httpx's connect/read/write/pool timeouts at the budget; the
  dependency's deadline scope cancels the attempt when its budget runs out;
- is classified for the retry policy: connection failures before sending are transient and
  safe to resend; 429/502/503/504 are retryable, with ``Retry-After`` honoured; a response
  carrying ``brownout-retry: never`` is never retried.

Methods other than GET, HEAD, OPTIONS and TRACE are mutations: they carry an idempotency key
(the request's own ``Idempotency-Key`` header, else the dependency's generated one, identical
on every attempt), and one that was sent and never answered raises `brownout.UnknownOutcome`
with its key (recorded in the dependency's ledger). A request may override the method rule with
``extensions={"brownout.idempotent": True}``.

What the caller sees: the response, for any answer this layer does not retry (a 404, a 500, or
a 503 from a dependency without retries); `brownout._retry.RetriesExhausted` when this layer
retried and gave up (its ``response`` is the last answer). Raising is deliberate: an edge
turns it into 503 + ``brownout-retry: never``, so the layers above do not retry again (R1).
``return_exhausted=True`` returns the last response instead. A mutation one of whose earlier
attempts was sent and never answered raises `brownout.UnknownOutcome` even when a later
attempt got an answer this layer does not retry (a 409 or a 500 says nothing of whether the
lost attempt was applied, D6).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

try:
    import httpx
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "httpx", e) from e

from .._context import current
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

__all__ = ["IDEMPOTENT_EXTENSION", "SAFE_METHODS", "BrownoutTransport", "SendsRequests"]

IDEMPOTENT_EXTENSION = "brownout.idempotent"
"""Request extension overriding the method rule for one request (``True``: no side effect)."""

_TIMEOUT_KEYS = ("connect", "read", "write", "pool")
# Failures that prove the request never left this process: resending cannot apply it twice.
_NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
)


class SendsRequests(Protocol):
    """The transport interface: one request in, one response out (httpx and httpx2 alike)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response: ...


class BrownoutTransport(httpx.AsyncBaseTransport):
    """An httpx transport applying a `Dependency`'s budget, guards and retries to requests.

    ``transport``: the transport that sends (anything with ``handle_async_request``).
    ``dependency``: the downstream's `Dependency` (default: one named ``name`` with no
    timeout and no retries, which still propagates deadlines and records unknown outcomes).
    ``safe_methods``: methods treated as free of side effects.
    ``signer``: also send a signed budget (``brownout-signed-budget``) for a callee outside the
    trust boundary (D3).
    """

    def __init__(
        self,
        transport: SendsRequests,
        *,
        dependency: Dependency | None = None,
        name: str = "http",
        safe_methods: Collection[str] = SAFE_METHODS,
        signer: BudgetSigner | None = None,
        return_exhausted: bool = False,
    ) -> None:
        self.transport = transport
        self.dependency = dependency if dependency is not None else Dependency(name)
        self.safe_methods = frozenset(m.upper() for m in safe_methods)
        self.signer = signer
        self.return_exhausted = return_exhausted

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        dep = self.dependency
        flag = request.extensions.get(IDEMPOTENT_EXTENSION)
        idempotent = is_idempotent(request.method, self.safe_methods, flag)
        if dep.retry.attempts > 1:
            await request.aread()  # a streamed body must be replayable before a retry
        # A safe request needs no key; skipping the header lookup keeps GETs cheap.
        key = None if idempotent else request.headers.get(IDEMPOTENCY_HEADER)
        try:
            return await dep.call(
                self._attempt, request, idempotent=idempotent, idempotency_key=key
            )
        except (ResponseError, RetriesExhausted) as error:
            answer = answer_for_caller(
                error, httpx.Response, return_exhausted=self.return_exhausted
            )
            if answer is None:
                raise
            return answer

    async def _attempt(self, request: httpx.Request) -> httpx.Response:
        ctx = current()
        # Inside an attempt the context's deadline already is the attempt's budget.
        request.headers.update(outbound_headers(ctx=ctx, signer=self.signer))
        deadline = ctx.deadline
        if deadline is not None:
            budget = deadline.remaining()
            given = request.extensions.get("timeout")
            timeouts: dict[str, float | None] = {}
            for k in _TIMEOUT_KEYS:
                old = given.get(k) if given else None
                timeouts[k] = budget if old is None or old > budget else old
            request.extensions["timeout"] = timeouts
        try:
            response = await self.transport.handle_async_request(request)
        except _NOT_SENT as e:
            raise TransientError(f"{type(e).__name__}: {e}", sent=False) from e
        except httpx.TransportError as e:
            # Read/write timeouts, resets, a server that hung up: it may have been applied.
            raise TransientError(f"{type(e).__name__}: {e}", sent=True) from e
        if not needs_retry_layer(response.status_code):
            return response
        raise await _answer_error(response)

    async def aclose(self) -> None:
        close = getattr(self.transport, "aclose", None)
        if close is not None:
            await close()


async def _answer_error(response: httpx.Response) -> ResponseError:
    """A `ResponseError` for a 5xx/429 answer, its body read (which frees the connection, so a
    retry can reuse it) into a fresh response the caller can still read. The connection lost
    while reading it is a transport failure after sending, as one before the headers is."""
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    except httpx.TransportError as e:
        raise TransientError(f"{type(e).__name__}: {e}", sent=True) from e
    finally:
        await response.aclose()
    copy = httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=response.extensions,
    )
    return http_answer_error(response.status_code, response.headers, copy)
