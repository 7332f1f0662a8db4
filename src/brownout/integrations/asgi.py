"""ASGI middleware: brownout's edge for Starlette, FastAPI and any ASGI application.

::

    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=..., ...))

What it does per HTTP request (see `brownout._edge` for the policy itself):

- health, readiness and metrics paths (`EdgePolicy.exempt_paths`) are passed straight
  through (never admitted, never queued, never counted);
- the operation label is the route *template* (``/reports/{id}``): the middleware walks the
  Starlette/FastAPI router (found in ``scope["app"]``) with a bounded path cache, else the
  policy's own ``routes``; anything else is ``"unmatched"``;
- refusals are written as complete ``application/problem+json`` responses with
  ``Content-Length``, so the connection stays open for the next request (unlike uvicorn's
  ``--limit-concurrency``, which closes it);
- responses, including streaming ones, pass through unbuffered; ``brownout-degraded`` is added
  to the response head naming the degraded modes active when the response starts, and any
  whose fallback answered this request (G2);
- at deadline expiry the handler is cancelled and, if no response started, a 504 problem is
  written; if the response had started, the response is left incomplete so the client sees a
  truncated answer rather than a falsely complete one;
- a client disconnect cancels the handler: once a request is the policy's ``sweep_period``
  old (one shared loop timer sweeps all in-flight requests; fast requests never pay for a
  timer or a task) the middleware listens for
  ``http.disconnect`` once the request body has been consumed, and cancels the handler when it
  arrives. The request is counted as abandoned, not as a success.

Two paths, one behaviour: a request with nothing to decide (no brownout header but a plain
budget, a bulkhead with room and nobody queued) is served inline by ``__call__`` (the express
path, `EdgePolicy.express`); everything else goes through `EdgePolicy.serve`. Both give the
same answers and counts (``tests/integration/test_asgi_express.py``).

Ordering: add authentication middleware *after* this one (Starlette runs the last added
outermost), so that ``scope["user"]`` is set when the classifier runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from operator import itemgetter

from .._admission.permit import Permit, Untracked
from .._clock import current_task_of as _current_task
from .._clock import loop_and_time
from .._context import NO_REQUEST, get_current, inbound_context, reset_current, set_current
from .._degrade.markers import reset_fallback_marks, set_fallback_marks
from .._edge import (
    EXPRESS_HEADERS,
    EdgePolicy,
    Express,
    Flight,
    Refusal,
    ResolvedRoute,
    header_getter,
    serve_connection,
)
from ._asgi_exchange import (
    ASGIApp,
    Exchange,
    Message,
    Receive,
    Scope,
    Send,
    refusal_head,
    write_answer,
    write_refusal,
)
from ._asgi_routes import RouteIndex, template_in

__all__ = ["BrownoutMiddleware"]

# True when no header name is one the edge must decide about (the scan runs in C: a
# request has several headers and this runs for every one).
_claims_nothing = EXPRESS_HEADERS.isdisjoint
_header_name = itemgetter(0)
_NEW = object.__new__

_Path = tuple[ResolvedRoute, "Express | None"]
"""What the middleware caches per request path: the route, and its express plan if any."""

_MAX_TEMPLATES = 1024  # templates come from the router and the policy's routes: few

_HANDSHAKE_ANSWERS = frozenset(
    ("websocket.accept", "websocket.close", "websocket.http.response.start")
)
"""What the application sends to answer a websocket handshake."""


async def refuse_websocket(refusal: Refusal, scope: Scope, send: Send) -> None:
    """Refuse a websocket handshake: the refusal as an HTTP response where the server has the
    websocket denial response extension, else a close before accept with code 1013 ("try
    again later"; servers answer the handshake 403)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": refusal.status,
                "headers": refusal_head(refusal),
            }
        )
        await send({"type": "websocket.http.response.body", "body": refusal.body})
        return
    await send(
        {"type": "websocket.close", "code": 1013, "reason": refusal.reason.value}
    )  # templates come from the router and the policy's routes: few


