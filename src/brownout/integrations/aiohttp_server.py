"""aiohttp server middleware: brownout's edge for ``aiohttp.web`` applications.

::

    app = web.Application(middlewares=[brownout_middleware(policy)])

The same behaviour as the ASGI middleware (`brownout.integrations.asgi`): health and metrics
paths (`EdgePolicy.exempt_paths`) pass through; the operation is the route's canonical
template (``/reports/{id}``), resolved by aiohttp before middlewares run; refusals are
complete ``application/problem+json`` responses on a kept-alive connection (503 capacity, 429
quota, ``Retry-After`` only when known and jittered); the handler runs inside the request
context and is cancelled at deadline expiry (504 if nothing was sent yet); streaming
responses pass through untouched.

Two paths, one behaviour, as in the ASGI middleware: a request with nothing to decide (no
brownout header but a plain budget, a bulkhead with room and nobody queued) is served inline
by the middleware (the express path, `EdgePolicy.express`); everything else goes through
`EdgePolicy.serve`. Both give the same answers and counts
(``tests/integration/test_aiohttp_express.py``).

Client disconnects: aiohttp does not cancel handlers unless the runner is created with
``handler_cancellation=True``. The middleware therefore checks the connection of every request
older than the policy's ``sweep_period`` at each sweep (one shared loop timer) and cancels the
handler when it is gone; either way the request is counted as abandoned, not as a success.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

try:
    from aiohttp import web
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "aiohttp", e) from e

from .._admission.permit import Permit, Untracked
from .._clock import loop_and_time
from .._context import NO_REQUEST, get_current
from .._degrade.markers import fallback_marks
from .._degrade.modes import DEGRADED_HEADER
from .._edge import (
    ABANDONED,
    ANSWERED,
    EXPRESS_HEADERS,
    Abandoned,
    Answered,
    EdgePolicy,
    Express,
    ExpressScope,
    Flight,
    Refusal,
    Repeated,
    ResolvedRoute,
    announced_modes,
    one_value,
    refusal_headers,
    serve_connection,
)

__all__ = ["BrownoutAiohttpMiddleware", "announce_degraded", "brownout_middleware"]


_log = logging.getLogger("brownout.edge")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_Plan = tuple[ResolvedRoute, "Express | None"]
"""What the middleware keeps per route template: the route, and its express plan if any."""

_CLAIMS = tuple(name.decode("latin-1") for name in EXPRESS_HEADERS)
"""The headers the edge decides about, as names for aiohttp's case-insensitive lookup."""


def _lower_names(raw: Any) -> Any:
    # `EdgePolicy.express_budget` reads (lower-case name, value) byte pairs, as ASGI servers
    # give them; aiohttp keeps the case the client sent.
    return ((name.lower(), value) for name, value in raw)


_WRITING: set[asyncio.Task[None]] = set()
"""Answers written at a deadline while their handler still runs (held until written)."""


class _Flight(Flight):
    """A `Flight` that can answer at the deadline while the handler still runs."""

    __slots__ = ("request", "response", "sending")

    def __init__(self, started: float, request: web.Request) -> None:
        super().__init__(started)
        self.request = request
        self.response: web.StreamResponse | None = None
        self.sending: asyncio.Task[None] | None = None

    def answer_now(self, refusal: Any) -> bool:
        """`Flight.answer_now`: send the refusal now from a task of its own; the middleware
        returns this (already sent) response when the handler finally returns."""
        if _response_started(self.request):
            return False
        response = self.response = refusal_response(refusal)
        task = self.sending = asyncio.get_running_loop().create_task(_send(response, self.request))
        _WRITING.add(task)
        task.add_done_callback(_WRITING.discard)
        return True


async def _send(response: web.StreamResponse, request: web.Request) -> None:
    try:
        await response.prepare(request)
        await response.write_eof()
    except (ConnectionError, RuntimeError):  # the client left meanwhile
        pass


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
    return web.Response(
        status=refusal.status, body=refusal.body, headers=dict(refusal_headers(refusal))
    )


