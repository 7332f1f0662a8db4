"""Edge benchmark: naming the route of a path the ASGI middleware has not seen (ids in URLs).

`BrownoutMiddleware` labels each request by its route template, cached per path. A service
whose paths carry ids (``/items/81231``) misses that cache on nearly every request, so the
lookup on a miss is on its hot path. Prints, for FastAPI apps of 26 and 106 routes (FastAPI
adds 4 of its own), the lookup on a miss: the walk of every route (the lookup before the
index, reproduced here as the baseline) against the index by first path segment
(`brownout.integrations._asgi_routes.template_in`), and their ratio. Best of interleaved rounds.
Run under the lock, never beside tests or another benchmark:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/edge_paths_bench.py
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from starlette.routing import Mount

from brownout.integrations._asgi_routes import RouteIndex, template_in

try:
    from fastapi.routing import iter_route_contexts as _effective_routes
except ImportError:
    _effective_routes = None  # type: ignore[assignment]

REPS = 7
N = 4_000


def walk_every_route(routes: Any, path: str, prefix: str = "", depth: int = 0) -> str | None:
    """The miss before the index: every route's regex, in order."""
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
                found = walk_every_route(
                    inner, "/" + m.group("path"), prefix + route.path, depth + 1
                )
                if found is not None:
                    return found
        fmt: str = route.path_format
        return prefix + fmt
    return None


def app_with(routes: int) -> FastAPI:
    app = FastAPI()
    for i in range(routes):
        app.add_api_route(f"/r{i}/{{x}}", lambda x: {"x": x})

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    @app.get("/health")
    async def health() -> str:
        return "ok"

    return app


def lookup_cost() -> None:
    for extra in (20, 100):
        routes = app_with(extra).router.routes
        indexes: dict[int, RouteIndex] = {}
        path = "/items/5"
        assert template_in(indexes, routes, path, "") == walk_every_route(routes, path)
        best_walk = best_index = float("inf")
        for _ in range(REPS):
            t = time.perf_counter()
            for _ in range(N):
                walk_every_route(routes, path)
            best_walk = min(best_walk, (time.perf_counter() - t) / N)
            t = time.perf_counter()
            for _ in range(N):
                template_in(indexes, routes, path, "")
            best_index = min(best_index, (time.perf_counter() - t) / N)
        print(
            f"route lookup on a path cache miss, {len(routes)} routes: every route "
            f"{best_walk * 1e6:6.2f} us, indexed {best_index * 1e6:5.2f} us: "
            f"{best_walk / best_index:.1f}x faster"
        )


if __name__ == "__main__":
    lookup_cost()
