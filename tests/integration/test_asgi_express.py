"""The ASGI edge's express path against a real uvicorn server and a real httpx client.

A request that carries no brownout header, on a route whose policy needs nothing beyond the
defaults, at an uncontended bulkhead, is served inline by the middleware instead of through
`EdgePolicy.serve` (`EdgePolicy.express`, `Bulkhead.admit_uncontended`). These tests check that
it behaves and counts exactly as the general path does: D2/D3 (deadline from the route
default, in the request context), D5 (cancel at expiry or disconnect), S2 (problem+json
refusals), O1 (every outcome counted: completed, failed, expired, abandoned).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from tests.integration.servers import send_then_hang_up, serve
from tests.limits import CountingBulkhead, SpyLimit

import brownout
from brownout import (
    Bulkhead,
    Classification,
    DegradedMode,
    DegradedModes,
    EdgePolicy,
    Priority,
    Reason,
    Rejected,
    Route,
    Stats,
    Trust,
)
from brownout.events import EventHub
from brownout.integrations.asgi import BrownoutMiddleware
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


def build_app(hub: EventHub, bulkhead: Bulkhead, cancelled: list[str], seen: list[Any]) -> FastAPI:
    app = FastAPI()

    @app.get("/items/{id}")
    async def item(id: int, hold: float = 0.0) -> dict[str, Any]:
        ctx = brownout.current()
        seen.append(
            {
                "remaining": ctx.remaining(),
                "priority": ctx.priority,
                "operation": ctx.operation,
                "in_flight": bulkhead.in_flight,
            }
        )
        try:
            await asyncio.sleep(hold)
        except asyncio.CancelledError:
            cancelled.append(f"items/{id}")
            raise
        return {"id": id}

    @app.get("/broken")
    async def broken() -> JSONResponse:
        return JSONResponse({"oops": True}, status_code=500)

    @app.get("/raises")
    async def raises() -> None:
        raise RuntimeError("boom")

    @app.get("/breaker")
    async def breaker() -> None:
        raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")

    policy = EdgePolicy(
        bulkhead=bulkhead,
        routes={"/items/{id}": Route(default=1.5, maximum=5.0)},
        events=hub,
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    return app


async def start(hub_has_stats: bool = True) -> AsyncIterator[Service]:
    hub = EventHub()
    stats = Stats()
    if hub_has_stats:
        hub.subscribe(stats)
    # A plain FIFO queue: the default CoDel queue may refuse a waiter held 250 ms (by design).
    bulkhead = CountingBulkhead(
        "api", FixedLimit(1), FifoQueue(max_size=4, max_wait=2.0), events=hub
    )
    svc = Service("", stats, bulkhead)
    app = build_app(hub, bulkhead, svc.cancelled, svc.seen)
    async with serve(app) as base:
        svc.base = base
        yield svc


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async for svc in start():
        yield svc


async def settle() -> None:
    await asyncio.sleep(0.05)  # the bulkhead settles just after the last byte left


async def test_a_plain_request_takes_the_express_path_with_the_route_defaults(
    service: Service,
) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        r = await client.get("/items/1")
    assert r.status_code == 200
    assert service.bulkhead.express == 1
    seen = service.seen[0]
    assert 1.0 < seen["remaining"] <= 1.5  # D2: the route default, in the request context
    assert seen["priority"] is Priority.CRITICAL
    assert seen["operation"] == "/items/{id}"
    assert seen["in_flight"] == 1  # admitted: it holds a slot while it runs
    await settle()
    assert service.bulkhead.in_flight == 0
    assert service.stats.count("offered", operation="/items/{id}") == 1
    assert service.stats.count("admitted", operation="/items/{id}") == 1
    assert service.stats.count("completed", operation="/items/{id}") == 1


async def test_express_and_general_paths_count_alike(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        for i in range(5):
            assert (await client.get(f"/items/{i}")).status_code == 200
        for i in range(5):  # a priority claim sends a request through EdgePolicy.serve
            r = await client.get(f"/items/{i}", headers={"brownout-priority": "sheddable"})
            assert r.status_code == 200
    assert service.bulkhead.express == 5
    assert service.seen[-1]["priority"] is Priority.CRITICAL  # untrusted: claim ignored
    await settle()
    for kind in ("offered", "admitted", "completed"):
        assert service.stats.count(kind, operation="/items/{id}") == 10, kind
    assert service.stats.count("failed") == 0


async def test_express_expiry_cancels_the_handler_and_answers_504(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        t0 = time.perf_counter()
        r = await client.get("/items/7?hold=10")
        took = time.perf_counter() - t0
    assert service.bulkhead.express == 1
    assert r.status_code == 504
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["reason"] == "deadline_expired"
    assert took < 5.0  # the 1.5 s route default, with a generous margin for a busy machine
    assert "items/7" in service.cancelled  # D5: the work stopped
    await settle()
    assert service.stats.count("expired", reason="running") == 1
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_express_5xx_and_exceptions_are_failures(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        assert (await client.get("/broken")).status_code == 500
        assert (await client.get("/raises")).status_code == 500
    assert service.bulkhead.express == 2
    await settle()
    assert service.stats.count("failed", operation="/broken") == 1
    assert service.stats.count("failed", operation="/raises") == 1
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_express_refusal_from_inside_the_handler_is_problem_json(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        r = await client.get("/breaker")
        again = await client.get("/items/1")  # the connection and the slot are still usable
    assert service.bulkhead.express == 2
    assert r.status_code == 503
    assert r.json()["reason"] == "breaker_open"
    assert again.status_code == 200
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
    async with httpx.AsyncClient(base_url=service.base) as client:
        holder = asyncio.create_task(client.get("/items/1?hold=0.4"))
        await asyncio.sleep(0.15)  # the limit of 1 is held: the next one must queue
        queued = await client.get("/items/2")
        assert (await holder).status_code == 200
    assert queued.status_code == 200
    assert service.bulkhead.express == 1
    await settle()
    assert service.stats.count("completed", operation="/items/{id}") == 2


async def test_without_listeners_express_admissions_allocate_nothing_and_still_free_slots() -> None:
    async for svc in start(hub_has_stats=False):
        async with httpx.AsyncClient(base_url=svc.base) as client:
            for _ in range(100):
                assert (await client.get("/items/1")).status_code == 200
            assert (await client.get("/raises")).status_code == 500
            assert (await client.get("/items/2?hold=10")).status_code == 504
        await settle()
        assert svc.bulkhead.express == 102
        assert svc.bulkhead.in_flight == 0
        # The estimator still learns, from one admission in estimate_every (16): 100
        # requests give it the 5 samples it needs for an estimate.
        estimates = svc.bulkhead.estimator.estimates if svc.bulkhead.estimator else {}
        assert "/items/{id}" in estimates


async def test_the_classifier_runs_on_the_express_path_and_trust_does_not_matter() -> None:
    """A classifier and a trust function do not send header-less requests off the express
    path: the classifier sees the route's default classification, as under `serve` (S4: trust
    only decides about headers, and these requests carry none)."""
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    bulkhead = CountingBulkhead("api", FixedLimit(4), events=hub)
    seen: list[Any] = []
    classified: list[Classification] = []

    def classify(scope: Any, default: Classification) -> Classification:
        classified.append(default)
        caller = dict(scope["headers"]).get(b"x-tenant", b"anonymous").decode()
        return default._replace(caller=caller, priority=Priority.SHEDDABLE)

    app = FastAPI()

    @app.get("/items/{id}")
    async def item(id: int) -> dict[str, Any]:
        ctx = brownout.current()
        seen.append((ctx.caller, ctx.priority, ctx.operation))
        return {"id": id}

    policy = EdgePolicy(
        bulkhead=bulkhead,
        classifier=classify,
        trust=lambda scope: Trust.UNTRUSTED,
        events=hub,
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        r = await client.get("/items/3", headers={"x-tenant": "acme"})
        forged = await client.get("/items/4", headers={"brownout-priority": "critical_plus"})
    assert r.status_code == 200 and forged.status_code == 200
    assert bulkhead.express == 1  # the forged claim went through serve, which ignores it
    assert classified[0] == Classification(Priority.CRITICAL, "unknown", "/items/{id}")
    assert seen == [
        ("acme", Priority.SHEDDABLE, "/items/{id}"),
        ("anonymous", Priority.SHEDDABLE, "/items/{id}"),
    ]
    await settle()
    assert stats.count("completed", caller="acme", priority="sheddable") == 1
    assert stats.count("completed", caller="anonymous", priority="sheddable") == 1


async def test_degraded_modes_on_the_express_path() -> None:
    """G1/G2 on the express path: the active modes are named on the response, and a
    fallback's answer is goodput that never teaches the adaptive limit (as under `serve`)."""

    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    spy = SpyLimit()
    bulkhead = CountingBulkhead("api", spy, events=hub)  # type: ignore[arg-type]
    modes = DegradedModes([DegradedMode("recs", "recommendations from a default list")])

    @modes.fallback("recs", lambda: "default")
    async def recommendations() -> str:
        await asyncio.sleep(0.01)
        return "personal"

    app = FastAPI()

    @app.get("/recs")
    async def recs() -> dict[str, str]:
        return {"recs": await recommendations()}

    app.add_middleware(
        BrownoutMiddleware, policy=EdgePolicy(bulkhead=bulkhead, degraded=modes, events=hub)
    )
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        normal = await client.get("/recs")
        await settle()
        taught = len(spy.samples)
        modes.force("recs", on=True)
        degraded = await client.get("/recs")
        await settle()
    assert bulkhead.express == 2
    assert normal.json() == {"recs": "personal"}
    assert "brownout-degraded" not in normal.headers
    assert taught == 1  # a real answer is a sample for the limit
    assert degraded.json() == {"recs": "default"}
    assert degraded.headers["brownout-degraded"] == "recs"
    assert len(spy.samples) == 1  # the fallback's answer is not
    assert stats.count("completed") == 2  # both are goodput
    assert bulkhead.in_flight == 0


