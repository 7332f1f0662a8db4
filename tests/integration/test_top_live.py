"""`brownout top` in a subprocess against a real uvicorn app with brownout metrics: one frame
with ``--once``, then a few refreshes while the server is stopped mid-run (the last good
figures stay on screen under a warning line)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.integration.servers import serve

from brownout import Bulkhead, EdgePolicy, Stats
from brownout.events import EventHub
from brownout.export.prometheus import metrics_middleware, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration

SRC = str(Path(__file__).resolve().parents[2] / "src")


def app() -> object:
    events = EventHub()
    stats = Stats()
    events.subscribe(stats)
    registry = CollectorRegistry()
    register(stats, registry)
    bulkhead = Bulkhead("api", FixedLimit(4), FifoQueue(max_size=2, max_wait=0.1), events=events)
    stats.watch_gauge("in_flight", {"source": "api"}, lambda: bulkhead.in_flight)
    stats.watch_gauge("limit", {"source": "api"}, lambda: bulkhead.limit)

    async def work(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    inner = Starlette(routes=[Route("/work", work)])
    inner.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=bulkhead, events=events))
    return metrics_middleware(inner, registry=registry)


async def traffic(base: str) -> None:
    """Requests until cancelled, so every window has some."""
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                await client.get("/work")
            await asyncio.sleep(0.02)


async def top(*argv: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "80", "NO_COLOR": "1"}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "brownout._cli",
        "top",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


def unwrapped(text: str) -> str:
    return " ".join(text.split())


async def test_top_once_prints_one_frame_of_window_rates() -> None:
    async with serve(app()) as base:
        load = asyncio.create_task(traffic(base))
        try:
            proc = await top("--once", "--interval", "1", f"{base}/metrics")
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert text.count("brownout top http") == 1
    assert "per second and percentiles over the last" in text
    assert "/work" in text and "p99 ms" in text and "warming up" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


async def test_the_last_frame_stays_when_the_server_stops_mid_run() -> None:
    stack = contextlib.AsyncExitStack()
    base = await stack.enter_async_context(serve(app()))
    load = asyncio.create_task(traffic(base))
    proc = await top("--interval", "0.5", "--window", "5", "--count", "14", f"{base}/metrics")
    assert proc.stdout is not None
    seen = ""
    try:
        # wait for two frames with rates, then stop the server under it
        while seen.count("per second and percentiles") < 2:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, seen
            seen += line.decode()
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        await stack.aclose()
    rest, err = await asyncio.wait_for(proc.communicate(), 60)
    text = seen + rest.decode()
    assert proc.returncode == 3, err.decode()  # the last scrape failed
    before, _, after = text.partition("WARNING: cannot read")
    assert after, text
    assert "/work" in before
    last = text.rsplit("brownout top http", 1)[1]
    assert "WARNING: cannot read" in unwrapped(last)
    assert "showing the last good scrape, from" in unwrapped(last)
    assert "per second and percentiles over the last" in last  # the last good figures stay
    assert "/work" in last and "p99 ms" in last
    assert "Traceback" not in err.decode()