class BrownoutMiddleware:
    """ASGI middleware applying an `EdgePolicy` to every HTTP request (D2, D3, D5, S2-S7).

    ``watch_disconnects``: cancel the handler when the client goes away (requests older than
    the policy's ``sweep_period`` listen for ``http.disconnect``).
    """

    def __init__(
        self,
        app: ASGIApp,
        policy: EdgePolicy,
        *,
        watch_disconnects: bool = True,
        path_cache_size: int = 1024,
    ) -> None:
        self.app = app
        self.policy = policy
        self.watch_disconnects = watch_disconnects
        if path_cache_size < 1:
            raise ValueError("path_cache_size must be at least 1")
        self._paths: dict[str, _Path] = {}
        self._previous: dict[str, _Path] = {}
        self._path_cache_size = path_cache_size
        self._templates: dict[str | None, _Path] = {}
        self._indexes: dict[int, RouteIndex] = {}

    def _route(self, scope: Scope, path: str) -> _Path:
        """A path cache miss: the path's route and express plan, cached for the path.

        The cache has two generations: when the current one is full it becomes the previous
        one and a new one starts, and a miss looks in the previous generation before walking
        the router. Paths in use survive the swap (a flood of distinct paths, ids in URLs,
        cannot push them out for good) and memory stays bounded at twice ``path_cache_size``.
        Entries are shared per template: a miss allocates nothing for a known route."""
        entry = self._previous.get(path)
        if entry is None:
            template: str | None = None
            app = scope.get("app")
            router = getattr(app, "router", None)
            routes = getattr(router, "routes", None) if router is not None else None
            if routes is not None:
                template = template_in(self._indexes, routes, path, "")
            if template is None:
                template = self.policy.match(path)
            entry = self._templates.get(template)
            if entry is None:
                route = self.policy.route(template)
                entry = (route, self.policy.express(route))
                if len(self._templates) < _MAX_TEMPLATES:
                    self._templates[template] = entry
        cache = self._paths
        if len(cache) >= self._path_cache_size:
            self._previous = cache
            self._paths = cache = {}
        cache[path] = entry
        return entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await self._connection(scope, receive, send)
                return
            await self.app(scope, receive, send)  # lifespan, and anything else
            return
        policy = self.policy
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in policy.exempt_paths:  # policy.is_exempt, inlined
            await self.app(scope, receive, send)
            return
        loop, started = loop_and_time()  # one clock-cache lookup, not asyncio's system call
        entry = self._paths.get(path)
        if entry is None:
            entry = self._route(scope, path)
        route, express = entry
        permit: Permit | Untracked | None = None
        if express is not None and get_current() is NO_REQUEST:
            if _claims_nothing(map(_header_name, scope["headers"])):
                seconds = express.seconds
                origin = "default"
            else:
                seconds = policy.express_budget(route, scope, scope["headers"])
                # (the route's own default float is returned when the header may not set it)
                origin = "default" if seconds is express.seconds else "header"
            if seconds > 0.0:
                cls = express.classification
                if express.classifier is not None:
                    cls = express.classifier(scope, cls)
                priority, caller, operation, in_progress = cls
                permit = express.bulkhead.admit_uncontended(
                    priority, caller, operation, started, seconds
                )
        if permit is None:
            await self._serve(scope, receive, send, loop, started, route)
            return
        assert express is not None
        # The express path (`EdgePolicy.express`): what `serve` does for a request with no
        # header to decide about (or a plain budget) at an uncontended bulkhead, inline, in
        # this one coroutine frame (it is most requests of a healthy service). Decisions are
        # the edge's: the budget (`express_budget`), the answer to an exception
        # (`express_raised`) and the settle rule (`settle`).
        app = self.app
        watch = self.watch_disconnects
        modes = express.degraded
        # `Exchange.__init__`, inlined (no frame and eight arguments per request): the same
        # fields, as admitted by the express path. Keep the two in step;
        # ``test_express_exchange_sets_every_field`` fails when they drift.
        exchange = _NEW(Exchange)
        exchange.started = started
        exchange.on_old = None
        exchange.timer = None
        exchange.classification = cls
        exchange.quota = None
        exchange.admitted = True
        exchange.response_started = False
        exchange.status = 0
        exchange.abandoned = False
        exchange.expired = False
        exchange.answered = False
        exchange.answering = None
        exchange.reports = False
        exchange.app = app
        exchange.scope = scope
        exchange.server_receive = receive
        exchange.watch = watch
        exchange.send = send
        exchange.degraded = modes
        exchange.watcher = None
        exchange.buffered = None
        exchange.waiter = None
        exchange.body_done = False
        exchange.disconnected = False
        exchange.reading = False
        exchange.watching = False
        exchange.resume_watch = False
        exchange.response_done = False
        ctx = inbound_context(
            started + seconds, priority, caller, operation, in_progress, started, origin
        )
        exchange.deadline = ctx.deadline
        task = exchange.task = _current_task(loop)
        assert task is not None
        token = set_current(ctx)
        # With degraded modes declared, a fresh list per request collects the modes whose
        # fallback answered (`brownout._degrade.markers`), as `serve` does.
        marks: list[str] | None = None
        if modes is not None:
            marks = []
            marks_token = set_fallback_marks(marks)
        sweeper = express.sweeper
        sweeper.track(exchange, task, loop)
        cancelling = task.cancelling()
        try:
            try:
                await app(scope, exchange if watch else receive, exchange.tracked_send)
            finally:
                sweeper.forget(exchange)
                reset_current(token)
                if marks is not None:
                    reset_fallback_marks(marks_token)
                if exchange.watcher is not None:
                    exchange.close()
        except (asyncio.CancelledError, Exception) as e:
            # Settled, and answered as `serve` would; re-raised when there is no answer.
            await write_answer(policy.express_raised(e, permit, exchange, task, cancelling), send)
            if exchange.answered:
                await exchange.answered_at_deadline()
            return
        policy.settle(permit, exchange, marks)  # the one settle rule
        if exchange.answered:
            await exchange.answered_at_deadline()

    async def _connection(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket: admitted at connect, no deadline on its life, refused before the
        upgrade (`brownout._edge.connections`)."""
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in self.policy.exempt_paths:
            await self.app(scope, receive, send)
            return
        route = (self._paths.get(path) or self._route(scope, path))[0]
        flight = Flight(loop_and_time()[1])

        def tracked(message: Message) -> Awaitable[None]:
            if message["type"] in _HANDSHAKE_ANSWERS:
                flight.response_started = True
            return send(message)

        outcome = await serve_connection(
            self.policy,
            scope,
            lambda: self.app(scope, receive, tracked),
            flight,
            route=route,
            get=header_getter(scope.get("headers", ())),
            handshaken=lambda: flight.response_started,
        )
        if outcome is not None:
            await refuse_websocket(outcome, scope, send)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        loop: asyncio.AbstractEventLoop,
        started: float,
        route: ResolvedRoute,
    ) -> None:
        """Everything the express path does not take: `EdgePolicy.serve`."""
        policy = self.policy
        exchange = Exchange(
            started,
            self.app,
            scope,
            receive,
            send,
            policy.degraded,
            self.watch_disconnects,
        )
        try:
            outcome = await policy.serve(
                scope,
                exchange.run,
                exchange,
                route=route,
                get=exchange.header,
                loop=loop,
            )
        finally:
            exchange.close()
        if type(outcome) is Refusal:  # `write_answer`, one coroutine frame less
            await write_refusal(outcome, send)
        elif exchange.answered:
            await exchange.answered_at_deadline()
