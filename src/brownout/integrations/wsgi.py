"""WSGI middleware: brownout's edge for Flask and any WSGI application (PEP 3333).

::

    app.wsgi_app = BrownoutMiddleware(app.wsgi_app, policy)  # Flask: integrations.flask

Per request, on the server's worker thread (the decisions are `brownout._edge.blocking`'s):

- health, readiness and metrics paths (`EdgePolicy.exempt_paths`) go straight to the app;
- the operation label is the route template from ``route_of(environ)`` (Flask: its url_map
  rule), else the policy's own ``routes``, else ``"unmatched"``;
- refusals are complete ``application/problem+json`` responses with ``Content-Length`` and a
  jittered ``Retry-After`` (503 capacity, 504 deadline);
- the app's response is passed through unbuffered; its status settles the permit (5xx is a
  failure) and ``brownout-degraded`` is added to its head when degraded modes are active;
- the permit is held until the body iterable is exhausted or closed (a streaming body counts
  as in flight); the iterable's ``close()`` is always called;
- a server integration may be told of each 503 it answers (`on_capacity_refusal`): gunicorn's
  closes the connection, now and then, so keep-alive clients move to a less busy worker;
- a thread cannot be cancelled: a handler that returns after its deadline has its answer
  replaced by a 504 problem (counted as expired); the work itself ran to its end.
"""

from __future__ import annotations

import http
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from .._clock import now
from .._degrade.modes import DEGRADED_HEADER
from .._edge import (
    EdgePolicy,
    Flight,
    Refusal,
    ResolvedRoute,
    announced_modes,
    one_value,
    refusal_headers,
)
from .._edge.blocking import (
    Held,
    begin,
    begin_express,
    check_blocking,
    claims_nothing,
)
from .._edge.express import Express
from .._propagation import HeaderGetter, Repeated

__all__ = [
    "RAISED_KEY",
    "BrownoutMiddleware",
    "environ_getter",
    "on_capacity_refusal",
    "write_refusal",
]

RAISED_KEY = "brownout.raised"
"""The environ key where a framework that answers exceptions itself (Flask) leaves one of
brownout's (a `Rejected` from a dependency, `DeadlineExceeded`, `UnknownOutcome`), for the
middleware to answer as every edge does."""

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_MAX_TEMPLATES = 1024  # templates come from the app's router and the policy's routes: few

_capacity_refused: list[Callable[[], None]] = []


def on_capacity_refusal(hook: Callable[[], None]) -> None:
    """Call ``hook()`` on the worker's thread each time a 503 refusal is written (once per
    hook). For server integrations: `brownout.integrations.gunicorn.pre_request` uses it."""
    if hook not in _capacity_refused:
        _capacity_refused.append(hook)


def environ_getter(environ: Environ) -> HeaderGetter:
    """A header getter over a WSGI environ (``HTTP_*`` keys). A server joins a repeated
    header's values with commas; they are split again, so repeated values follow the rule
    every adapter's lookup follows (`one_value`)."""

    def get(name: str) -> str | Repeated | None:
        raw = environ.get("HTTP_" + name.upper().replace("-", "_"))
        if raw is None:
            return None
        if "," not in raw:
            return str(raw)
        return one_value([v.strip() for v in str(raw).split(",")])

    return get


def _status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Refused"


def write_refusal(refusal: Refusal, start_response: StartResponse) -> list[bytes]:
    """Write a refusal as one complete WSGI response: its status, headers
    (`refusal_headers`, with ``Content-Length``) and body."""
    headers = refusal_headers(refusal)
    headers.append(("content-length", str(len(refusal.body))))
    if refusal.status == 503:
        for hook in _capacity_refused:
            hook()
    start_response(_status_line(refusal.status), headers)
    return [refusal.body]


