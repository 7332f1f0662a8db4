"""The ASGI middleware's route templates: the indexed lookup names the route a walk of every
route would, and its caches stay bounded (O1's bounded label sets; bad input: a flood of
distinct paths).

A path cache miss used to try every route's regex in order (13 us for a 22-route FastAPI app
on a slow machine, on nearly every request of a service with ids in its paths, and the whole
cache was dropped when full). Now the router's routes are grouped by the literal first
segment they require, and the cache keeps a second generation. The oracle below is the walk
as it was; the index must agree with it on every path, for routers with mounts (nested, at
the root, with a parameter), FastAPI's included routers, routes with a parameter first, the
root route, websocket routes and host routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Host, Mount, Route, WebSocketRoute
from tests.edge_inputs import asgi_scope

from brownout import Bulkhead, EdgePolicy
from brownout.integrations._asgi_routes import RouteIndex, template_in
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

try:
    from fastapi.routing import iter_route_contexts as _effective_routes
except ImportError:  # older FastAPI: included routes are flat Starlette routes
    _effective_routes = None  # type: ignore[assignment]


def linear_template(routes: Any, path: str, prefix: str = "", depth: int = 0) -> str | None:
    """The walk before the index: every route's regex, in order (the oracle)."""
    if _effective_routes is not None and not all(hasattr(r, "path_regex") for r in routes):
        routes = _effective_routes(routes)
    for route in routes:
        regex = getattr(route, "path_regex", None)
        if regex is None:
            continue
        m = regex.match(path)
        if m is None:
            continue
        if isinstance(getattr(route, "original_route", route), Mount):
            inner = route.routes
            if inner and depth < 8:
                found = linear_template(
                    inner, "/" + m.group("path"), prefix + route.path, depth + 1
                )
                if found is not None:
                    return found
        fmt: str = route.path_format
        return prefix + fmt
    return None


async def ok(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def ws(websocket: Any) -> None:
    await websocket.close()


def starlette_app() -> Starlette:
    inner = [
        Route("/", ok),
        Route("/reports/{rid}", ok),
        Route("/reports/{rid}/pages/{n:int}", ok),
        Route("/{anything:path}", ok),
    ]
    return Starlette(
        routes=[
            Route("/", ok),
            Route("/items", ok),
            Route("/items/{item_id:int}", ok),
            Route("/items/{item_id}/parts/{part}", ok),
            Route("/items.json", ok),
            Route("/a.b", ok),
            WebSocketRoute("/ws/{room}", ws),
            Mount("/legacy", routes=inner),
            Mount("/tenants/{tenant}", routes=[Route("/items/{item_id}", ok)]),
            Host("api.example.com", app=Starlette(routes=[Route("/host-only", ok)])),
            Route("/{slug}", ok),
            Route("/{slug}/items", ok),
            Mount("/static", app=ok),
            Mount("", routes=[Route("/rooted/{x}", ok)]),
        ]
    )


def fastapi_app() -> FastAPI:
    app = FastAPI()
    orders = APIRouter()

    @orders.get("/{order_id}")
    async def order(order_id: str) -> str:
        return order_id

    @orders.get("/{order_id}/lines")
    async def lines(order_id: str) -> str:
        return order_id

    nested = APIRouter()
    nested.include_router(orders, prefix="/orders")
    app.include_router(nested, prefix="/v1")

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/{catch}")
    async def catch(catch: str) -> str:
        return catch

    app.mount("/legacy", Starlette(routes=[Route("/reports/{rid}", ok)]))
    return app


APPS = {"starlette": starlette_app(), "fastapi": fastapi_app()}
SEGMENTS = [
    "",
    "items",
    "items.json",
    "a.b",
    "aXb",
    "7",
    "x",
    "parts",
    "legacy",
    "reports",
    "pages",
    "tenants",
    "ws",
    "static",
    "rooted",
    "host-only",
    "v1",
    "orders",
    "lines",
    "ping",
    "ITEMS",
    "items ",
    "%2F",
    "é",
]
paths = st.lists(st.sampled_from(SEGMENTS), min_size=0, max_size=6).map(
    lambda parts: "/" + "/".join(parts)
) | st.text(max_size=20)


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(sorted(APPS)), path=paths)
def test_the_index_names_the_route_the_walk_of_every_route_names(name: str, path: str) -> None:
    routes = APPS[name].router.routes
    assert template_in({}, routes, path, "") == linear_template(routes, path)


