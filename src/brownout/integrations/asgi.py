"""ASGI middleware: brownout's edge for Starlette, FastAPI and any ASGI application.

::

    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=..., ...))

What it does per HTTP request (see `brownout._edge` for the policy itself):

- health and readiness paths are passed straight through (never admitted, never queued);
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
import re
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from operator import itemgetter
from typing import Any

from .._admission.bulkhead import Permit, Untracked
from .._clock import current_task_of as _current_task
from .._clock import loop_and_time
from .._context import _EMPTY as _NO_REQUEST
from .._context import _get_current, _inbound_context, _reset_current, _set_current
from .._degrade.markers import _fallback_marks, _reset_fallback_marks, _set_fallback_marks
from .._edge import (
    EXPRESS_HEADERS,
    DegradedModes,
    EdgePolicy,
    Express,
    Flight,
    Refusal,
    ResolvedRoute,
    announced_modes,
    ratelimit_headers,
)
from .._propagation import DO_NOT_RETRY_VALUE, RETRY_HEADER

__all__ = ["BrownoutMiddleware"]


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

try:  # Starlette is optional: without it, templates come from the policy's routes.
    from starlette.routing import Mount as _Mount
except ImportError:  # pragma: no cover - exercised only without starlette installed
    _Mount = None  # type: ignore[assignment,misc]

try:  # FastAPI keeps an included router (``include_router``) as one nested route object;
    # this walks its effective routes, each with its full path (prefix included).
    from fastapi.routing import iter_route_contexts as _effective_routes
except ImportError:  # FastAPI absent, or older: included routes are flat Starlette routes
    _effective_routes = None  # type: ignore[assignment]

_PROBLEM = b"application/problem+json"
_DEGRADED = b"brownout-degraded"
_RETRY = RETRY_HEADER.encode()
_NEVER = DO_NOT_RETRY_VALUE.encode()
_ENCODED: dict[str, bytes] = {}
# True when no header name is one the edge must decide about (the scan runs in C: a
# request has several headers and this runs for every one).
_claims_nothing = EXPRESS_HEADERS.isdisjoint
_header_name = itemgetter(0)
_NEW = object.__new__


_Path = tuple[ResolvedRoute, "Express | None"]
"""What the middleware caches per request path: the route, and its express plan if any."""

_MAX_TEMPLATES = 1024  # templates come from the router and the policy's routes: few


_Candidate = tuple[Callable[[str], Any], Any, bool]
"""A route with a path regex: its regex's ``match``, the route, and whether it is a mount."""


class _RouteIndex:
    """One router's routes that have a path regex, in order, grouped by the literal first
    path segment they require. A route whose path starts with a literal segment
    (``/items/{id}`` requires ``items``) can only match a path with that first segment; the
    others (``/{slug}``, a mount at the root, routes without a plain ``path``) are candidates
    for every path. `candidates` keeps the router's order, so the first match is the one a
    walk of every route would find, after trying a few regexes instead of all of them: a
    service with ids in its paths misses the path cache on nearly every request."""

    __slots__ = ("by_segment", "dynamic", "routes", "size")

    def __init__(self, routes: Any) -> None:
        self.routes = routes
        """The router's own list (held, so the index's key, its ``id``, stays valid)."""
        self.size = len(routes)
        if _effective_routes is not None and not all(hasattr(r, "path_regex") for r in routes):
            routes = _effective_routes(routes)
        found: list[tuple[_Candidate, str | None]] = []
        for route in routes:
            regex = getattr(route, "path_regex", None)
            if regex is None:
                continue
            mount = _Mount is not None and isinstance(
                getattr(route, "original_route", route), _Mount
            )
            found.append(((regex.match, route, mount), _literal_head(route, regex)))
        self.dynamic: list[_Candidate] = [c for c, head in found if head is None]
        self.by_segment: dict[str, list[_Candidate]] = {
            segment: [c for c, head in found if head is None or head == segment]
            for segment in {head for _, head in found if head is not None}
        }

    def candidates(self, path: str) -> list[_Candidate]:
        """The routes that can match ``path``, in the router's order."""
        if path[:1] != "/":
            return self.dynamic  # a literal head needs the leading slash
        return self.by_segment.get(path.split("/", 2)[1], self.dynamic)


