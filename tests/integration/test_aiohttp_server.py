"""The aiohttp edge against a real aiohttp server on loopback, with a real aiohttp client.

Requirements: D3 (untrusted budget clamped), D5 (expiry and disconnect cancel the handler),
S2 (problem+json, 503/429, Retry-After), S4 (forged priority ignored), S7 (refusals keep the
connection; health bypasses admission and is answered within 50 ms under a 10x flood), O1
(abandoned counted; operation is the template).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tests.integration.flood import (
    HTTP_FLOOD,
    assert_answered_fast,
    probe_under_flood,
    server_process,
)
from tests.integration.servers import send_then_hang_up, serve_aiohttp

import brownout
from brownout import (
    Bulkhead,
    Classification,
    EdgePolicy,
    InboundDeadlinePolicy,
    Route,
    Stats,
    Trust,
)
from brownout.events import EventHub
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.limits import FixedLimit, LatencyEstimator
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


@dataclass
class Service:
    base: str
    stats: Stats
    cancelled: list[str]
    gate: asyncio.Event
    peers: set[Any]


def trust_internal(request: web.Request) -> Trust:
    internal = request.headers.get("authorization") == "Bearer internal"
    return Trust.TRUSTED if internal else Trust.UNTRUSTED


def caller(request: web.Request, default: Classification) -> Classification:
    trusted = trust_internal(request) is Trust.TRUSTED
    return default._replace(caller="billing" if trusted else "anonymous")


def build_app(hub: EventHub, cancelled: list[str], gate: asyncio.Event, peers: set[Any]) -> Any:
    async def work(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        ctx = brownout.current()
        seen = {
            "remaining": ctx.remaining(),
            "priority": ctx.priority.label,
            "operation": ctx.operation,
            "caller": ctx.caller,
        }
        try:
            await asyncio.sleep(float(request.query.get("hold", "0")))
        except asyncio.CancelledError:
            cancelled.append(request.match_info["id"])
            raise
        return web.json_response(seen)

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first\n")
        await gate.wait()
        await response.write(b"second\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    policy = EdgePolicy(
        bulkhead=Bulkhead(
            "aio",
            FixedLimit(2),
            FifoQueue(max_size=1, max_wait=0.05),
            events=hub,
            estimator=LatencyEstimator(min_samples=1),
        ),
        deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),
        trust=trust_internal,
        classifier=caller,
        health_paths=("/health",),
        routes={"/reports/{id}": Route(maximum=10.0)},
        events=hub,
    )
    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/work/{id}", work)
    app.router.add_get("/reports/{id}", work)
    app.router.add_get("/missing/{id}", missing)
    app.router.add_get("/stream", stream)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    hub = EventHub()
    stats = hub.subscribe(Stats())
    assert isinstance(stats, Stats)
    cancelled: list[str] = []
    gate = asyncio.Event()
    peers: set[Any] = set()
    runner = web.AppRunner(build_app(hub, cancelled, gate, peers))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Service(f"http://127.0.0.1:{port}", stats, cancelled, gate, peers)
    finally:
        gate.set()
        await runner.cleanup()


async def test_budget_clamp_priority_and_template(service: Service) -> None:
    async with aiohttp.ClientSession(service.base) as s:
        async with s.get("/reports/1", headers={"brownout-budget-ms": "60000"}) as r:
            clamped = await r.json()
        async with s.get("/work/1", headers={"brownout-priority": "sheddable"}) as r:
            forged = await r.json()
        headers = {"brownout-priority": "sheddable", "authorization": "Bearer internal"}
        async with s.get("/work/2", headers=headers) as r:
            trusted = await r.json()
    assert 9.0 < clamped["remaining"] <= 10.0  # D3: route maximum, not the asked 60 s
    assert forged["priority"] == "critical"  # S4
    assert trusted["priority"] == "sheddable"
    assert trusted["caller"] == "billing"
    assert forged["operation"] == "/work/{id}"
    await asyncio.sleep(0.05)
    assert service.stats.count("completed", operation="/work/{id}") == 2


async def test_refusals_are_problem_json_on_a_kept_connection(service: Service) -> None:
    async with aiohttp.ClientSession(service.base) as s:
        async with s.get("/work/0?hold=0.05") as r:  # a success: now there is an estimate
            assert r.status == 200
        holders = [asyncio.create_task(s.get("/work/1?hold=1.0")) for _ in range(2)]
        await asyncio.sleep(0.3)
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(service.base, connector=connector) as one:
            refused = []
            for _ in range(3):
                async with one.get("/work/2") as r:
                    refused.append((r.status, r.headers.copy(), await r.json()))
            for h in holders:
                (await h).release()
            service.peers.clear()
            for _ in range(2):
                async with one.get("/work/3") as r:
                    assert r.status == 200
    for status, headers, body in refused:
        assert status == 503
        assert headers["Content-Type"] == "application/problem+json"
        assert body["reason"] in {"queue_timeout", "queue_full"}
        assert int(headers["Retry-After"]) >= 1
    assert len(service.peers) == 1  # the same connection served both after the refusals


async def test_expiry_is_504_and_cancels_the_handler(service: Service) -> None:
    async with aiohttp.ClientSession(service.base) as s:
        t0 = time.perf_counter()
        async with s.get("/work/9?hold=5", headers={"brownout-budget-ms": "300"}) as r:
            status, body = r.status, await r.json(content_type=None)
        took = time.perf_counter() - t0
    assert status == 504
    assert body["reason"] == "deadline_expired"
    assert took < 2.0
    assert service.cancelled == ["9"]


async def test_client_disconnect_cancels_the_handler(service: Service) -> None:
    await send_then_hang_up(service.base, "/work/5?hold=3")
    for _ in range(100):
        if service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.cancelled == ["5"]  # D5
    await asyncio.sleep(0.05)
    assert service.stats.count("abandoned") == 1  # O1: not a success
    assert service.stats.count("completed") == 0


async def test_http_exceptions_count_as_answers_and_streams_pass_through(
    service: Service,
) -> None:
    async with aiohttp.ClientSession(service.base) as s:
        async with s.get("/missing/1") as r:
            assert r.status == 404
        async with s.get("/stream") as r:
            first = await asyncio.wait_for(r.content.readline(), 2.0)
            assert first == b"first\n"  # unbuffered: the handler is still waiting
            service.gate.set()
            assert await r.content.readline() == b"second\n"
        async with s.get("/health") as r:
            assert r.status == 200
    await asyncio.sleep(0.05)
    assert service.stats.count("completed") == 2  # the 404 and the stream; health uncounted
    assert service.stats.count("failed") == 0


FLOOD_SERVER = """
import asyncio, sys
from aiohttp import web
from brownout import Bulkhead
from brownout.queues import FifoQueue
from brownout.limits import FixedLimit
from brownout import EdgePolicy
from brownout.integrations.aiohttp_server import brownout_middleware

