"""The aiohttp edge's express path against a real aiohttp server and a real aiohttp client.

As for the ASGI middleware (``test_asgi_express.py``): a request that carries no brownout
header (or only a plain budget), on a route whose policy needs nothing beyond the defaults, at
an uncontended bulkhead, is served inline by the middleware instead of through
`EdgePolicy.serve`. These tests check that it behaves and counts exactly as the general path
does: D2/D3 (deadline from the route default or a plain budget, clamped, in the request
context), D5 (cancel at expiry or disconnect), S2 (problem+json refusals), O1 (every outcome
counted: completed, failed, expired, abandoned; aiohttp's HTTP exceptions are answers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tests.integration.servers import send_then_hang_up
from tests.limits import CountingBulkhead, SpyLimit

import brownout
from brownout import (
    Classification,
    DegradedMode,
    DegradedModes,
    EdgePolicy,
    Priority,
    Reason,
    Rejected,
    Route,
    Stats,
)
from brownout.events import EventHub
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


@dataclass
class Service:
    base: str
    stats: Stats
    bulkhead: CountingBulkhead
    cancelled: list[str] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)


def build_app(svc: Service, policy: EdgePolicy) -> web.Application:
    bulkhead = svc.bulkhead

    async def item(request: web.Request) -> web.Response:
        ctx = brownout.current()
        svc.seen.append(
            {
                "remaining": ctx.remaining(),
                "priority": ctx.priority,
                "operation": ctx.operation,
                "caller": ctx.caller,
                "in_flight": bulkhead.in_flight,
            }
        )
        try:
            await asyncio.sleep(float(request.query.get("hold", "0")))
        except asyncio.CancelledError:
            svc.cancelled.append(f"items/{request.match_info['id']}")
            raise
        return web.json_response({"id": request.match_info["id"]})

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"oops": True}, status=500)

    async def raises(request: web.Request) -> web.Response:
        raise RuntimeError("boom")

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def breaker(request: web.Request) -> web.Response:
        raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")

    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/items/{id}", item)
    app.router.add_get("/broken", broken)
    app.router.add_get("/raises", raises)
    app.router.add_get("/missing", missing)
    app.router.add_get("/breaker", breaker)
    return app


async def start(
    hub_has_stats: bool = True, limit: Any = None, **policy: Any
) -> AsyncIterator[Service]:
    hub = EventHub()
    stats = Stats()
    if hub_has_stats:
        hub.subscribe(stats)
    # A plain FIFO queue: the default CoDel queue may refuse a waiter held 250 ms (by design).
    bulkhead = CountingBulkhead(
        "aio", limit or FixedLimit(1), FifoQueue(max_size=4, max_wait=2.0), events=hub
    )
    svc = Service("", stats, bulkhead)
    policy.setdefault("routes", {"/items/{id}": Route(default=1.5, maximum=5.0)})
    app = build_app(svc, EdgePolicy(bulkhead=bulkhead, events=hub, **policy))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    svc.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield svc
    finally:
        await runner.cleanup()


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async for svc in start():
        yield svc


async def settle() -> None:
    await asyncio.sleep(0.05)  # the bulkhead settles just after the last byte left


async def get(base: str, path: str, **kwargs: Any) -> tuple[int, Any, dict[str, str]]:
    async with (
        aiohttp.ClientSession(base) as session,
        session.get(path, **kwargs) as r,
    ):
        json_body = "json" in r.headers.get("content-type", "")
        body = await (r.json(content_type=None) if json_body else r.text())
        return r.status, body, dict(r.headers)


async def test_a_plain_request_takes_the_express_path_with_the_route_defaults(
    service: Service,
) -> None:
    status, _, _ = await get(service.base, "/items/1")
    assert status == 200
    assert service.bulkhead.express == 1
    seen = service.seen[0]
    assert 1.0 < seen["remaining"] <= 1.5  # D2: the route default, in the request context
    assert seen["priority"] is Priority.CRITICAL
    assert seen["operation"] == "/items/{id}"
    assert seen["in_flight"] == 1  # admitted: it holds a slot while it runs
    await settle()
    assert service.bulkhead.in_flight == 0
    for kind in ("offered", "admitted", "completed"):
        assert service.stats.count(kind, operation="/items/{id}") == 1, kind


async def test_express_and_general_paths_count_alike(service: Service) -> None:
    for i in range(5):
        assert (await get(service.base, f"/items/{i}"))[0] == 200
    for i in range(5):  # a priority claim sends a request through EdgePolicy.serve
        status, _, _ = await get(
            service.base, f"/items/{i}", headers={"brownout-priority": "sheddable"}
        )
        assert status == 200
    assert service.bulkhead.express == 5
    assert service.seen[-1]["priority"] is Priority.CRITICAL  # untrusted: claim ignored
    await settle()
    for kind in ("offered", "admitted", "completed"):
        assert service.stats.count(kind, operation="/items/{id}") == 10, kind
    assert service.stats.count("failed") == 0


async def test_header_names_are_matched_whatever_their_case(service: Service) -> None:
    """aiohttp keeps the case a client sent: a claim in any case leaves the express path (it
    is `serve`'s to judge), and a plain budget in any case is honoured on it."""
    await get(service.base, "/items/1", headers={"Brownout-Priority": "sheddable"})
    await get(service.base, "/items/2", headers={"Brownout-Budget-Ms": "400"})
    await get(service.base, "/items/3", headers={"BROWNOUT-BUDGET-MS": "60000"})
    assert service.bulkhead.express == 2  # the claim went through serve
    assert 0.2 < service.seen[1]["remaining"] <= 0.4
    assert 4.0 < service.seen[2]["remaining"] <= 5.0  # clamped to the route maximum


async def test_a_plain_budget_header_stays_on_the_express_path(service: Service) -> None:
    """D2/D3: as `InboundDeadlinePolicy.resolve` would; a spent or malformed budget is
    `serve`'s (it answers 504 before the work starts, or reports the header and ignores it)."""
    short = await get(service.base, "/items/1", headers={"brownout-budget-ms": "400"})
    spent = await get(service.base, "/items/2", headers={"brownout-budget-ms": "0"})
    bad = await get(service.base, "/items/3", headers={"brownout-budget-ms": "soon"})
    assert short[0] == 200 and spent[0] == 504 and bad[0] == 200
    assert service.bulkhead.express == 1
    assert 0.2 < service.seen[0]["remaining"] <= 0.4
    assert 1.0 < service.seen[1]["remaining"] <= 1.5  # ignored: the route default applies


async def test_express_expiry_cancels_the_handler_and_answers_504(service: Service) -> None:
    t0 = time.perf_counter()
    status, body, headers = await get(service.base, "/items/7", params={"hold": "10"})
    took = time.perf_counter() - t0
    assert service.bulkhead.express == 1
    assert status == 504
    assert headers["Content-Type"] == "application/problem+json"
    assert body["reason"] == "deadline_expired"
    assert took < 5.0  # the 1.5 s route default, with a generous margin for a busy machine
    assert "items/7" in service.cancelled  # D5: the work stopped
    await settle()
    assert service.stats.count("expired", reason="running") == 1
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_express_5xx_and_exceptions_are_failures_http_exceptions_answers(
    service: Service,
) -> None:
    assert (await get(service.base, "/broken"))[0] == 500
    assert (await get(service.base, "/raises"))[0] == 500
    assert (await get(service.base, "/missing"))[0] == 404
    assert service.bulkhead.express == 3
    await settle()
    assert service.stats.count("failed", operation="/broken") == 1
    assert service.stats.count("failed", operation="/raises") == 1
    assert service.stats.count("completed", operation="/missing") == 1  # an answer
    assert service.bulkhead.in_flight == 0


async def test_express_refusal_from_inside_the_handler_is_problem_json(service: Service) -> None:
    status, body, _ = await get(service.base, "/breaker")
    again = await get(service.base, "/items/1")  # the slot is still usable
    assert service.bulkhead.express == 2
    assert status == 503
    assert body["reason"] == "breaker_open"
    assert again[0] == 200
    await settle()
    assert service.bulkhead.in_flight == 0


async def test_express_client_disconnect_cancels_and_counts_abandoned(service: Service) -> None:
    await send_then_hang_up(service.base, "/items/5?hold=3")
    for _ in range(150):
        if "items/5" in service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.bulkhead.express == 1
    assert "items/5" in service.cancelled  # D5
    await settle()
    assert service.stats.count("abandoned") == 1  # O1: not a success
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_a_contended_bulkhead_sends_requests_through_the_queue(service: Service) -> None:
    holder = asyncio.create_task(get(service.base, "/items/1", params={"hold": "0.4"}))
    await asyncio.sleep(0.15)  # the limit of 1 is held: the next one must queue
    queued = await get(service.base, "/items/2")
    assert (await holder)[0] == 200
    assert queued[0] == 200
    assert service.bulkhead.express == 1
    await settle()
    assert service.stats.count("completed", operation="/items/{id}") == 2


async def test_without_listeners_express_admissions_still_free_slots() -> None:
    async for svc in start(hub_has_stats=False):
        async with aiohttp.ClientSession(svc.base) as session:
            for _ in range(50):
                async with session.get("/items/1") as r:
                    assert r.status == 200
            async with session.get("/raises") as r:
                assert r.status == 500
            async with session.get("/items/2", params={"hold": "10"}) as r:
                assert r.status == 504
        await settle()
        assert svc.bulkhead.express == 52
        assert svc.bulkhead.in_flight == 0


async def test_the_classifier_runs_on_the_express_path() -> None:
    classified: list[Classification] = []

    def classify(request: web.Request, default: Classification) -> Classification:
        classified.append(default)
        caller = request.headers.get("x-tenant", "anonymous")
        return default._replace(caller=caller, priority=Priority.SHEDDABLE)

    async for svc in start(limit=FixedLimit(4), classifier=classify):
        await get(svc.base, "/items/3", headers={"x-tenant": "acme"})
        assert svc.bulkhead.express == 1
        assert classified[0] == Classification(Priority.CRITICAL, "unknown", "/items/{id}")
        assert (svc.seen[0]["caller"], svc.seen[0]["priority"]) == ("acme", Priority.SHEDDABLE)
        await settle()
        assert svc.stats.count("completed", caller="acme", priority="sheddable") == 1


async def test_degraded_modes_on_the_express_path() -> None:
    """G1/G2: the active modes are named on the response, and a fallback's answer is goodput
    that never teaches the adaptive limit (as under `serve`)."""
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    spy = SpyLimit()
    bulkhead = CountingBulkhead("aio", spy, events=hub)  # type: ignore[arg-type]
    modes = DegradedModes([DegradedMode("recs", "recommendations from a default list")])

    @modes.fallback("recs", lambda: "default")
    async def recommendations() -> str:
        await asyncio.sleep(0.01)
        return "personal"

    async def recs(request: web.Request) -> web.Response:
        return web.json_response({"recs": await recommendations()})

    policy = EdgePolicy(bulkhead=bulkhead, degraded=modes, events=hub)
    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/recs", recs)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        normal = await get(base, "/recs")
        await settle()
        taught = len(spy.samples)
        modes.force("recs", on=True)
        degraded = await get(base, "/recs")
        await settle()
    finally:
        await runner.cleanup()
    assert bulkhead.express == 2
    assert normal[1] == {"recs": "personal"}
    assert "brownout-degraded" not in normal[2]
    assert taught == 1  # a real answer is a sample for the limit
    assert degraded[1] == {"recs": "default"}
    assert degraded[2]["brownout-degraded"] == "recs"
    assert len(spy.samples) == 1  # the fallback's answer is not
    assert stats.count("completed") == 2  # both are goodput
    assert bulkhead.in_flight == 0


@pytest.mark.parametrize("express", [True, False], ids=["express", "serve"])
async def test_a_handler_that_swallows_the_disconnect_cancel_is_still_abandoned(
    express: bool,
) -> None:
    """Without ``handler_cancellation`` the sweep notices the closed connection and cancels the
    handler; one that swallows the cancellation and answers anyway is abandoned, not
    completed (O1), on either path (a priority claim sends the request through `serve`)."""
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    bulkhead = CountingBulkhead("aio", FixedLimit(4), events=hub)
    swallowed = asyncio.Event()

    async def stubborn(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            swallowed.set()
        return web.json_response({"answered": "anyway"})

    app = web.Application(
        middlewares=[brownout_middleware(EdgePolicy(bulkhead=bulkhead, events=hub))]
    )
    app.router.add_get("/stubborn", stubborn)
    runner = web.AppRunner(app)  # handler_cancellation off: aiohttp's default
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        claim = b"" if express else b"brownout-priority: sheddable\r\n"
        await send_then_hang_up(f"http://127.0.0.1:{runner.addresses[0][1]}", "/stubborn", claim)
        await asyncio.wait_for(swallowed.wait(), 5)
        await settle()
    finally:
        await runner.cleanup()
    assert bulkhead.express == (1 if express else 0)
    assert stats.count("abandoned") == 1
    assert stats.count("completed") == 0
    assert bulkhead.in_flight == 0