def _literal_head(route: Any, regex: Any) -> str | None:
    """The literal first segment a route requires (``/items/{id}``: ``items``), or None when
    it has none (a parameter there, a mount at the root, no plain path). Only when its regex
    says so too, as Starlette compiles it (``^/items/...``): a route class of its own whose
    ``path`` and regex disagree is tried for every path."""
    path = getattr(route, "path", None)
    pattern = getattr(regex, "pattern", None)
    if not isinstance(path, str) or path[:1] != "/" or not isinstance(pattern, str):
        return None
    head = path[1:].split("/", 1)[0]
    if "{" in head:
        return None
    start = "^" + re.escape("/" + head)
    if not pattern.startswith(start) or pattern[len(start) : len(start) + 1] not in ("/", "$"):
        return None
    return head


_MAX_INDEXES = 64


def _index_of(indexes: dict[int, _RouteIndex], routes: Any) -> _RouteIndex:
    """The index of ``routes`` (a router's list), rebuilt when the list grew or shrank (routes
    added at run time); bounded, as mounts are few."""
    index = indexes.get(id(routes))
    if index is None or index.routes is not routes or index.size != len(routes):
        if len(indexes) >= _MAX_INDEXES:
            indexes.clear()
        index = indexes[id(routes)] = _RouteIndex(routes)
    return index


def _template_in(
    indexes: dict[int, _RouteIndex], routes: Any, path: str, prefix: str, depth: int = 0
) -> str | None:
    """The template of the first Starlette route whose path matches (method ignored, as
    Starlette's partial matches do), looking into mounts and FastAPI's included routers."""
    if not isinstance(routes, list | tuple):
        routes = list(routes)  # (a router of its own kind: indexed anew, correct if slow)
    for match, route, mount in _index_of(indexes, routes).candidates(path):
        m = match(path)
        if m is None:
            continue
        if mount:
            inner = route.routes
            if inner and depth < 8:
                found = _template_in(
                    indexes, inner, "/" + m.group("path"), prefix + route.path, depth + 1
                )
                if found is not None:
                    return found
        fmt: str = route.path_format
        return prefix + fmt
    return None


