"""`brownout lab --scenario FILE` against a real uvicorn app protected by brownout and
serving its metrics: the server's view appears in the report, step by step, and agrees
with what the client saw."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tests.integration.servers import LoopThread, serve

from brownout import Bulkhead, EdgePolicy, Stats
from brownout._cli import lab_main
from brownout._lab.server_view import ScrapeError
from brownout.events import EventHub
from brownout.export.prometheus import metrics_middleware, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.timeout(120)

SCENARIO = """
version = 1
name = "server-view"

[server]
metrics_url = "/metrics"

[plan]
deadline = 1.0
step_seconds = 2.5
settle_seconds = 0.5
warmup_seconds = 0.5

[capacity]
rps = 100

[[endpoints]]
name = "work"
path = "/work"

[[steps]]
loads = [0.5, 3]

[[invariants]]
check = "server_agrees"
max = 0.05
"""


def _protected_app() -> Starlette:
    """4 slots of 40 ms (100 requests/s), a short queue: 3x is mostly refused queue_full."""

    async def work(request: Request) -> Response:
        await asyncio.sleep(0.04)
        return Response(b"done")

    events = EventHub()  # its own hub: other tests' events stay out of these counts
    registry = CollectorRegistry()
    register(events.subscribe(Stats()), registry)
    bulkhead = Bulkhead(
        "front", limit=FixedLimit(4), queue=FifoQueue(max_size=4, max_wait=0.05), events=events
    )
    app = Starlette(routes=[Route("/work", work)])
    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=bulkhead, events=events))
    return metrics_middleware(app, registry=registry)  # type: ignore[return-value]


def test_the_server_view_appears_and_agrees(tmp_path: Path) -> None:
    scenario = tmp_path / "server-view.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "report"
    with LoopThread() as lt:
        url = lt.run(lt.stack.enter_async_context(serve(_protected_app())))
        status = lab_main(["--scenario", str(scenario), "--target", url, "--out", str(out)])
    lab = json.loads((out / "report.json").read_text())
    run = lab["runs"][0]
    view = run["server_view"]
    assert view["url"] == f"{url}/metrics"
    assert view["scrapes"] >= 8 and view["note"] is None, view
    low, high = run["steps"]
    for step in (low, high):
        server = step["server"]
        assert server is not None and server["edge_s"] <= 0.1, server  # scraped on the edges
        assert step["server_agrees"] is True, (step["label"], server, step["steady"])
    assert low["server"]["shed"] == {}
    assert high["server"]["shed"].get("queue_full", 0) > 100, high["server"]
    # The invariant is the same comparison: it passed, unless the host bounded a step.
    checks = [c for c in lab_checks(out) if c.startswith("server agrees")]
    assert len(checks) == 6, checks
    assert status in (0, 1), status
    if status == 1:  # only host-bound steps may keep the run from passing
        assert all(s["host_bound"] for s in run["steps"] if not s["server_agrees"])
    html = (out / "index.html").read_text()
    assert "the server&#x27;s view" in html and "queue_full" in html
    assert "server_offered" in (out / "steps.csv").read_text()


def lab_checks(out: Path) -> list[str]:
    """The check names of the JUnit report (one test case per check)."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring((out / "junit.xml").read_text())
    return [case.get("name", "").split(": ", 1)[-1] for case in root.iter("testcase")]


def test_the_demo_front_serves_its_metrics_when_asked() -> None:
    import urllib.request

    from brownout._lab.server_view import figures_of, scrape
    from brownout._lab.servers import start_demo

    with start_demo("fixed", concurrency=8, latency=0.02, metrics=True) as demo:
        for _ in range(3):
            urllib.request.urlopen(demo.front.url + "/api/interactive", timeout=5).read()
        figures = figures_of(scrape(demo.front.url + "/metrics", timeout=5), "front")
    assert figures["offered"] == 3 and figures["completed"] == 3, figures
    with start_demo("fixed", concurrency=8, latency=0.02) as demo:  # off by default
        with pytest.raises(ScrapeError) as e:
            scrape(demo.front.url + "/metrics", timeout=5)
    assert e.value.kind == "http"
