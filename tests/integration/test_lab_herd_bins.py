"""The thundering-herd check on real traffic: an aiohttp dependency behind `brownout proxy`
(its command line, http mode), paced requests then a burst, the proxy's 100 ms arrival bins
read over its control endpoint by the lab's `SystemObserver` and judged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from tests.integration.servers import serve_aiohttp

from brownout._lab.system_checks import SystemObserver, system_checks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SRC = str(Path(__file__).resolve().parents[2] / "src")
CAPACITY = 25.0  # requests/s: at 2x, 5 arrivals per 100 ms bin
"""Declared requests/s of the dependency: 5 per 100 ms, so 2x allows 10 per bin."""
BURST = 120


def make_app() -> web.Application:
    async def work(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/work", work)
    return app


async def paced(client: httpx.AsyncClient, url: str, count: int) -> None:
    # At least 50 ms between requests: never more than 2 in one 100 ms bin.
    for _ in range(count):
        assert (await client.get(url)).status_code == 200
        await asyncio.sleep(0.05)


def step(label: str, start: float, end: float) -> dict[str, Any]:
    return {"label": label, "load": 1.0, "start": start, "duration": end - start, "valid": True}


async def test_the_proxy_bins_show_a_burst_and_pass_paced_traffic() -> None:
    async with serve_aiohttp(make_app()) as upstream:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "brownout", "proxy", "--mode", "http",
            "--upstream", upstream.removeprefix("http://"),
            "--control", "127.0.0.1:0", "--duration", "40",
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": SRC},
        )  # fmt: skip
        try:
            assert process.stdout is not None
            first = json.loads(await asyncio.wait_for(process.stdout.readline(), 15))
            url = f"http://{first['listen']}/work"
            control = f"http://{first['control']}"
            limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
            async with httpx.AsyncClient(limits=limits, timeout=20) as client:
                origin = time.monotonic()
                await paced(client, url, 12)
                burst_at = time.monotonic() - origin
                answers = await asyncio.gather(*(client.get(url) for _ in range(BURST)))
                assert all(a.status_code == 200 for a in answers)
                # A pause: the bin the burst ends in is not the first bin of "after".
                await asyncio.sleep(0.25)
                after_at = time.monotonic() - origin
                await paced(client, url, 12)
                end = time.monotonic() - origin + 0.05
            run: dict[str, Any] = {
                "configuration": "target",
                "scenario": "herd",
                "origin": origin,
                "steps": [
                    step("steady", 0.0, burst_at),
                    step("burst", burst_at, after_at - 0.1),
                    step("after", after_at, end),
                ],
            }
            herd = {
                "check": "no_thundering_herd",
                "threshold": 2.0,
                "steps": [],
                "options": {"capacity": CAPACITY, "proxy": control},
            }
            observer = SystemObserver([herd], "http://127.0.0.1:9/metrics")
            with observer:
                pass  # no metrics to scrape: the bins are read once, after the run
            await asyncio.to_thread(observer.attach, run)
            async with httpx.AsyncClient() as client:
                answer = (await client.get(control + "/arrivals")).json()
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()
    assert sum(n for _, n in answer["bins"]) == 12 + BURST + 12  # every request, once
    assert answer["bin_seconds"] == 0.1
    checks = system_checks([herd], [run], lambda c: [])
    by = {c["step"]: c for c in checks}
    assert [by[s]["limit"] for s in ("steady", "burst", "after")] == [5.0] * 3
    assert by["steady"]["value"] <= 2 and by["steady"]["passed"]
    assert by["after"]["value"] <= 2 and by["after"]["passed"]
    assert by["burst"]["value"] > 5 and by["burst"]["status"] == "failed"