class _Exchange(Flight):
    """One HTTP request through the middleware: the `Flight` the edge shares, the tracked
    ``send``, the call of the application and, when watching for disconnects, the wrapped
    ``receive``. One object instead of a flight, a receiver and closures over both: the
    hot path allocates less.

    As ``receive``, it lets the middleware listen for ``http.disconnect`` while the
    application may still call ``receive`` itself (messages are handed over, never lost)."""

    __slots__ = (
        "_buffer",
        "_receive",
        "_waiter",
        "app",
        "body_done",
        "degraded",
        "disconnected",
        "reading",
        "response_done",
        "resume_watch",
        "scope",
        "send",
        "watch",
        "watcher",
        "watching",
    )

    def __init__(
        self,
        started: float,
        app: ASGIApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        degraded: DegradedModes | None,
        watch: bool,
    ) -> None:
        # A request for `EdgePolicy.serve`, which sets what it decides (classification,
        # deadline, task) and reports the lifecycle when there is no bulkhead. The express
        # path (`BrownoutMiddleware.__call__`) builds its exchanges inline, field by field.
        # Flight's fields, set here rather than through Flight.__init__ (one call less).
        # ``on_old`` stays None: the sweep calls `old` (no bound method, no reference cycle).
        self.started = started
        self.on_old = None
        self.task = None
        self.timer = None
        self.deadline = None
        self.classification = None
        self.quota = None
        self.admitted = False
        self.response_started = False
        self.status = 0
        self.abandoned = False
        self.expired = False
        self.reports = True
        self.app = app
        self.scope = scope
        self._receive = receive
        self.watch = watch
        """Listen for ``http.disconnect`` once old: the application's ``receive`` is then
        this exchange (`__call__`), never the server's directly."""
        self.send = send
        self.degraded = degraded
        self.watcher: asyncio.Task[None] | None = None
        self._buffer: deque[Message] | None = None
        self._waiter: asyncio.Future[Message] | None = None
        self.body_done = False
        self.disconnected = False
        self.reading = False
        self.watching = False
        self.resume_watch = False
        """The watch stopped at a body message the application had not read yet: it resumes
        once the application has read the body (`__call__`)."""
        self.response_done = False
        """Set once the last response byte left: servers answer ``receive`` with
        ``http.disconnect`` after that, which is not the client going away."""

    def header(self, name: str) -> bytes | None:
        """The request's header ``name`` (lower case), as `EdgePolicy.serve` reads them: a
        bound method of the exchange instead of a closure built per request."""
        key = _ENCODED.get(name)
        if key is None:
            key = name.encode("latin-1")
            if len(_ENCODED) < 64:
                _ENCODED[name] = key
        for k, v in self.scope["headers"]:
            if k == key:
                return v  # type: ignore[no-any-return]
        return None

    def run(self) -> Awaitable[None]:
        """The application's call, as `EdgePolicy.serve` wants it."""
        return self.app(self.scope, self if self.watch else self._receive, self.tracked_send)

    def tracked_send(self, message: Message) -> Awaitable[None]:
        # Not a coroutine: it notes the message and returns the server's ``send`` awaitable,
        # so the response path has no extra coroutine frame per message.
        kind = message["type"]
        if kind == "http.response.start":
            self.response_started = True
            self.status = message["status"]
            modes = self.degraded
            if modes is not None:
                self._announce_degraded(message, modes)
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.response_done = True
        send = self.send  # (a slot read, then a call: ``self.send(...)`` is not specialized)
        return send(message)

    @staticmethod
    def _announce_degraded(start: Message, modes: DegradedModes) -> None:
        # Read as the head leaves, not when the request arrived (the marks are this request's
        # context's: the send runs in the application's task).
        names = announced_modes(modes, _fallback_marks())
        if names:
            headers = list(start.get("headers", ()))
            headers.append((_DEGRADED, ", ".join(names).encode()))
            start["headers"] = headers

    async def __call__(self) -> Message:
        buffer = self._buffer
        if buffer:
            return buffer.popleft()
        if self.watching:
            fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            self._waiter = fut
            return await fut
        self.reading = True
        try:
            msg = await self._receive()
        finally:
            self.reading = False
        kind = msg["type"]
        if kind == "http.request":
            if not msg.get("more_body", False):
                self.body_done = True
                if self.resume_watch:
                    self.resume_watch = False
                    self._start_watch()
        elif kind == "http.disconnect":
            self.disconnected = True
        return msg

    def _deliver(self, msg: Message) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(msg)
        else:
            if self._buffer is None:
                self._buffer = deque()
            self._buffer.append(msg)

    def old(self) -> bool:
        """The request is old: listen for a disconnect if the body is consumed. True when
        no further sweeps are needed."""
        if not self.watch or self.response_done:
            return True  # answered; whatever runs now (background tasks) is not abandoned
        if self.disconnected:
            self._disconnected()
            return True
        if not self.reading and (self.body_done or _declares_no_body(self.scope)):
            self._start_watch()
            return True
        return False  # the application is still reading the body: try again next sweep

    def _start_watch(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch(self._disconnected))

    def _disconnected(self) -> None:
        if self.abandoned:
            return
        self.abandoned = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    def close(self) -> None:
        """Stop the disconnect watch, if one started (it holds the exchange)."""
        w = self.watcher
        if w is not None:
            self.watcher = None
            if not w.done():
                w.cancel()

    async def _watch(self, on_disconnect: Callable[[], None]) -> None:
        self.watching = True
        try:
            while True:
                msg = await self._receive()
                if msg["type"] == "http.disconnect":
                    self.disconnected = True
                    self._deliver(msg)
                    if not self.response_done:
                        on_disconnect()
                    return
                was_done = self.body_done
                if not msg.get("more_body", False):
                    self.body_done = True
                self._deliver(msg)
                if was_done:
                    return  # a server that repeats body messages: nothing to watch for
                if not self.body_done:
                    # A body nobody declared (HTTP/2 needs no content-length): reading on
                    # would buffer all of it ahead of the application, with no backpressure.
                    # Hold this one message; watch again once the application has the rest.
                    self.resume_watch = True
                    return
        finally:
            self.watching = False


