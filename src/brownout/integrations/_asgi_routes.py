"""The route index: which Starlette/FastAPI route template a request path belongs to.

The operation label is the route template (``/reports/{id}``), found by walking the router in
``scope["app"]``, its mounts and FastAPI's included routers, with the routes grouped by their
literal first path segment so that a path tries a few regexes instead of all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

try:  # Starlette is optional: without it, templates come from the policy's routes.
    from starlette.routing import Mount as _Mount
except ImportError:  # pragma: no cover - exercised only without starlette installed
    _Mount = None  # type: ignore[assignment,misc]

try:  # FastAPI keeps an included router (``include_router``) as one nested route object;
    # this walks its effective routes, each with its full path (prefix included).
    from fastapi.routing import iter_route_contexts as _effective_routes
except ImportError:  # FastAPI absent, or older: included routes are flat Starlette routes
    _effective_routes = None  # type: ignore[assignment]

__all__ = ["RouteIndex", "index_of", "literal_head", "template_in"]

_Candidate = tuple[Callable[[str], Any], Any, bool]
"""A route with a path regex: its regex's ``match``, the route, and whether it is a mount."""


class RouteIndex:
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
            found.append(((regex.match, route, mount), literal_head(route, regex)))
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


def literal_head(route: Any, regex: Any) -> str | None:
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


def index_of(indexes: dict[int, RouteIndex], routes: Any) -> RouteIndex:
    """The index of ``routes`` (a router's list), rebuilt when the list grew or shrank (routes
    added at run time); bounded, as mounts are few."""
    index = indexes.get(id(routes))
    if index is None or index.routes is not routes or index.size != len(routes):
        if len(indexes) >= _MAX_INDEXES:
            indexes.clear()
        index = indexes[id(routes)] = RouteIndex(routes)
    return index


def template_in(
    indexes: dict[int, RouteIndex], routes: Any, path: str, prefix: str, depth: int = 0
) -> str | None:
    """The template of the first Starlette route whose path matches (method ignored, as
    Starlette's partial matches do), looking into mounts and FastAPI's included routers."""
    if not isinstance(routes, list | tuple):
        routes = list(routes)  # (a router of its own kind: indexed anew, correct if slow)
    for match, route, mount in index_of(indexes, routes).candidates(path):
        m = match(path)
        if m is None:
            continue
        if mount:
            inner = route.routes
            if inner and depth < 8:
                found = template_in(
                    indexes, inner, "/" + m.group("path"), prefix + route.path, depth + 1
                )
                if found is not None:
                    return found
        fmt: str = route.path_format
        return prefix + fmt
    return None
