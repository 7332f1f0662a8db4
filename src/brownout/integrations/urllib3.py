"""urllib3 adapter: every request through a `Dependency` (D2, D4, D5, D6, R1-R5).

::

    http = BrownoutPoolManager(payments, maxsize=10)
    answer = http.request("POST", "http://payments/charge", json={"order": 7})

`BrownoutPoolManager` is a ``urllib3.PoolManager`` (a drop-in: ``request``, ``urlopen`` and
the pool keywords as usual) whose ``urlopen`` is one `Dependency.call_blocking` on the calling
thread. Each attempt gets its budget, sends it with the priority, attempt number and
idempotency key, caps the (connect, read) timeout at it (a smaller ``timeout`` of the
caller's or the pool's is kept), and is classified as with the requests and httpx adapters:
a connection never made is safe to resend; 429, 502, 503 and 504 are retryable with
``Retry-After`` honoured; ``brownout-retry: never`` stops retries; a mutation sent and never
answered raises `brownout.UnknownOutcome` with its key.

urllib3's own retries are off for errors and statuses (this is the one retry layer); a
``retries=`` argument is refused with `ValueError`. Redirects are still followed within one
attempt, at most ``max_redirects`` (``redirect=False`` returns the 3xx).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

try:
    import urllib3
    from urllib3.response import BaseHTTPResponse
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "urllib3", e) from e

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

__all__ = ["BrownoutPoolManager"]

# Failures on the wire (a bad URL or argument is the caller's error, raised as it is).
_TRANSPORT = (
    urllib3.exceptions.MaxRetryError,
    urllib3.exceptions.TimeoutError,
    urllib3.exceptions.ProtocolError,
)


class BrownoutPoolManager(urllib3.PoolManager):
    """A `urllib3.PoolManager` applying a `Dependency`'s budget, guards and retries.

    ``dependency``: the downstream's `Dependency` (default: one named ``name`` with no
    timeout and no retries). ``safe_methods``, ``signer`` and ``return_exhausted`` as for
    `brownout.integrations.requests.BrownoutAdapter`; ``**pool`` goes to ``PoolManager``.
    """

    def __init__(
        self,
        dependency: Dependency | None = None,
        *,
        name: str = "http",
        safe_methods: Collection[str] = SAFE_METHODS,
        signer: BudgetSigner | None = None,
        return_exhausted: bool = False,
        max_redirects: int = 3,
        **pool: Any,
    ) -> None:
        if "retries" in pool:
            raise ValueError("retries: the dependency's RetryPolicy is the one retry layer")
        self.client = BlockingClient(
            dependency,
            errors=urllib3.exceptions.HTTPError,
            name=name,
            safe_methods=safe_methods,
            signer=signer,
            return_exhausted=return_exhausted,
        )
        self.max_redirects = max_redirects
        super().__init__(**pool)

    @property
    def dependency(self) -> Dependency:
        return self.client.dependency

    def urlopen(  # type: ignore[override]  # (keywords only past redirect, as urllib3 passes them)
        self, method: str, url: str, redirect: bool = True, **kw: Any
    ) -> BaseHTTPResponse:
        retries = kw.pop("retries", None)
        if retries is not None and retries is not False:
            raise ValueError("retries: the dependency's RetryPolicy is the one retry layer")
        return self.client.send(
            method,
            kw.get("headers", self.headers),
            BaseHTTPResponse,
            self._attempt,
            method,
            url,
            redirect,
            kw,
        )

    def _attempt(
        self, method: str, url: str, redirect: bool, kw: dict[str, Any]
    ) -> BaseHTTPResponse:
        headers = urllib3.HTTPHeaderDict(kw.get("headers", self.headers))
        headers.update(attempt_headers(self.client.signer))
        given = kw.get("timeout", self.connection_pool_kw.get("timeout"))
        if isinstance(given, urllib3.Timeout):
            connect, read = _seconds(given.connect_timeout), _seconds(given.read_timeout)
        else:
            connect = read = _seconds(given)
        connect, read = attempt_timeouts(connect, read)
        # Errors and statuses come back at once; only redirects are followed here.
        once = urllib3.Retry(
            total=None,
            connect=0,
            read=0,
            other=0,
            status=0,
            redirect=self.max_redirects if redirect else False,
            raise_on_redirect=False,
        )
        preload = kw.get("preload_content", True)
        options = {**kw, "headers": headers, "timeout": urllib3.Timeout(connect, read)}
        try:
            response = super().urlopen(method, url, redirect, retries=once, **options)
            status = response.status
            if not preload and needs_retry_layer(status):
                response.read()  # frees the connection for a retry
        except _TRANSPORT as error:
            raise failed_attempt(error, sent=not never_sent(error)) from error
        if not needs_retry_layer(status):
            return response
        raise http_answer_error(status, response.headers, response)


def _seconds(value: object) -> float | None:
    """A timeout in seconds, or ``None`` for urllib3's "none" and "default" markers."""
    return float(value) if isinstance(value, int | float) else None