class BrownoutAiohttpMiddleware:
    """An aiohttp (new-style) middleware applying an `EdgePolicy` to every request."""

    __middleware_version__ = 1

    def __init__(self, policy: EdgePolicy, *, watch_disconnects: bool = True) -> None:
        self.policy = policy
        self.watch_disconnects = watch_disconnects
        self._plans: dict[str | None, _Plan] = {}
        self._warned_prepared = False

    def _plan(self, template: str | None) -> _Plan:
        route = self.policy.route(template)
        plans = self._plans
        if len(plans) >= 1024:
            plans.clear()  # bounded: templates come from the router and the policy's routes
        plan = plans[template] = (route, self.policy.express(route))
        return plan

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        policy = self.policy
        path = request.path
        if path in policy.exempt_paths:  # policy.is_exempt, inlined
            return await handler(request)
        loop, started = loop_and_time()  # one clock-cache lookup, not asyncio's system call
        resource = request.match_info.route.resource
        template = resource.canonical if resource is not None else policy.match(path)
        plan = self._plans.get(template)
        if plan is None:
            plan = self._plan(template)
        route, express = plan
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._connection(request, handler, started, route)
        if express is None or get_current() is not NO_REQUEST:
            return await self._serve(request, handler, loop, started, route)
        if any(map(request.headers.__contains__, _CLAIMS)):  # case-insensitive lookups
            seconds = policy.express_budget(route, request, _lower_names(request.raw_headers))
        else:
            seconds = express.seconds
        admitted = policy.express_admit(express, request, started, seconds)
        if admitted is None:
            return await self._serve(request, handler, loop, started, route)
        permit, cls = admitted
        # The express path (`EdgePolicy.express`): what `serve` does for a request with no
        # header to decide about (or a plain budget) at an uncontended bulkhead, inline.
        flight = _Flight(started, request)
        if self.watch_disconnects:
            flight.on_old = _gone(request, flight)
        scope = ExpressScope(policy, express, flight, cls, seconds, loop)
        try:
            try:
                response = await handler(request)
            finally:
                scope.close()
        except web.HTTPException as e:
            # aiohttp's way to answer (a 404, a redirect): settled by its status, not failed.
            flight.status = e.status
            scope.settle(permit)
            if flight.answered:
                return await self._sent(flight)
            if express.degraded is not None:
                self._announce(e, announced_modes(express.degraded, scope.marks))
            raise
        except (asyncio.CancelledError, Exception) as e:
            # Settled, and answered as `serve` would; re-raised when there is no answer.
            outcome = self._answer(e, permit, scope, request)
        else:
            flight.status = response.status
            scope.settle(permit)
            if flight.answered:
                return await self._sent(flight)
            if flight.abandoned:
                raise asyncio.CancelledError  # nobody is listening (`serve`'s ABANDONED)
            if express.degraded is not None:
                self._announce(response, announced_modes(express.degraded, scope.marks))
            return response
        if outcome is ANSWERED:
            return await self._sent(flight)
        return self._written(outcome, request, flight)

    @staticmethod
    async def _sent(flight: _Flight) -> web.StreamResponse:
        """The response sent at the deadline (`_Flight.answer_now`), once sent: aiohttp finds
        it prepared and finished and sends nothing more; the handler's answer is dropped."""
        if flight.sending is not None:
            await asyncio.shield(flight.sending)
        assert flight.response is not None
        return flight.response

    async def _connection(
        self, request: web.Request, handler: Handler, started: float, route: ResolvedRoute
    ) -> web.StreamResponse:
        """A websocket upgrade: admitted at connect, no deadline on its life, refused with
        the refusal's response instead of the upgrade (`brownout._edge.connections`)."""
        flight = Flight(started)
        response: web.StreamResponse | None = None
        headers = request.headers

        def get(name: str) -> str | None:
            return headers.get(name)

        async def call() -> None:
            nonlocal response
            response = await handler(request)

        outcome = await serve_connection(
            self.policy,
            request,
            call,
            flight,
            route=route,
            get=get,
            handshaken=lambda: _response_started(request),
        )
        if outcome is not None:
            return refusal_response(outcome)
        assert response is not None
        return response

    def _answer(
        self,
        e: BaseException,
        permit: Permit | Untracked,
        scope: ExpressScope,
        request: web.Request,
    ) -> Refusal | Abandoned | Answered:
        try:
            return self.policy.express_raised(e, permit, scope.flight, scope.task, scope.cancelling)
        except asyncio.CancelledError:
            self._note_gone(request, scope.flight)
            raise

    def _note_gone(self, request: web.Request, flight: Flight) -> None:
        """A cancellation nobody answered: aiohttp cancelled the handler because the client
        went away (``handler_cancellation=True``), which counts as abandoned."""
        transport = request.transport
        if not flight.abandoned and (transport is None or transport.is_closing()):
            self.policy.record_abandoned(flight)

    async def _serve(
        self,
        request: web.Request,
        handler: Handler,
        loop: asyncio.AbstractEventLoop,
        started: float,
        route: ResolvedRoute,
    ) -> web.StreamResponse:
        """Everything the express path does not take: `EdgePolicy.serve`."""
        policy = self.policy
        flight = _Flight(started, request)
        if self.watch_disconnects:
            flight.on_old = _gone(request, flight)
        headers = request.headers

        def get(name: str) -> str | Repeated | None:
            return one_value(headers.getall(name, ()))  # the edge's rule for repeated headers

        async def call() -> web.StreamResponse:
            # Named here, inside `serve`, where this request's fallback marks are set.
            try:
                response = await handler(request)
            except web.HTTPException as e:
                flight.status = e.status
                if policy.degraded is not None:
                    self._announce(e, announced_modes(policy.degraded, fallback_marks()))
                raise
            flight.status = response.status
            if policy.degraded is not None:
                self._announce(response, announced_modes(policy.degraded, fallback_marks()))
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
            self._note_gone(request, flight)
            raise
        if isinstance(outcome, web.StreamResponse):
            if policy.degraded is not None:
                self._announce(outcome, policy.degraded_names())
            return outcome
        if outcome is ANSWERED:
            return await self._sent(flight)
        return self._written(outcome, request, flight)

    def _announce(
        self, answer: web.StreamResponse | web.HTTPException, names: Sequence[str]
    ) -> None:
        """Name the active degraded modes on the handler's answer (G2), unless it already
        left: a streamed response's head is sent by ``prepare()`` inside the handler, so only
        `announce_degraded` (run by aiohttp at ``prepare()``) can name them there."""
        if not names or DEGRADED_HEADER in answer.headers:
            return
        if isinstance(answer, web.StreamResponse) and answer.prepared:
            if not self._warned_prepared:
                self._warned_prepared = True
                _log.warning(
                    "degraded modes %s are active but a streamed response was sent before the "
                    "edge could name them; add app.on_response_prepare.append("
                    "announce_degraded(policy)) to name them on every response",
                    ", ".join(names),
                )
            return
        answer.headers[DEGRADED_HEADER] = ", ".join(names)

    @staticmethod
    def _written(
        outcome: Refusal | Abandoned | Answered, request: web.Request, flight: _Flight
    ) -> web.StreamResponse:
        assert outcome is not ANSWERED  # `_sent`
        """The response for what the edge answered instead of the handler."""
        if outcome is ABANDONED:
            # Nobody is listening; the connection is already gone.
            raise asyncio.CancelledError
        assert isinstance(outcome, Refusal)
        if _response_started(request):
            # A streamed response had begun: leave it visibly incomplete.
            transport = request.transport
            if transport is not None:
                transport.close()
        return refusal_response(outcome)


def announce_degraded(
    policy: EdgePolicy,
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """A handler for ``app.on_response_prepare`` naming the policy's active degraded modes in
    ``brownout-degraded`` on every response as its head is sent, streamed ones included (G2).

    The middleware names them on the responses a handler returns or raises; a streamed
    response (``StreamResponse.prepare()`` inside the handler) has sent its head before the
    middleware sees it, and only this signal reaches it in time::

        app = web.Application(middlewares=[brownout_middleware(policy)])
        app.on_response_prepare.append(announce_degraded(policy))
    """

    async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if policy.degraded is None or DEGRADED_HEADER in response.headers:
            return
        names = policy.degraded_names()
        if names:
            response.headers[DEGRADED_HEADER] = ", ".join(names)

    return on_response_prepare


def brownout_middleware(
    policy: EdgePolicy, *, watch_disconnects: bool = True
) -> BrownoutAiohttpMiddleware:
    """The middleware for ``web.Application(middlewares=[...])``."""
    return BrownoutAiohttpMiddleware(policy, watch_disconnects=watch_disconnects)