async def work(request):
    await asyncio.sleep(0.5)  # holds capacity, leaves the CPU free
    return web.json_response({"ok": True})

async def health(request):
    return web.json_response({"ok": True})

async def main():
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), FifoQueue(max_size=4, max_wait=0.1)),
        health_paths=("/health",),
    )
    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/work", work)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()

asyncio.run(main())
"""


async def test_health_is_answered_fast_under_a_10x_flood() -> None:
    """S7, as the ASGI edge: limit 4, 40 keep-alive connections flooding in a closed loop
    (each refusal must leave its connection open), health probed meanwhile."""
    async with server_process(FLOOD_SERVER) as port:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:

            async def probe() -> None:
                async with client.get("/health") as r:
                    assert r.status == 200

            counts, latencies = await probe_under_flood(HTTP_FLOOD, port, probe)
    assert counts.get("200", 0) >= 8  # the limit kept serving
    assert counts.get("503", 0) > 5 * counts.get("200", 0)  # and the flood was >= 10x capacity
    assert_answered_fast(latencies)


@pytest.mark.parametrize("path", ["express", "serve"])
async def test_the_header_names_modes_as_the_response_leaves(path: str) -> None:
    """G2, as on the ASGI edge: a mode whose fallback answered and that ended before the
    answer left is still named (the header was the modes active at the end only)."""
    modes = brownout.DegradedModes(
        [brownout.DegradedMode("recommendations", "hide personalised recommendations")]
    )

    @modes.fallback("recommendations", lambda: ["popular"])
    async def recommendations() -> list[str]:
        return ["for you"]

    async def answered_then_ended(request: web.Request) -> web.Response:
        body = await recommendations()
        modes.force("recommendations", False)
        return web.json_response(body)

    app = web.Application(middlewares=[brownout_middleware(EdgePolicy(degraded=modes))])
    app.router.add_get("/fallback", answered_then_ended)
    headers = {"brownout-priority": "critical"} if path == "serve" else {}
    async with serve_aiohttp(app) as base, aiohttp.ClientSession(base) as http:
        modes.force("recommendations", True)
        async with http.get("/fallback", headers=headers) as r:
            assert await r.json() == ["popular"]
            assert r.headers.get("brownout-degraded") == "recommendations"
        async with http.get("/fallback", headers=headers) as r:  # off: nothing to name
            assert await r.json() == ["for you"] and "brownout-degraded" not in r.headers
