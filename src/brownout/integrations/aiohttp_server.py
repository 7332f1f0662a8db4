"""aiohttp server middleware: brownout's edge for ``aiohttp.web`` applications.

::

    app = web.Application(middlewares=[brownout_middleware(policy)])

The same behaviour as the ASGI middleware (`brownout.integrations.asgi`): health paths pass
through; the operation is the route's canonical template (``/reports/{id}``), resolved by
aiohttp before middlewares run; refusals are complete ``application/problem+json`` responses
on a kept-alive connection (503 capacity, 429 quota, ``Retry-After`` only when known and
jittered); the handler runs inside the request context and is cancelled at deadline expiry
(504 if nothing was sent yet); streaming responses pass through untouched.

Client disconnects: aiohttp does not cancel handlers unless the runner is created with
``handler_cancellation=True``. The middleware therefore checks the connection of every request
older than the policy's ``sweep_period`` at each sweep (one shared loop timer) and cancels the
handler when it is gone; either way the request is counted as abandoned, not as a success.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..clock import running_loop
from ..edge import ABANDONED, EdgePolicy, Flight, Refusal, ratelimit_headers
from ..propagation import DO_NOT_RETRY_VALUE, RETRY_HEADER

__all__ = ["BrownoutAiohttpMiddleware", "brownout_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _gone(request: web.Request, flight: Flight) -> Callable[[], bool]:
    """The sweep hook: cancel the handler once the connection is gone (never done early)."""

    def check() -> bool:
        transport = request.transport
        if transport is None or transport.is_closing():
            flight.abandoned = True
            task = flight.task
            if task is not None and not task.done():
                task.cancel()
            return True
        return False  # look again at the next sweep

    return check


def _response_started(request: web.Request) -> bool:
    writer: Any = request.writer
    return bool(getattr(writer, "output_size", 0)) or bool(getattr(writer, "_headers_buf", None))


def refusal_response(refusal: Refusal) -> web.Response:
    """The aiohttp response for a refusal (problem+json, Retry-After, do-not-retry)."""
    headers: dict[str, str] = {"Content-Type": "application/problem+json"}
    ra = refusal.retry_after_header()
    if ra is not None:
        headers["Retry-After"] = ra
    if refusal.do_not_retry:
        headers[RETRY_HEADER] = DO_NOT_RETRY_VALUE
    if refusal.degraded:
        headers["brownout-degraded"] = ", ".join(refusal.degraded)
    quota: Any = refusal.quota
    if quota is not None:
        headers.update(ratelimit_headers(quota))
    return web.Response(status=refusal.status, body=refusal.body, headers=headers)


class BrownoutAiohttpMiddleware:
    """An aiohttp (new-style) middleware applying an `EdgePolicy` to every request."""

    __middleware_version__ = 1

    def __init__(self, policy: EdgePolicy, *, watch_disconnects: bool = True) -> None:
        self.policy = policy
        self.watch_disconnects = watch_disconnects

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        policy = self.policy
        if policy.is_health(request.path):
            return await handler(request)
        loop = running_loop()  # once per request (asyncio's is a system call on CPython 3.11)
        flight = Flight(loop.time())
        if self.watch_disconnects:
            flight.on_old = _gone(request, flight)
        resource = request.match_info.route.resource
        template = resource.canonical if resource is not None else policy.match(request.path)
        route = policy.route(template)
        headers = request.headers

        def get(name: str) -> str | None:
            return headers.get(name)

        async def call() -> web.StreamResponse:
            try:
                response = await handler(request)
            except web.HTTPException as e:
                flight.status = e.status
                raise
            flight.status = response.status
            return response

        try:
            outcome = await policy.serve(
                request,
                call,
                flight,
                route=route,
                get=get,
                answers=(web.HTTPException,),
                loop=loop,
            )
        except asyncio.CancelledError:
            transport = request.transport
            if not flight.abandoned and (transport is None or transport.is_closing()):
                policy.record_abandoned(flight)
            raise
        if outcome is ABANDONED:
            # Nobody is listening; the connection is already gone.
            raise asyncio.CancelledError
        if isinstance(outcome, Refusal):
            if _response_started(request):
                # A streamed response had begun: leave it visibly incomplete.
                transport = request.transport
                if transport is not None:
                    transport.close()
            return refusal_response(outcome)
        assert isinstance(outcome, web.StreamResponse)
        degraded = policy.degraded_names() if policy.degraded is not None else ()
        if degraded and not outcome.prepared:
            outcome.headers["brownout-degraded"] = ", ".join(degraded)
        return outcome


def brownout_middleware(
    policy: EdgePolicy, *, watch_disconnects: bool = True
) -> BrownoutAiohttpMiddleware:
    """The middleware for ``web.Application(middlewares=[...])``."""
    return BrownoutAiohttpMiddleware(policy, watch_disconnects=watch_disconnects)
