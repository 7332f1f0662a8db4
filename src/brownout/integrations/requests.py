"""requests adapter: every request through a `Dependency` (D2, D4, D5, D6, R1-R5).

::

    session = requests.Session()
    session.mount("http://payments/", BrownoutAdapter(payments))

`BrownoutAdapter` is a ``requests.adapters.HTTPAdapter``: each request sent through it is one
`Dependency.call_blocking` on the calling thread, and each attempt, as with the httpx adapter:

- gets its budget from the dependency (``min(timeout, remaining - reserve)``); too little time
  left raises `brownout.Rejected` (``DEADLINE_TOO_SHORT``) *before* anything is sent;
- sends that budget (``brownout-budget-ms``), the priority, the attempt number and the
  idempotency key, and caps the (connect, read) timeouts at the budget (a smaller ``timeout=``
  of the caller's is kept); the body is read within the attempt unless ``stream=True``;
- is classified for the retry policy: a connection never made is safe to resend; 429, 502,
  503 and 504 are retryable, with ``Retry-After`` honoured; an answer carrying
  ``brownout-retry: never`` (on any line) is never retried.

Methods other than GET, HEAD, OPTIONS and TRACE are mutations: they carry an idempotency key
(the request's own ``Idempotency-Key`` header, else the dependency's generated one, identical
on every attempt), and one that was sent and never answered raises `brownout.UnknownOutcome`
with its key (recorded in the dependency's ledger).

What the caller sees: the response for any answer this layer does not retry (a 404, a 500);
`brownout.RetriesExhausted` when it retried and gave up (``return_exhausted=True``: the last
response); requests' own errors when the dependency does not retry. urllib3's retries are
off (``max_retries=0``): this is the one retry layer. The dependency's guards are shared by
every thread using the session.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

try:
    import requests
    from requests.adapters import HTTPAdapter
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "requests", e) from e

from .._dependency import Dependency
from .._propagation import BudgetSigner
from .._retry.outbound import SAFE_METHODS, http_answer_error, needs_retry_layer
from ._blocking_http import (
    BlockingClient,
    attempt_headers,
    attempt_timeouts,
    failed_attempt,
    never_sent,
)

__all__ = ["BrownoutAdapter"]

# A body cut off while it was read: the request was sent.
_CUT_OFF = requests.exceptions.ChunkedEncodingError
_Timeout = float | tuple[float | None, float | None] | None


class BrownoutAdapter(HTTPAdapter):
    """A requests transport adapter applying a `Dependency`'s budget, guards and retries.

    ``dependency``: the downstream's `Dependency` (default: one named ``name`` with no
    timeout and no retries, which still propagates deadlines and records unknown outcomes).
    ``safe_methods``: methods treated as free of side effects. ``signer``: also send a signed
    budget for a callee outside the trust boundary (D3). ``pool_connections``,
    ``pool_maxsize`` and ``pool_block`` are `HTTPAdapter`'s.
    """

    def __init__(
        self,
        dependency: Dependency | None = None,
        *,
        name: str = "http",
        safe_methods: Collection[str] = SAFE_METHODS,
        signer: BudgetSigner | None = None,
        return_exhausted: bool = False,
        **pool: Any,
    ) -> None:
        self.client = BlockingClient(
            dependency,
            errors=requests.RequestException,
            name=name,
            safe_methods=safe_methods,
            signer=signer,
            return_exhausted=return_exhausted,
        )
        super().__init__(max_retries=0, **pool)

    @property
    def dependency(self) -> Dependency:
        return self.client.dependency

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: _Timeout = None,
        verify: bool | str = True,
        cert: Any = None,
        proxies: Mapping[str, str] | None = None,
    ) -> requests.Response:
        options = {"stream": stream, "verify": verify, "cert": cert, "proxies": proxies}
        return self.client.send(
            request.method or "GET",
            request.headers,
            requests.Response,
            self._attempt,
            request,
            timeout,
            options,
        )

    def _attempt(
        self, request: requests.PreparedRequest, timeout: _Timeout, options: dict[str, Any]
    ) -> requests.Response:
        request.headers.update(attempt_headers(self.client.signer))
        if isinstance(timeout, tuple):
            connect, read = timeout
        else:
            connect = read = timeout
        try:
            response = super().send(request, timeout=attempt_timeouts(connect, read), **options)
            status = response.status_code
            if not options["stream"] or needs_retry_layer(status):
                # Read within the attempt: a body cut off is a failure after sending, and a
                # retry's connection must be free.
                response.content  # noqa: B018
        except (requests.ConnectionError, requests.Timeout, _CUT_OFF) as error:
            cause = error.args[0] if error.args else error
            raise failed_attempt(
                error, sent=not never_sent(cause if isinstance(cause, BaseException) else error)
            ) from error
        if not needs_retry_layer(status):
            return response
        raise http_answer_error(status, response.headers, response)
