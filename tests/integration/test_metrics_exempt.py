"""Scrapes are never admitted, queued, shed or counted: a real uvicorn (FastAPI with
`mount_metrics`) and a real aiohttp server whose only permit is held answer ``/metrics``
(200, gzip when accepted) while the next request is shed (O1, S7)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from tests.integration.servers import serve, serve_aiohttp

from brownout import Bulkhead, EdgePolicy, Stats
from brownout.events import EventHub
from brownout.export.prometheus import add_aiohttp_metrics, mount_metrics, register
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

pytestmark = pytest.mark.integration


def saturated_policy(events: EventHub) -> EdgePolicy:
    """One permit, no queue: with one request held, every admitted path is shed."""
    return EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1), events=events), events=events)


async def check_scrapes_while_full(base: str, stats: Stats, gate: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        held = asyncio.create_task(client.get("/work"))
        for _ in range(200):
            if stats.count("admitted") == 1:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("/work")).status_code == 503  # the service sheds
        before = (stats.count("offered"), stats.count("shed"))
        for _ in range(3):
            r = await client.get("/metrics", headers={"accept-encoding": "gzip"})
            assert r.status_code == 200
            assert r.headers["content-encoding"] == "gzip"
            assert "brownout_requests_shed_total" in r.text
        head = await client.head("/metrics")
        assert head.status_code == 200 and head.content == b""
        assert (stats.count("offered"), stats.count("shed")) == before  # scrapes uncounted
        gate.set()
        assert (await held).status_code == 200


def stack() -> tuple[EventHub, Stats, CollectorRegistry, asyncio.Event]:
    events = EventHub()
    stats = events.subscribe(Stats())
    registry = CollectorRegistry()
    register(stats, registry)
    return events, stats, registry, asyncio.Event()


async def test_asgi_scrape_is_answered_while_the_service_sheds() -> None:
    events, stats, registry, gate = stack()
    app = FastAPI()

    @app.get("/work")
    async def work() -> dict[str, bool]:
        await gate.wait()
        return {"ok": True}

    app.add_middleware(BrownoutMiddleware, policy=saturated_policy(events))
    mount_metrics(app, registry=registry)
    async with serve(app) as base:
        await check_scrapes_while_full(base, stats, gate)


async def test_aiohttp_scrape_is_answered_while_the_service_sheds() -> None:
    events, stats, registry, gate = stack()

    async def work(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({"ok": True})

    handler: Callable[[web.Request], Awaitable[web.Response]] = work
    app = web.Application(middlewares=[brownout_middleware(saturated_policy(events))])
    app.router.add_get("/work", handler)
    add_aiohttp_metrics(app, registry=registry)
    async with serve_aiohttp(app) as base:
        await check_scrapes_while_full(base, stats, gate)
