"""Flask: brownout's WSGI edge with Flask's route templates as operation labels.

::

    from brownout.integrations.flask import protect
    protect(app, policy)        # wraps app.wsgi_app

The operation label of a request is its Flask rule (``/items/<int:item_id>``), matched with
the app's own ``url_map`` and cached per method and path (bounded); a path no rule matches is
``"unmatched"`` (or the policy's own ``routes``). Everything else is
`brownout.integrations.wsgi.BrownoutMiddleware`'s.
"""

from __future__ import annotations

from typing import Any

from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from .._edge import EdgePolicy
from .wsgi import BrownoutMiddleware, Environ

__all__ = ["FlaskRoutes", "protect"]


class FlaskRoutes:
    """The Flask rule a request matches (its environ), by the app's ``url_map``; cached in
    two bounded generations, so a flood of distinct paths cannot grow memory."""

    def __init__(self, app: Any, cache_size: int = 1024) -> None:
        self.app = app
        self.cache_size = cache_size
        self._cache: dict[tuple[str, str, str], str | None] = {}
        self._previous: dict[tuple[str, str, str], str | None] = {}

    def __call__(self, environ: Environ) -> str | None:
        key = (
            environ.get("REQUEST_METHOD", "GET"),
            environ.get("HTTP_HOST", ""),
            environ.get("PATH_INFO") or "/",
        )
        if key in self._cache:
            return self._cache[key]
        template = self._previous[key] if key in self._previous else self._match(environ)
        if len(self._cache) >= self.cache_size:
            self._previous, self._cache = self._cache, {}
        self._cache[key] = template
        return template

    def _match(self, environ: Environ) -> str | None:
        try:
            adapter = self.app.url_map.bind_to_environ(environ)
            rule, _ = adapter.match(return_rule=True)
        except (HTTPException, RequestRedirect):  # not found, method not allowed, redirect
            return None
        return str(rule.rule)


def protect(app: Any, policy: EdgePolicy) -> BrownoutMiddleware:
    """Put the edge in front of the Flask ``app`` (its ``wsgi_app`` is wrapped, so Flask's
    own middleware stack stays outside); returns the middleware."""
    middleware = BrownoutMiddleware(app.wsgi_app, policy, route_of=FlaskRoutes(app))
    app.wsgi_app = middleware
    return middleware
