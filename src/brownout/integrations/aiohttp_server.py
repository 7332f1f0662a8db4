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
``handler_cancellation=True``. The middleware therefore polls the connection with one loop
timer per request (after ``disconnect_check_after`` seconds of handler time, then at that
period) and cancels the handler when the connection is gone; either way the request is counted
as abandoned, not as a success.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..edge import ABANDONED, EdgePolicy, Flight, Refusal
from ..propagation import DO_NOT_RETRY_VALUE, RETRY_HEADER

__all__ = ["BrownoutAiohttpMiddleware", "brownout_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _DisconnectPoll:
    __slots__ = ("flight", "period", "request", "task", "timer")

    def __init__(self, request: web.Request, flight: Flight, period: float) -> None:
        self.request = request
        self.flight = flight
        self.period = period
        self.task = asyncio.current_task()
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            period, self._check
        )

    def _check(self) -> None:
        self.timer = None
        transport = self.request.transport
        if transport is None or transport.is_closing():
            self.flight.abandoned = True
            if self.task is not None and not self.task.done():
                self.task.cancel()
            return
        self.timer = asyncio.get_running_loop().call_later(self.period, self._check)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


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
        if quota.limit is not None:
            headers["RateLimit-Limit"] = str(int(quota.limit))
        if quota.remaining is not None:
            headers["RateLimit-Remaining"] = str(max(0, int(quota.remaining)))
        if quota.reset is not None:
            headers["RateLimit-Reset"] = str(max(0, int(-(-quota.reset // 1))))
    return web.Response(status=refusal.status, body=refusal.body, headers=headers)


class BrownoutAiohttpMiddleware:
    """An aiohttp (new-style) middleware applying an `EdgePolicy` to every request."""

    __middleware_version__ = 1

    def __init__(self, policy: EdgePolicy, *, disconnect_check_after: float | None = 0.05) -> None:
        self.policy = policy
        self.disconnect_check_after = disconnect_check_after

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        policy = self.policy
        if policy.is_health(request.path):
            return await handler(request)
        flight = Flight(asyncio.get_running_loop().time())
        resource = request.match_info.route.resource
        template = resource.canonical if resource is not None else policy.match(request.path)
        route = policy.route(template)
        poll = (
            _DisconnectPoll(request, flight, self.disconnect_check_after)
            if self.disconnect_check_after is not None
            else None
        )
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
                request, call, flight, route=route, get=get, answers=(web.HTTPException,)
            )
        except asyncio.CancelledError:
            transport = request.transport
            if not flight.abandoned and (transport is None or transport.is_closing()):
                policy.record_abandoned(flight)
            raise
        finally:
            if poll is not None:
                poll.close()
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
    policy: EdgePolicy, *, disconnect_check_after: float | None = 0.05
) -> BrownoutAiohttpMiddleware:
    """The middleware for ``web.Application(middlewares=[...])``."""
    return BrownoutAiohttpMiddleware(policy, disconnect_check_after=disconnect_check_after)
