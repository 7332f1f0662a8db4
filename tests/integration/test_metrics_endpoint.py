"""/metrics on a real uvicorn app after scripted traffic, read with a real httpx client; the
same for aiohttp; and `brownout top --once` against the live endpoint.

Requirements: O1 (offered/admitted/shed/completed/expired counted separately, by caller,
operation, priority), O2 (queue wait, remaining deadline per hop, in-flight), O3 (success
latency holds useful successes only), O4 (shed caller and reason), O5 (admitted concurrency
and queue age exported), S8 (no false positives under honest overload).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute
from tests.integration.servers import serve

from brownout import Bulkhead, Classification, EdgePolicy, InboundDeadlinePolicy, Stats
from brownout.events import EventHub
from brownout.export import _top as top
from brownout.export.prometheus import add_aiohttp_metrics, metrics_middleware, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(s, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in s.items() if n == name and labels.items() <= dict(lab).items())


def caller_header(request: Any, default: Classification) -> Classification:
    for name, value in request.get("headers", ()):
        if name == b"x-caller":
            return default._replace(caller=value.decode())
    return default


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, Stats, Bulkhead]]:
    events = EventHub()
    stats = Stats()
    events.subscribe(stats)
    registry = CollectorRegistry()
    register(stats, registry)
    bulkhead = Bulkhead(
        "api",
        FixedLimit(2),
        FifoQueue(max_size=1, max_wait=0.1),
        events=events,
        deadline_aware=False,
    )
    # The live gauges a bulkhead does not (yet) report itself (O5).
    stats.watch_gauge("in_flight", {"source": "api"}, lambda: bulkhead.in_flight)
    stats.watch_gauge("limit", {"source": "api"}, lambda: bulkhead.limit)
    stats.watch_gauge("queue_depth", {"source": "api"}, lambda: bulkhead.queue_depth)
    stats.watch_gauge("queue_oldest_age", {"source": "api"}, bulkhead.oldest_queue_age)

    async def work(request: Request) -> JSONResponse:
        await asyncio.sleep(float(request.query_params.get("hold", "0")))
        return JSONResponse({"ok": True})

    app = Starlette(routes=[StarletteRoute("/work", work)])
    app.add_middleware(
        BrownoutMiddleware,
        policy=EdgePolicy(
            bulkhead=bulkhead,
            classifier=caller_header,
            events=events,
            deadline=InboundDeadlinePolicy(default=5.0, maximum=5.0),
        ),
    )
    async with serve(metrics_middleware(app, registry=registry)) as base:
        yield base, stats, bulkhead


async def test_scripted_traffic_shows_up_in_metrics(service) -> None:
    base, stats, _bulkhead = service
    outcomes: Counter[int] = Counter()
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        # 1. Five quick requests from "alice": all goodput.
        for _ in range(5):
            r = await client.get("/work", headers={"x-caller": "alice"})
            outcomes[r.status_code] += 1
        # 2. "bob" floods: 2 run (limit), 1 waits and times out in the queue, 5 find it full.
        slow = [
            client.get("/work", params={"hold": "0.5"}, headers={"x-caller": "bob"})
            for _ in range(8)
        ]
        for r in await asyncio.gather(*slow):
            outcomes[r.status_code] += 1
        # 3. A 100 ms budget for 300 ms of work: expires while running (504).
        r = await client.get(
            "/work",
            params={"hold": "0.3"},
            headers={"x-caller": "carol", "brownout-budget-ms": "100"},
        )
        outcomes[r.status_code] += 1
        # 4. While one request holds a permit, in-flight is 1 at scrape time (O5).
        holder = asyncio.create_task(client.get("/work", params={"hold": "0.4"}))
        await asyncio.sleep(0.15)
        during = samples((await client.get("/metrics")).text)
        await holder
        s = samples((await client.get("/metrics")).text)

    assert outcomes[200] == 5 + 2 + 0
    assert outcomes[503] == 6
    assert outcomes[504] == 1
    assert total(during, "brownout_in_flight_requests", source="api") == 1
    assert total(during, "brownout_concurrency_limit", source="api") == 2
    assert total(s, "brownout_in_flight_requests", source="api") == 0

    api = {"source": "api"}
    assert total(s, "brownout_requests_offered_total", **api) == 5 + 8 + 1 + 1
    assert total(s, "brownout_requests_admitted_total", **api) == 5 + 2 + 1 + 1
    # O1/O4: every 503 the clients saw is a shed with a caller and a reason.
    assert total(s, "brownout_requests_shed_total") == outcomes[503]
    assert total(s, "brownout_requests_shed_total", caller="bob") == 6
    # One waiter times out in the queue, the rest find it full (a slow machine may let a
    # second one in after the first timed out).
    timed_out = total(s, "brownout_requests_shed_total", reason="queue_timeout")
    assert timed_out >= 1
    assert total(s, "brownout_requests_shed_total", reason="queue_full") == 6 - timed_out
    assert total(s, "brownout_requests_queued_total") >= 1
    assert total(s, "brownout_requests_shed_false_positive_total") == 0  # S8
    # Goodput: alice's 5, bob's 2, the holder; carol's expired request is not goodput.
    assert total(s, "brownout_requests_completed_total") == 5 + 2 + 1
    assert (
        total(
            s,
            "brownout_requests_completed_total",
            caller="alice",
            operation="/work",
            priority="critical",
        )
        == 5
    )
    assert total(s, "brownout_requests_expired_total", stage="running") == 1
    # O3: success latency counts the 8 useful successes only.
    assert total(s, "brownout_success_latency_seconds_count") == 8
    under_400ms = max(
        (float(dict(lab)["le"]), v)
        for (n, lab), v in s.items()
        if n == "brownout_success_latency_seconds_bucket" and float(dict(lab)["le"]) < 0.4
    )[1]
    assert under_400ms == 5  # alice's quick ones; bob's and the holder's took >= 0.4 s
    # O2: queue wait and remaining deadline at the api hop.
    assert total(s, "brownout_queue_wait_seconds_count", source="api") == 5 + 2 + 1 + 1
    assert total(s, "brownout_remaining_deadline_seconds_count", source="api") == 15
    assert total(s, "brownout_remaining_deadline_seconds_bucket", source="api", le="0.1") >= 1
    assert stats.count("shed", caller="bob") == 6


async def test_top_once_renders_the_live_endpoint(service, capsys) -> None:
    base, _stats, _bulkhead = service
    async with httpx.AsyncClient(base_url=base) as client:
        for _ in range(3):
            await client.get("/work", headers={"x-caller": "dave"})
    status = await asyncio.to_thread(top.main, [f"{base}/metrics", "--once", "--interval", "1"])
    out = capsys.readouterr().out
    assert status == 0
    assert "/work" in out  # (a row with no traffic in the window: rates of 0.0)
    assert "Useful-success latency" in out
    assert "breakers open: none" in out
    unreachable = ["http://127.0.0.1:9/metrics", "--once", "--timeout", "1"]
    assert await asyncio.to_thread(top.main, unreachable) == 3


async def test_aiohttp_app_serves_metrics() -> None:
    from aiohttp import web

    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    stats.watch_gauge("queue_depth", {"source": "jobs"}, lambda: 3)
    app = web.Application()
    add_aiohttp_metrics(app, registry=registry)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain")
            assert total(samples(r.text), "brownout_queue_depth_requests", source="jobs") == 3
            r = await client.get(
                f"http://127.0.0.1:{port}/metrics",
                headers={"accept": "application/openmetrics-text"},
            )
            assert r.headers["content-type"].startswith("application/openmetrics-text")
    finally:
        await runner.cleanup()