async def test_a_plain_budget_header_stays_on_the_express_path(service: Service) -> None:
    """D2/D3: calls between brownout services carry a budget; the express path honours it as
    `InboundDeadlinePolicy.resolve` would (clamped to the route maximum); anything it would
    have to report (a malformed value) goes through `serve`, which reports it."""
    async with httpx.AsyncClient(base_url=service.base) as client:
        short = await client.get("/items/1", headers={"brownout-budget-ms": "400"})
        long = await client.get("/items/2", headers={"brownout-budget-ms": "60000"})
        spent = await client.get("/items/3", headers={"brownout-budget-ms": "0"})
        bad = await client.get("/items/4", headers={"brownout-budget-ms": "soon"})
    assert short.status_code == 200 and long.status_code == 200
    assert service.bulkhead.express == 2  # the spent and the malformed budgets took serve
    assert 0.2 < service.seen[0]["remaining"] <= 0.4
    assert 4.0 < service.seen[1]["remaining"] <= 5.0  # clamped to the route maximum
    assert spent.status_code == 504  # serve: expired before the work started
    assert bad.status_code == 200  # serve: ignored (and reported), the route default applies
    assert 1.0 < service.seen[2]["remaining"] <= 1.5


async def test_express_exchange_sets_every_field() -> None:
    """The express path builds its exchange field by field (no ``__init__`` frame on the hot
    path); every slot must be set there, as `Exchange.__init__` sets it for `serve`, or a
    rarer path (a sweep, a disconnect, an expiry) would meet an unset attribute."""
    from brownout._edge import Flight
    from brownout.integrations._asgi_exchange import Exchange

    captured: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        captured.append(receive)  # the exchange itself, while watching for disconnects
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    bulkhead = CountingBulkhead("express-fields", FixedLimit(4))
    middleware = BrownoutMiddleware(app, policy=EdgePolicy(bulkhead=bulkhead))
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/x", "root_path": "", "headers": [], "method": "GET"}
    await middleware(scope, receive, send)
    assert bulkhead.express == 1 and sent[0]["status"] == 200
    exchange = captured[0]
    assert type(exchange) is Exchange
    slots = {*Flight.__slots__, *Exchange.__slots__}
    assert {name for name in slots if not hasattr(exchange, name)} == set()
    assert exchange.admitted and not exchange.reports and exchange.response_done


@pytest.mark.parametrize("express", [True, False], ids=["express", "serve"])
async def test_an_app_that_swallows_the_disconnect_cancel_is_still_abandoned(
    express: bool,
) -> None:
    """The middleware cancels the application when its client goes away; one that swallows
    the cancellation and answers anyway is abandoned, not completed (O1), on either path (a
    priority claim sends the request through `serve`)."""
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    bulkhead = CountingBulkhead("api", FixedLimit(4), events=hub)
    swallowed = asyncio.Event()
    app = FastAPI()

    @app.get("/stubborn")
    async def stubborn() -> dict[str, str]:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            swallowed.set()
        return {"answered": "anyway"}

    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=bulkhead, events=hub))
    async with serve(app) as base:
        claim = b"" if express else b"brownout-priority: sheddable\r\n"
        await send_then_hang_up(base, "/stubborn", claim)
        await asyncio.wait_for(swallowed.wait(), 5)
        await settle()
    assert bulkhead.express == (1 if express else 0)
    assert stats.count("abandoned") == 1
    assert stats.count("completed") == 0
    assert bulkhead.in_flight == 0
