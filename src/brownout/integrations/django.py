"""Django: brownout's edge as a Django middleware, under WSGI and under ASGI.

::

    # settings.py
    BROWNOUT_POLICY = "myproject.edge.policy"      # dotted path to an EdgePolicy
    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "brownout.integrations.django.BrownoutMiddleware",   # after authentication
        ...,
    ]

The middleware is sync and async capable, so Django picks the mode the stack around it runs
in. Under WSGI (or a synchronous stack) it takes the blocking path
(`brownout._edge.blocking`): route bulkheads must be `brownout.ThreadBulkhead`, the deadline
is checked when the view returns (504 when it returned too late: a thread cannot be
cancelled), and a policy with a quota hook or slowed refusals is refused. Under ASGI with
an asynchronous stack it takes `EdgePolicy.serve`: route bulkheads must be `brownout.Bulkhead`
and the view is cancelled at its deadline. A bulkhead of the wrong kind raises `TypeError`
on the first request that reaches it.

The operation label is the URL pattern the request resolves to
(``django.urls.resolve(path).route``, with a leading ``/``), cached per path (bounded); a path
that resolves to nothing is ``"unmatched"`` (or the policy's own ``routes``). Placed after
``AuthenticationMiddleware``, a ``trust=`` function of the Django request may read
``request.user``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from .._clock import now
from .._degrade.markers import fallback_marks
from .._degrade.modes import DEGRADED_HEADER
from .._edge import EdgePolicy, Flight, Refusal, ResolvedRoute, announced_modes, refusal_headers
from .._edge.blocking import check_async, check_blocking, serve_blocking
from .._errors import Reason
from .wsgi import environ_getter

__all__ = ["BrownoutMiddleware", "DjangoRoutes", "announce", "refusal_response"]

_MAX_TEMPLATES = 1024  # templates come from the URLconf and the policy's routes: few


def refusal_response(refusal: Refusal) -> HttpResponse:
    """A refusal as a Django response (problem+json, `refusal_headers`)."""
    response = HttpResponse(refusal.body, status=refusal.status)
    for name, value in refusal_headers(refusal):
        response[name] = value
    return response


def announce(policy: EdgePolicy, response: HttpResponseBase) -> None:
    """Name the active degraded modes, and those whose fallback answered, on the response
    (G2); called inside the request context."""
    if policy.degraded is not None:
        names = announced_modes(policy.degraded, fallback_marks())
        if names:
            response[DEGRADED_HEADER] = ", ".join(names)


class DjangoRoutes:
    """The URL pattern a request resolves to, cached per (URLconf, path) in two bounded
    generations, so a flood of distinct paths cannot grow memory."""

    def __init__(self, cache_size: int = 1024) -> None:
        self.cache_size = cache_size
        self._cache: dict[tuple[Any, str], str | None] = {}
        self._previous: dict[tuple[Any, str], str | None] = {}

    def __call__(self, request: HttpRequest) -> str | None:
        key = (getattr(request, "urlconf", None), request.path_info)
        if key in self._cache:
            return self._cache[key]
        if key in self._previous:
            template = self._previous[key]
        else:
            try:
                route = resolve(request.path_info, urlconf=key[0]).route
            except Resolver404:
                route = None
            template = None if route is None else "/" + str(route).lstrip("^")
        if len(self._cache) >= self.cache_size:
            self._previous, self._cache = self._cache, {}
        self._cache[key] = template
        return template


def _policy_from_settings() -> EdgePolicy:
    path = getattr(settings, "BROWNOUT_POLICY", None)
    if not path:
        raise ImproperlyConfigured(
            "BROWNOUT_POLICY must name an EdgePolicy (a dotted path) for "
            "brownout.integrations.django.BrownoutMiddleware"
        )
    policy = import_string(path) if isinstance(path, str) else path
    if not isinstance(policy, EdgePolicy):
        raise ImproperlyConfigured(f"BROWNOUT_POLICY {path!r} is not an EdgePolicy")
    return policy


class BrownoutMiddleware:
    """Django middleware applying the `EdgePolicy` named by ``settings.BROWNOUT_POLICY``."""

    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[HttpRequest], Any],
        policy: EdgePolicy | None = None,
    ) -> None:
        self.get_response = get_response
        self.policy = policy if policy is not None else _policy_from_settings()
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        else:
            check_blocking(self.policy)
        self.routes = DjangoRoutes()
        self._routes: dict[str | None, ResolvedRoute] = {}

    def _route(self, request: HttpRequest) -> ResolvedRoute:
        template = self.routes(request)
        if template is None:
            template = self.policy.match(request.path_info)
        route = self._routes.get(template)
        if route is None:
            route = self.policy.route(template)
            if len(self._routes) < _MAX_TEMPLATES:
                self._routes[template] = route
        return route

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        policy = self.policy
        if request.path_info in policy.exempt_paths:
            return self.get_response(request)
        flight = Flight(now())
        route = self._route(request)

        def respond() -> HttpResponseBase:
            response: HttpResponseBase = self.get_response(request)
            flight.status = response.status_code
            announce(policy, response)
            return response

        outcome = serve_blocking(
            policy, request, respond, flight, route=route, get=environ_getter(request.META)
        )
        if isinstance(outcome, Refusal):
            return refusal_response(outcome)
        return outcome

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        policy = self.policy
        get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
        if request.path_info in policy.exempt_paths:
            return await get_response(request)
        flight = Flight(now())
        route = self._route(request)
        check_async(route)

        async def respond() -> HttpResponseBase:
            response = await get_response(request)
            flight.status = response.status_code
            announce(policy, response)
            return response

        outcome = await policy.serve(
            request, respond, flight, route=route, get=environ_getter(request.META)
        )
        if isinstance(outcome, Refusal):
            return refusal_response(outcome)
        if isinstance(outcome, HttpResponseBase):
            return outcome
        # ABANDONED or ANSWERED (not set by this adapter): the deadline's answer.
        return refusal_response(policy.refusal(Reason.DEADLINE_EXPIRED))
