"""Degradation through the real edge (G1-G4): uvicorn + Starlette + BrownoutMiddleware with
``EdgePolicy(degraded=modes)``, a real origin server behind httpx, real HTTP clients.

Shows: the ``brownout-degraded`` header while a mode is active (and not otherwise), the
declared fallback served, stale content with its age in ``age``/``brownout-stale-age``, the
error once the content is older than its maximum staleness, the fail-closed 503 problem body
(with its ``degraded`` field) when the authorization origin fails, and a drill run against
the live server catching a fallback that calls the failed dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from brownout import (
    DegradedMode,
    DegradedModes,
    EdgePolicy,
    FailClosedGuard,
    StaleCache,
    depends_on,
)
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.testing import DrillFailed, drill
from brownout.wire import stale_headers

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def origin_app(state: dict[str, bool]) -> Starlette:
    async def home(request: Request) -> JSONResponse:
        if state["down"]:
            return JSONResponse({"error": "down"}, status_code=500)
        return JSONResponse({"headline": "fresh news"})

    async def authz(request: Request) -> JSONResponse:
        if state["down"]:
            return JSONResponse({"error": "down"}, status_code=500)
        return JSONResponse({"allow": True})

    async def recs(request: Request) -> JSONResponse:
        return JSONResponse(["for you"])

    return Starlette(routes=[Route("/home", home), Route("/authz", authz), Route("/recs", recs)])


def front_app(origin: str, client: httpx.AsyncClient) -> tuple[Any, DegradedModes]:
    modes = DegradedModes(
        [
            DegradedMode(
                "recommendations",
                "hide personalised recommendations",
                enter_at_level=1,
                min_dwell=30.0,
                max_duration=600.0,
            ),
            DegradedMode("search-small-corpus", "search the hot shard only", enter_at_level=2),
        ]
    )
    cache: StaleCache[str, dict[str, str]] = StaleCache(
        max_entries=100, fresh_for=0.2, max_staleness=2.0, failure_backoff=0.05
    )
    authorization = FailClosedGuard("authorization", timeout=2.0)

    async def load_home() -> dict[str, str]:
        r = await client.get(f"{origin}/home")
        r.raise_for_status()
        return dict(r.json())

    @depends_on("recs-service")
    async def personalised() -> list[str]:
        r = await client.get(f"{origin}/recs")
        return list(r.json())

    async def check_authz() -> bool:
        r = await client.get(f"{origin}/authz")
        r.raise_for_status()
        return bool(r.json()["allow"])

    @modes.fallback("recommendations", lambda: ["popular"])
    async def recommendations() -> list[str]:
        return await personalised()

    @modes.fallback("recommendations", personalised)  # the G3 mistake
    async def bad_recommendations() -> list[str]:
        return await personalised()

    async def home(request: Request) -> JSONResponse:
        value, age = await cache.get("home", load_home)
        return JSONResponse(value, headers=stale_headers(age))

    async def recs(request: Request) -> JSONResponse:
        return JSONResponse(await recommendations())

    async def bad_recs(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await bad_recommendations())
        except Exception:
            return JSONResponse([], status_code=200)  # swallowing does not hide it from a drill

    async def account(request: Request) -> JSONResponse:
        allowed = await authorization.call(check_authz)
        return JSONResponse({"allowed": allowed})

    app = Starlette(
        routes=[
            Route("/home", home),
            Route("/recs", recs),
            Route("/bad-recs", bad_recs),
            Route("/account", account),
        ]
    )
    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(degraded=modes))
    return app, modes


class LevelFeed:
    """Stands in for the overload manager: ``.level`` plus ``.subscribe``."""

    def __init__(self) -> None:
        self.level = 0
        self._callbacks: list[Any] = []

    def subscribe(self, cb: Any) -> None:
        self._callbacks.append(cb)

    def set(self, level: int) -> None:
        self.level = level
        for cb in self._callbacks:
            cb()


async def test_degradation_through_the_edge() -> None:
    state = {"down": False}
    async with (
        httpx.AsyncClient(timeout=5) as backend,
        serve(origin_app(state)) as origin,
    ):
        app, modes = front_app(origin, backend)
        feed = LevelFeed()
        modes.follow(feed)
        async with serve(app) as front, httpx.AsyncClient(base_url=front, timeout=5) as http:
            # Normal operation: no mode, personalised answer, fresh content.
            r = await http.get("/recs")
            assert r.json() == ["for you"]
            assert "brownout-degraded" not in r.headers
            r = await http.get("/home")
            assert r.status_code == 200
            assert r.json() == {"headline": "fresh news"}
            assert float(r.headers["brownout-stale-age"]) < 1.0  # just loaded (noisy machine)

            # Overload level 1: the declared mode is entered and announced on every response.
            feed.set(1)
            r = await http.get("/recs")
            assert r.json() == ["popular"]
            assert r.headers["brownout-degraded"] == "recommendations"
            feed.set(2)
            r = await http.get("/home")
            assert r.headers["brownout-degraded"] == "recommendations, search-small-corpus"

            # The origin fails: content is served stale, with its age, within max staleness.
            state["down"] = True
            await asyncio.sleep(0.5)
            r = await http.get("/home")
            assert r.status_code == 200
            assert r.json() == {"headline": "fresh news"}
            stale_age = float(r.headers["brownout-stale-age"])
            assert 0.5 <= stale_age < 2.0
            assert r.headers["age"] == str(int(stale_age))
            await asyncio.sleep(0.3)
            r = await http.get("/home")
            assert r.status_code == 200
            assert float(r.headers["brownout-stale-age"]) > stale_age

            # Authorization is never degraded: 503 problem, with the degraded modes listed.
            r = await http.get("/account")
            assert r.status_code == 503
            assert r.headers["content-type"] == "application/problem+json"
            problem = r.json()
            assert problem["reason"] == "dependency_unavailable"
            assert problem["degraded"] == ["recommendations", "search-small-corpus"]
            assert r.headers["brownout-degraded"] == "recommendations, search-small-corpus"

            # Past max staleness, the content is not served any more.
            await asyncio.sleep(2.0)
            r = await http.get("/home")
            assert r.status_code == 500  # the loader's error propagated (a plain handler bug)
            assert "fresh news" not in r.text

            # Recovery: origin back, levels down; search leaves at once, recommendations
            # dwells (30 s), so only it is still announced.
            state["down"] = False
            feed.set(0)
            r = await http.get("/account")
            assert r.json() == {"allowed": True}
            assert r.headers["brownout-degraded"] == "recommendations"
            r = await http.get("/home")
            assert r.status_code == 200
            assert float(r.headers["brownout-stale-age"]) < 1.0


async def test_drill_against_the_live_server() -> None:
    state = {"down": False}
    async with (
        httpx.AsyncClient(timeout=5) as backend,
        serve(origin_app(state)) as origin,
    ):
        app, modes = front_app(origin, backend)
        async with serve(app) as front, httpx.AsyncClient(base_url=front, timeout=5) as http:
            with drill(modes, "recommendations", failed=["recs-service"], require_fallback=True):
                r = await http.get("/recs")
                assert r.json() == ["popular"]
                assert r.headers["brownout-degraded"] == "recommendations"
            r = await http.get("/recs")
            assert r.json() == ["for you"]
            assert "brownout-degraded" not in r.headers

            with pytest.raises(DrillFailed, match="called 'recs-service'"):
                with drill(modes, "recommendations", failed=["recs-service"]):
                    r = await http.get("/bad-recs")
                    assert r.status_code == 200  # the app hid the error; the drill did not


@pytest.mark.parametrize("path", ["express", "serve"])
async def test_the_header_names_modes_as_the_response_starts(path: str) -> None:
    """G2: the header was computed when the request arrived. A mode that came on while the
    handler ran went unnamed, and so did a mode whose fallback answered and that ended
    before the response (the caller got fallback content with no word of it)."""
    modes = DegradedModes([DegradedMode("recommendations", "hide personalised recommendations")])

    @modes.fallback("recommendations", lambda: ["popular"])
    async def recommendations() -> list[str]:
        return ["for you"]

    async def turns_on(request: Request) -> JSONResponse:
        modes.force("recommendations", True)
        return JSONResponse(["ok"])

    async def answered_then_ended(request: Request) -> JSONResponse:
        body = await recommendations()  # served by the fallback: the mode is on
        modes.force("recommendations", False)
        return JSONResponse(body)

    app = Starlette(routes=[Route("/on", turns_on), Route("/fallback", answered_then_ended)])
    # A priority claim is a header the edge must decide about: it takes `serve`.
    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(degraded=modes))
    headers = {"brownout-priority": "critical"} if path == "serve" else {}
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as http:
        r = await http.get("/on", headers=headers)
        assert r.headers.get("brownout-degraded") == "recommendations"
        modes.force("recommendations", True)
        r = await http.get("/fallback", headers=headers)
        assert r.json() == ["popular"]
        assert r.headers.get("brownout-degraded") == "recommendations"
        assert not modes.active("recommendations")
        r = await http.get("/fallback", headers=headers)  # off, and no fallback answered
        assert r.json() == ["for you"] and "brownout-degraded" not in r.headers