class _Exchange:
    """One admitted request's answer: the app's ``start_response``, held until the edge has
    decided whether the app's answer stands (it is replaced by a 504 when the handler
    returned after its deadline), then the app's response iterable, passed through and read
    inside the request context. The body's end settles the request: exhausted, as answered;
    closed before that, as abandoned by its client (the server stopped reading). The app's
    ``close()`` is called whatever happens. One object per request for both roles."""

    __slots__ = (
        "body",
        "deferring",
        "exc_info",
        "flight",
        "forwarded",
        "headers",
        "held",
        "iterator",
        "sent",
        "status",
    )

    def __init__(self, held: Held, start_response: StartResponse) -> None:
        self.held = held
        self.flight = held.flight
        self.forwarded = start_response
        self.deferring = True
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.exc_info: ExcInfo | None = None
        self.sent: Callable[[bytes], object] | None = None  # the server's write, once sent
        self.body: Iterable[bytes] = ()
        self.iterator: Iterator[bytes] | None = None

    # -- the head --------------------------------------------------------------------------
    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Callable[[bytes], object]:
        self.status, self.headers, self.exc_info = status, headers, exc_info
        try:
            self.flight.status = int(status[:3])
        except ValueError:
            self.flight.status = 500  # (the server will refuse it too)
        if self.deferring:
            return self.write
        self.sent = None  # called again (with exc_info): the server decides
        return self.forward()

    def write(self, data: bytes) -> object:
        # PEP 3333's legacy write(): the head must leave first.
        return self.forward()(data)

    def forward(self) -> Callable[[bytes], object]:
        """Send the held head to the server (once): from now on the answer stands."""
        if self.sent is not None:  # already sent by write(): a second head is an error
            return self.sent
        self.deferring = False
        self.flight.response_started = True
        headers = self.headers
        held = self.held
        modes = held.policy.degraded
        if modes is not None:
            names = announced_modes(modes, held.marks)
            if names:
                headers = [*headers, (DEGRADED_HEADER, ", ".join(names))]
        if self.exc_info is not None:
            self.sent = self.forwarded(self.status, headers, self.exc_info)
        else:
            self.sent = self.forwarded(self.status, headers)
        return self.sent

    # -- the body --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        iterator = self.iterator
        if iterator is None:
            iterator = self.iterator = iter(self.body)
        try:
            return self.held.advance(iterator)
        except StopIteration:
            self.held.finish()
            raise
        except Exception:
            self.held.broke()
            raise

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.held.abandon()  # (nothing left to settle when it was read to its end)


class BrownoutMiddleware:
    """WSGI middleware applying an `EdgePolicy` to every request on a worker thread.

    ``route_of``: the route template of a request (its environ), or ``None`` when the app's
    router has none (then the policy's own ``routes`` are matched). Route bulkheads must be
    blocking (`brownout.ThreadBulkhead`); a policy with a quota hook or slowed refusals is
    refused with `TypeError` (`brownout._edge.blocking.check_blocking`).
    """

    def __init__(
        self,
        app: WSGIApp,
        policy: EdgePolicy,
        *,
        route_of: Callable[[Environ], str | None] | None = None,
    ) -> None:
        check_blocking(policy)
        self.app = app
        self.policy = policy
        self.route_of = route_of
        self._routes: dict[str | None, tuple[ResolvedRoute, Express | None]] = {}

    def _route(self, environ: Environ, path: str) -> tuple[ResolvedRoute, Express | None]:
        """The request's route and its express plan (`EdgePolicy.express`), cached per template."""
        template = self.route_of(environ) if self.route_of is not None else None
        if template is None:
            template = self.policy.match(path)
        entry = self._routes.get(template)
        if entry is None:
            route = self.policy.route(template)
            entry = (route, self.policy.express(route, on_thread=True))
            if len(self._routes) < _MAX_TEMPLATES:
                self._routes[template] = entry
        return entry

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        policy = self.policy
        path = environ.get("PATH_INFO") or "/"
        if path in policy.exempt_paths:
            return self.app(environ, start_response)
        flight = Flight(now())
        route, express = self._route(environ, path)
        held: Held | None = None
        if express is not None and claims_nothing(environ):
            held = begin_express(policy, express, environ, flight)
        if held is None:
            outcome = begin(policy, environ, flight, route=route, get=environ_getter(environ))
            if isinstance(outcome, Refusal):
                return write_refusal(outcome, start_response)
            held = outcome
        answer = _Exchange(held, start_response)
        try:
            body = self.app(environ, answer.start_response)
        except BaseException as e:  # settled whatever it is; only an Exception is answered
            refusal = held.raised(e)
            if refusal is None or flight.response_started:
                raise
            return write_refusal(refusal, start_response)
        raised = environ.pop(RAISED_KEY, None)
        late = held.returned() if raised is None else held.raised(raised)
        if late is not None or raised is not None:
            try:
                close = getattr(body, "close", None)
                if close is not None:
                    close()
            finally:
                held.finish()
            if late is not None:
                return write_refusal(late, start_response)
            answer.forward()  # the framework's own answer stands (its 500)
            return []
        if answer.status is not None:
            answer.forward()
        else:
            answer.deferring = False  # a generator app: its head goes when it calls
        answer.body = body
        return answer