def test_known_paths_get_their_templates() -> None:
    routes = APPS["starlette"].router.routes
    indexes: dict[int, RouteIndex] = {}
    cases = {
        "/": "/",
        "/items/7": "/items/{item_id}",
        "/items/x": "/{path}",  # not /items/{int}: the mount at the root takes it
        "/items/7/parts/p": "/items/{item_id}/parts/{part}",
        "/items.json": "/items.json",
        "/aXb": "/{slug}",  # the dot is literal, not a regex wildcard
        "/legacy/reports/r1/pages/2": "/legacy/reports/{rid}/pages/{n}",
        "/legacy/elsewhere": "/legacy/{anything}",
        "/tenants/t1/items/9": "/tenants/{tenant}/items/{item_id}",
        "/x/items": "/{slug}/items",
        "/rooted/1": "/rooted/{x}",
        "/static/app.css": "/static/{path}",
    }
    for path, template in cases.items():
        assert template_in(indexes, routes, path, "") == template, path
        assert linear_template(routes, path) == template, path
    fastapi_routes = APPS["fastapi"].router.routes
    assert template_in(indexes, fastapi_routes, "/v1/orders/o1/lines", "") == (
        "/v1/orders/{order_id}/lines"
    )
    assert template_in(indexes, fastapi_routes, "/v1/ping", "") == "/v1/ping"


def test_the_index_groups_routes_by_their_literal_first_segment() -> None:
    index = RouteIndex(APPS["starlette"].router.routes)
    dynamic = [route.path for _, route, _ in index.dynamic]
    assert dynamic == ["/{slug}", "/{slug}/items", ""]  # in the router's order
    items = [route.path for _, route, _ in index.candidates("/items/7")]
    assert items == [
        "/items",
        "/items/{item_id:int}",
        "/items/{item_id}/parts/{part}",
        "/{slug}",
        "/{slug}/items",
        "",
    ]
    assert "items.json" in index.by_segment and "a.b" in index.by_segment
    assert index.candidates("no-leading-slash") == index.dynamic


def test_a_route_whose_path_and_regex_disagree_is_tried_for_every_path() -> None:
    """A route class of the application's own: the index trusts a literal head only when
    the route's regex starts with it, as Starlette compiles it."""
    import re

    class Odd(Route):
        def __init__(self) -> None:
            super().__init__("/a", ok)
            self.path_regex = re.compile("^/b/(?P<n>[0-9]+)$")
            self.path_format = "/b/{n}"

    routes = [Route("/c", ok), Odd()]
    assert linear_template(routes, "/b/1") == "/b/{n}"
    assert template_in({}, routes, "/b/1", "") == "/b/{n}"
    assert template_in({}, tuple(routes), "/b/1", "") == "/b/{n}"


def test_routes_added_at_run_time_are_found() -> None:
    app = Starlette(routes=[Route("/a", ok)])
    indexes: dict[int, RouteIndex] = {}
    assert template_in(indexes, app.router.routes, "/late/1", "") is None
    app.add_route("/late/{n}", ok)
    assert template_in(indexes, app.router.routes, "/late/1", "") == "/late/{n}"


def middleware_of(app: Any) -> BrownoutMiddleware:
    layer = app.middleware_stack
    while not isinstance(layer, BrownoutMiddleware):
        layer = layer.app
    return layer


async def get(app: Any, path: str) -> int:
    scope = asgi_scope(path, [])
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def test_bounded_path_cache_keeps_paths_in_use_through_a_flood_of_distinct_paths() -> None:
    """A flood of 20,000 distinct paths (ids in URLs) leaves at most two generations of
    ``path_cache_size`` paths, one shared entry per template, and the path in use every
    tenth request still cached: it is promoted from the previous generation, never walked
    again."""

    async def main() -> None:
        app = Starlette(routes=[Route("/items/{item_id}", ok), Route("/hot", ok)])
        app.add_middleware(
            BrownoutMiddleware,
            policy=EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(8))),
            path_cache_size=64,
        )
        assert await get(app, "/hot") == 200
        layer = middleware_of(app)
        walks = 0
        walk = layer._route

        def counting(scope: Any, path: str) -> Any:
            nonlocal walks
            if path == "/hot" and path not in layer._previous:
                walks += 1
            return walk(scope, path)

        layer._route = counting  # type: ignore[method-assign]
        for i in range(20_000):
            assert await get(app, f"/items/{i}") == 200
            if i % 10 == 0:
                assert await get(app, "/hot") == 200
        assert walks == 0
        assert len(layer._paths) <= 64 and len(layer._previous) <= 64
        assert set(layer._templates) == {"/items/{item_id}", "/hot"}
        assert len(layer._indexes) == 1
        entries = {id(layer._paths[p]) for p in layer._paths if p.startswith("/items/")}
        assert len(entries) == 1  # one shared (route, plan) per template

    asyncio.run(main())


def test_path_cache_size_must_hold_a_path() -> None:
    import pytest

    with pytest.raises(ValueError, match="path_cache_size"):
        BrownoutMiddleware(ok, EdgePolicy(), path_cache_size=0)
