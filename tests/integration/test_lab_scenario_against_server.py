"""`brownout lab --scenario FILE` against real uvicorn apps on loopback: the server sees the
declared mix (methods, headers, bodies, priorities, deadlines), and the knee search finds a
known capacity."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.integration.servers import LoopThread, serve

from brownout._cli import lab_main
from brownout._lab.runner import run_scenario_file, settings_for
from brownout._lab.scenario_file import load_scenario, parse_base_url
from brownout._propagation import BUDGET_HEADER, PRIORITY_HEADER

pytestmark = pytest.mark.timeout(120)

TOKEN = "lab-test-token"
SCENARIO = """
version = 1
name = "mix"
base_url = "http://127.0.0.1:9"

[plan]
deadline = 1.0
step_seconds = 2.0
settle_seconds = 0.5
warmup_seconds = 0.5

[capacity]
rps = 100

[classes.front]
priority = "critical"
deadline = 0.5

[classes.back]
priority = "sheddable"
deadline = 2.0

[[endpoints]]
name = "read"
method = "GET"
path = "/things/{id}"
weight = 5
class = "front"
headers = { authorization = "Bearer ${LAB_TEST_TOKEN}", "x-tenant" = "{tenant}" }
params.id = { int = [1, 500] }
params.tenant = { choice = ["north", "south"] }

[[endpoints]]
name = "write"
method = "POST"
path = "/things"
weight = 3
class = "front"
headers = { authorization = "Bearer ${LAB_TEST_TOKEN}", "idempotency-key" = "{key}" }
json = { name = "thing-{n}", size = "{n}", tags = ["lab"] }
params.n = { int = [1, 9] }
params.key = { uuid = true }

[[endpoints]]
name = "purge"
method = "DELETE"
path = "/things/{id}"
weight = 2
class = "back"
params.id = { int = [1, 500] }

[[steps]]
loads = [0.5, 1.0, 1.5]