def _declares_no_body(scope: Scope) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            return bool(v.strip() == b"0")
        if k == b"transfer-encoding":
            return False
    return True


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
        self._indexes: dict[int, _RouteIndex] = {}

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
                template = _template_in(self._indexes, routes, path, "")
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
            await self.app(scope, receive, send)
            return
        policy = self.policy
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in policy.health_paths:  # policy.is_health, inlined
            await self.app(scope, receive, send)
            return
        loop, started = loop_and_time()  # one clock-cache lookup, not asyncio's system call
        entry = self._paths.get(path)
        if entry is None:
            entry = self._route(scope, path)
        route, express = entry
        permit: Permit | Untracked | None = None
        if express is not None and _get_current() is _NO_REQUEST:
            seconds = (
                express.seconds
                if _claims_nothing(map(_header_name, scope["headers"]))
                else policy.express_budget(route, scope, scope["headers"])
            )
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
        # this one coroutine frame.
        # It is most requests of a healthy service, so it is worth the bytecode it saves.
        app = self.app
        watch = self.watch_disconnects
        modes = express.degraded
        # `_Exchange.__init__`, inlined (a frame and eight arguments per request, ~0.5 us of
        # ~12 around Starlette): the same fields, as admitted by the express path. Keep the
        # two in step; ``test_express_exchange_sets_every_field`` fails when they drift.
        exchange = _NEW(_Exchange)
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
        exchange.reports = False
        exchange.app = app
        exchange.scope = scope
        exchange._receive = receive
        exchange.watch = watch
        exchange.send = send
        exchange.degraded = modes
        exchange.watcher = None
        exchange._buffer = None
        exchange._waiter = None
        exchange.body_done = False
        exchange.disconnected = False
        exchange.reading = False
        exchange.watching = False
        exchange.resume_watch = False
        exchange.response_done = False
        ctx = _inbound_context(started + seconds, priority, caller, operation, in_progress, started)
        exchange.deadline = ctx.deadline
        task = exchange.task = _current_task(loop)
        assert task is not None
        token = _set_current(ctx)
        # With degraded modes declared, a fresh list per request collects the modes whose
        # fallback answered (`brownout._degrade.markers`), as `serve` does.
        marks: list[str] | None = None
        if modes is not None:
            marks = []
            marks_token = _set_fallback_marks(marks)
        sweeper = policy._sweeper
        sweeper.track(exchange, task, loop)
        cancelling = task.cancelling()
        try:
            try:
                await app(scope, exchange if watch else receive, exchange.tracked_send)
            finally:
                sweeper.forget(exchange)
                _reset_current(token)
                if marks is not None:
                    _reset_fallback_marks(marks_token)
                if exchange.watcher is not None:
                    exchange.close()
        except (asyncio.CancelledError, Exception) as e:
            # Settled, and answered as `serve` would; re-raised when there is no answer.
            await _write_answer(policy.express_raised(e, permit, exchange, task, cancelling), send)
            return
        if exchange.abandoned:
            # The application swallowed the cancellation for its client's disconnect and
            # answered anyway: nobody hears the answer, so it is abandoned (O1).
            permit.settle_raised(asyncio.CancelledError)
        elif exchange.status >= 500:
            permit.failed(f"status_{exchange.status}")
        elif marks:  # a fallback answered: a success the limit must not learn from
            assert ctx.deadline is not None
            policy.settle_fallback(permit, exchange, cls, ctx.deadline)
        else:
            permit.success()

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
        exchange = _Exchange(
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
        if type(outcome) is Refusal:  # `_write_answer`, one coroutine frame less
            await _write_refusal(outcome, send)


async def _write_answer(outcome: Any, send: Send) -> None:
    if isinstance(outcome, Refusal):
        await _write_refusal(outcome, send)


_CONTENT_TYPE = (b"content-type", _PROBLEM)
_LENGTHS: dict[int, tuple[bytes, bytes]] = {}
"""``content-length`` headers by body length (the problem bodies come in a few lengths)."""
_SECONDS = [b"%d" % s for s in range(121)]
"""``Retry-After`` values up to two minutes, encoded once."""


def _refusal_head(refusal: Refusal) -> list[tuple[bytes, bytes]]:
    """The refusal's response headers: a new list each time (middleware outside may add
    to it in place), of pairs built once where they recur."""
    n = len(refusal.body)
    length = _LENGTHS.get(n)
    if length is None:
        length = (b"content-length", b"%d" % n)
        if len(_LENGTHS) < 256:
            _LENGTHS[n] = length
    headers = [_CONTENT_TYPE, length]
    if refusal.retry_after is not None:
        seconds = refusal.retry_after_seconds()
        assert seconds is not None
        headers.append((b"retry-after", _SECONDS[seconds] if seconds < 121 else b"%d" % seconds))
    if refusal.do_not_retry:
        headers.append((_RETRY, _NEVER))
    if refusal.degraded:
        headers.append((_DEGRADED, ", ".join(refusal.degraded).encode()))
    quota = refusal.quota
    if quota is not None:
        headers.extend(_ratelimit_headers(quota))
    return headers


async def _write_refusal(refusal: Refusal, send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": refusal.status, "headers": _refusal_head(refusal)}
    )
    await send({"type": "http.response.body", "body": refusal.body})


def _ratelimit_headers(quota: Any) -> list[tuple[bytes, bytes]]:
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in ratelimit_headers(quota).items()
    ]
