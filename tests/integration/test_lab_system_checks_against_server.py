"""Whole-system checks of a scenario file run against a real brownout-protected uvicorn app:
the lab scrapes its /metrics while the steps run (queue_bounded) and reads its idempotency
counts after the run (late_success_reconciled); both are judged in the verdict and junit."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.integration.servers import LoopThread, serve

from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Stats
from brownout._lab.ci_report import junit_xml
from brownout._lab.runner import run_scenario_file, settings_for
from brownout._lab.scenario_file import parse_base_url, parse_scenario
from brownout._lab.verdict import evaluate
from brownout.events import EventHub
from brownout.export.prometheus import metrics_middleware, register
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCENARIO = """
version = 1
name = "queue"

[plan]
deadline = 2.0
step_seconds = 2.0
settle_seconds = 0.5
warmup_seconds = 0.5

[capacity]
rps = 100             # the app serves about 200/s: 4 slots around a 20 ms sleep

[[endpoints]]
name = "work"
path = "/work"

[[steps]]
label = "calm"
load = 0.5

[[steps]]
label = "flood"
load = 4.0

[[invariants]]
check = "queue_bounded"
max = 20

[[invariants]]
check = "late_success_reconciled"
source = "{base}/idempotency-counts"
"""


def _app() -> Any:
    events = EventHub()
    stats = Stats()
    events.subscribe(stats)
    registry = CollectorRegistry()
    register(stats, registry)
    bulkhead = Bulkhead(
        "api",
        FixedLimit(4),
        FifoQueue(max_size=400, max_wait=1.5),
        events=events,
        deadline_aware=False,  # a plain queue: it grows under the flood
    )
    stats.watch_gauge("queue_depth", {"source": "api"}, lambda: bulkhead.queue_depth)
    stats.watch_gauge("queue_oldest_age", {"source": "api"}, bulkhead.oldest_queue_age)

    async def work(request: Request) -> Response:
        await asyncio.sleep(0.02)
        return Response(b"done")

    async def counts(request: Request) -> JSONResponse:
        # What the system of record would say: 3 retries replayed, one order applied twice.
        return JSONResponse({"duplicates": 1, "replayed": 3})

    app = Starlette(
        routes=[Route("/work", work), Route("/idempotency-counts", counts)],
    )
    app.add_middleware(
        BrownoutMiddleware,
        policy=EdgePolicy(
            bulkhead=bulkhead,
            events=events,
            deadline=InboundDeadlinePolicy(default=5.0, maximum=5.0),
        ),
    )
    return metrics_middleware(app, registry=registry)


def test_queue_gauges_scraped_per_step_and_counts_read_after(tmp_path: Path) -> None:
    with LoopThread() as lt:
        base = lt.run(lt.stack.enter_async_context(serve(_app())))
        sf = parse_scenario(SCENARIO.replace("{base}", base), env={})
        lab = run_scenario_file(sf, parse_base_url(base), settings_for(sf))
    by = {(c["step"], c["check"].split(" ")[0]): c for c in evaluate(lab)}
    calm, flood = by[("calm", "queue")], by[("flood", "queue")]
    steps = {s["label"]: s for s in lab["runs"][0]["steps"]}
    scrapes = next(iter(steps["flood"]["system"]["metrics"].values()))["scrapes"]
    assert scrapes >= 3  # every 0.25 s over a 2 s step, on a busy host
    assert calm["value"] is not None and calm["value"] <= 20, calm
    # 400/s offered to about 200/s of service: the queue grows past the bound.
    assert flood["value"] > 20 and flood["status"] == "failed", flood
    late = by[("whole run", "late")]
    assert (late["value"], late["status"]) == (1, "failed")
    junit = ET.fromstring(junit_xml(lab))
    failures = [f.get("message") or "" for f in junit.iter("failure")]
    assert any("flood: queue depth <= 20" in m for m in failures), failures
