"""The worked example of docs/lab.md, as a user runs it: the shop (FastAPI + brownout) and its
inventory as two uvicorn processes, `brownout proxy` between them, and
`brownout lab --scenario examples/lab_shop/scenario.toml` driving the proxy's faults step by
step, reading the shop's metrics and the inventory's effects."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from brownout._cli import lab_main

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "lab_shop" / "scenario.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                r.read()
                return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


@pytest.fixture
def stack() -> Iterator[dict[str, int]]:
    ports = {name: free_port() for name in ("shop", "inventory", "proxy", "control")}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    uvicorn = [sys.executable, "-m", "uvicorn", "--log-level", "warning", "--port"]
    procs = [
        subprocess.Popen(
            [*uvicorn, str(ports["inventory"]), "examples.lab_shop.inventory:app"], env=env
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "brownout",
                "proxy",
                "--mode",
                "http",
                "--listen",
                f"127.0.0.1:{ports['proxy']}",
                "--upstream",
                f"127.0.0.1:{ports['inventory']}",
                "--control",
                f"127.0.0.1:{ports['control']}",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*uvicorn, str(ports["shop"]), "examples.lab_shop.service:app"],
            env={**env, "INVENTORY_URL": f"http://127.0.0.1:{ports['proxy']}"},
        ),
    ]
    try:
        wait_http(f"http://127.0.0.1:{ports['inventory']}/effects")
        wait_http(f"http://127.0.0.1:{ports['control']}/stats")
        wait_http(f"http://127.0.0.1:{ports['shop']}/health")
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_the_shop_example_runs_through_the_proxy(stack: dict[str, int], tmp_path: Path) -> None:
    text = SCENARIO.read_text()
    for name, default in (("shop", 8000), ("inventory", 8001), ("proxy", 7001), ("control", 7002)):
        text = text.replace(f"127.0.0.1:{default}", f"127.0.0.1:{stack[name]}")
        text = text.replace(f"--listen {default}", f"--listen {stack[name]}")
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(text)
    out = tmp_path / "report"
    status = lab_main(["--scenario", str(scenario), "--step", "2.5", "--out", str(out)])
    lab = json.loads((out / "report.json").read_text())
    assert status in (0, 1), status  # 1: an invariant failed on a busy host; judged below
    (run,) = lab["runs"]
    steps = {s["label"]: s for s in run["steps"]}
    assert list(steps) == [
        "0.5x", "1x", "2x", "4x",
        "slow inventory", "failing inventory", "lossy inventory", "recovered",
    ]  # fmt: skip
    assert all(not s["failed_actions"] for s in steps.values())
    # Each fault was in force during its step, and cleared after the run.
    control = f"http://127.0.0.1:{stack['control']}"
    injected = get_json(control + "/stats")["faults_injected"]
    assert injected["latency"] > 0 and injected["error"] > 0 and injected["loss"] > 0, injected
    cleared = get_json(control + "/faults")
    assert not any(v for k, v in cleared.items() if k.endswith("_rate") or k == "latency"), cleared
    # The shop refused at 4x and kept checkout ahead of browsing.
    four = steps["4x"]["classes"]
    assert four["item"]["ok"] / four["item"]["offered"] > four["recommendations"]["ok"] / max(
        1, four["recommendations"]["offered"]
    )
    # Every declared kind was measured: none skipped in junit.xml.
    junit = (out / "junit.xml").read_text()
    for kind in (
        "queue depth",
        "retries (client + server)",
        "goodput in &apos;1x&apos;",
        "arrivals at the dependency",
        "late successes replayed",
        "server agrees",
    ):
        assert kind in junit.replace("'", "&apos;"), kind
    assert '<skipped message="not measured' not in junit  # host-bound ones may be skipped
    assert "late successes replayed" in (out / "report.md").read_text()
    # Reservations that landed after the shop's timeout were replayed, never applied twice.
    effects = get_json(f"http://127.0.0.1:{stack['inventory']}/effects")
    assert effects["duplicates"] == 0, effects