[[invariants]]
check = "served"
min = 0.99
"""


def _recording_app(seen: list[dict[str, Any]]) -> Starlette:
    async def read(request: Request) -> Response:
        seen.append({"endpoint": "read", "headers": dict(request.headers)})
        return JSONResponse({"id": request.path_params["id"]})

    async def write(request: Request) -> Response:
        body = await request.body()
        seen.append({"endpoint": "write", "headers": dict(request.headers), "body": body})
        return JSONResponse({"ok": True}, status_code=201)

    async def purge(request: Request) -> Response:
        seen.append({"endpoint": "purge", "headers": dict(request.headers)})
        return Response(status_code=204)

    return Starlette(
        routes=[
            Route("/things/{id:int}", read, methods=["GET"]),
            Route("/things/{id:int}", purge, methods=["DELETE"]),
            Route("/things", write, methods=["POST"]),
        ]
    )


def test_the_server_sees_the_declared_mix(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("LAB_TEST_TOKEN", TOKEN)
    scenario = tmp_path / "mix.toml"
    scenario.write_text(SCENARIO)
    seen: list[dict[str, Any]] = []
    out = tmp_path / "report"
    with LoopThread() as lt:
        url = lt.run(lt.stack.enter_async_context(serve(_recording_app(seen))))
        # --target replaces the file's base_url (port 9 would refuse every connection).
        status = lab_main(["--scenario", str(scenario), "--target", url, "--out", str(out)])
    lab = json.loads((out / "report.json").read_text())
    assert status in (0, 1), status  # 1: an invariant failed on a busy host; judged below
    # The report describes the user's run, not the embedded demo.
    report = (out / "report.md").read_text()
    assert "A run of the scenario file" in report and "The demo system" not in report
    assert "(declared in the scenario file)" in report and "service time" not in report
    counts = Counter(r["endpoint"] for r in seen)
    n = sum(counts.values())
    # Warm-up 0.5 s at 50/s, then 2 s at 50, 100 and 150/s: about 625 requests, once per
    # measurement (a host-bound step on a busy host is measured a second time).
    attempts = lab["runs"][0]["attempts"]
    assert 500 * attempts <= n <= 700 * attempts, (attempts, counts)
    for name, weight in (("read", 0.5), ("write", 0.3), ("purge", 0.2)):
        sigma = math.sqrt(n * weight * (1 - weight))
        assert abs(counts[name] - n * weight) <= 5 * sigma, (name, counts)
    for r in seen:
        h = r["headers"]
        if r["endpoint"] == "purge":
            assert h[PRIORITY_HEADER] == "sheddable"
            assert h[BUDGET_HEADER] == "2000"
            assert "authorization" not in h
            continue
        assert h[PRIORITY_HEADER] == "critical"
        assert h[BUDGET_HEADER] == "500"
        assert h["authorization"] == f"Bearer {TOKEN}"
        if r["endpoint"] == "read":
            assert h["x-tenant"] in ("north", "south")
        else:
            assert h["content-type"] == "application/json"
            uuid.UUID(h["idempotency-key"])
            body = json.loads(r["body"])
            assert body["tags"] == ["lab"]
            assert isinstance(body["size"], int) and 1 <= body["size"] <= 9
            assert body["name"] == f"thing-{body['size']}"
    keys = [r["headers"]["idempotency-key"] for r in seen if r["endpoint"] == "write"]
    assert len(set(keys)) == len(keys)  # drawn per request, not once
    # The client's report agrees with the server: every request sent was answered.
    run = lab["runs"][0]
    assert [s["label"] for s in run["steps"]] == ["0.5x", "1x", "1.5x"]
    assert lab["calibration"] == {
        "capacity": 100.0,
        "service_time": 0.0,
        "levels": [],
        "source": "declared",
    }
    assert {e["name"]: e["priority"] for e in lab["scenario_file"]["endpoints"]} == {
        "read": "critical",
        "write": "critical",
        "purge": "sheddable",
    }
    assert TOKEN not in (out / "report.json").read_text()  # secrets stay out of the report
    served = [s["steady"]["ok"] / s["steady"]["offered"] for s in run["steps"]]
    assert min(served) >= 0.95, served


def _semaphore_app(slots: int, seconds: float) -> Starlette:
    gate = asyncio.Semaphore(slots)

    async def work(request: Request) -> Response:
        async with gate:
            await asyncio.sleep(seconds)
        return Response(b"done")

    return Starlette(routes=[Route("/work", work)])


KNEE_SCENARIO = """
version = 1
name = "knee"

[plan]
deadline = 1.0
step_seconds = 1.5
settle_seconds = 0.5
warmup_seconds = 0.5

[capacity]
find = true
start_rps = 60
factor = 1.5
step_seconds = 1.5
refine = 2

[[endpoints]]
name = "work"
path = "/work"

[[steps]]
load = 1.0
"""


def test_find_capacity_reports_the_knee_of_a_known_capacity(tmp_path: Path) -> None:
    # 4 slots around a 20 ms sleep: at most 200 requests/s.
    scenario = tmp_path / "knee.toml"
    scenario.write_text(KNEE_SCENARIO)
    sf = load_scenario(scenario, env={})
    with LoopThread() as lt:
        url = lt.run(lt.stack.enter_async_context(serve(_semaphore_app(4, 0.020))))
        lab = run_scenario_file(sf, parse_base_url(url), settings_for(sf))
    knee = lab["knee"]
    rates = [(s["rate"], s["kept_up"]) for s in knee["steps"]]
    # A shared 2-core host (server, pytest and generator on it) costs some of the 200/s.
    assert 120 <= knee["capacity"] <= 230, (knee, rates)
    assert lab["calibration"]["capacity"] == knee["capacity"]
    assert any(not kept for _, kept in rates), rates
    assert rates[0] == (60.0, True), rates
    step = lab["runs"][0]["steps"][0]
    assert step["rate"] == pytest.approx(knee["capacity"], rel=0.05)
