"""Scrapes are never admitted, queued, shed or counted: a real uvicorn (FastAPI with
`mount_metrics`) and a real aiohttp server whose only permit is held answer ``/metrics``
(200, gzip when accepted) while the next request is shed (O1, S7)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable

import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.flood import HTTP_FLOOD, probe_under_flood, server_process
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


FLOOD_SERVER = """
import asyncio, sys
import uvicorn
from fastapi import FastAPI
from brownout import Bulkhead, EdgePolicy, Stats
from brownout.events import hub
from brownout.export.prometheus import mount_metrics, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

app = FastAPI()

@app.get("/work")
async def work():
    await asyncio.sleep(0.5)  # holds capacity, leaves the CPU free
    return {"ok": True}

# As docs/fastapi.md says: the edge, then Stats on the hub and /metrics on the app.
app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(
    bulkhead=Bulkhead("api", FixedLimit(4), FifoQueue(max_size=4, max_wait=0.1)),
))
register(hub.subscribe(Stats()))
mount_metrics(app)

async def main():
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.should_exit = True
    await task

asyncio.run(main())
"""


async def test_scrapes_every_second_under_a_10x_flood_are_answered_compressed() -> None:
    """A Prometheus-like scrape loop (about once a second, ``Accept-Encoding: gzip``) while 40
    connections flood a limit of 4: every scrape 200, gzip, smaller than the text it holds,
    and it shows the shedding going on."""
    scrapes: list[tuple[int, str | None, int, bytes]] = []
    async with server_process(FLOOD_SERVER) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def scrape() -> None:
                async with client.stream(
                    "GET", "/metrics", headers={"accept-encoding": "gzip"}
                ) as r:
                    raw = b"".join([chunk async for chunk in r.aiter_raw()])
                    encoding = r.headers.get("content-encoding")
                    text = gzip.decompress(raw) if encoding == "gzip" else raw
                    scrapes.append((r.status_code, encoding, len(raw), text))
                await asyncio.sleep(0.9)

            counts, _latencies = await probe_under_flood(
                HTTP_FLOOD, port, scrape, seconds=6.0, probes=5
            )
    assert counts.get("503", 0) > 5 * counts.get("200", 0)  # the flood was >= 10x capacity
    assert [status for status, *_ in scrapes] == [200] * 5  # no scrape refused
    for _status, encoding, size, text in scrapes:
        assert encoding == "gzip"
        assert size < len(text) / 2
    shed = [
        s.value
        for fam in text_string_to_metric_families(scrapes[-1][3].decode())
        for s in fam.samples
        if s.name == "brownout_requests_shed_total"
    ]
    assert sum(shed) > 0
