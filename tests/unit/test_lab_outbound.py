"""The lab's outbound and degraded scenarios as data and accounting (T3, R1, R5, G3).

Scenario data becomes generator plans with client retries; the backend's per-bin arrival
counts become per-step attempts at the dependency, amplification and the one-second peak;
the report gets a table of them; the demo backend's failure knobs answer as scripted.
"""

from __future__ import annotations

import json
import time
from collections.abc import MutableMapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from brownout._cli import main
from brownout._lab.demo import ARRIVAL_BIN, Backend, LatencySignal
from brownout._lab.generator import PlanResult, StepResult
from brownout._lab.report import OUTBOUND_COLUMNS, markdown, outbound_rows, write_report
from brownout._lab.runner import (
    CONFIGURATIONS,
    LabSettings,
    Target,
    add_dependency_figures,
    plan_for,
    summarize_plan,
)
from brownout._lab.scenarios import (
    DEFAULT_SCENARIOS,
    OPT_IN_SCENARIOS,
    SCENARIOS,
    DependencyChange,
)
from brownout._lab.tally import Tally
from brownout._lab.verdict import evaluate, targets

DEMO = Target("127.0.0.1", 1, "")
BACKEND = ("127.0.0.1", 2)
PROXY = ("127.0.0.1", 3)


def test_outbound_scenarios_are_opt_in_and_need_the_demo() -> None:
    assert not set(OPT_IN_SCENARIOS) & set(DEFAULT_SCENARIOS)
    for name in OPT_IN_SCENARIOS:
        assert SCENARIOS[name].needs_dependency
        assert SCENARIOS[name].outbound


def test_client_behaviour_becomes_generator_retries() -> None:
    plan = plan_for(SCENARIOS["retry-storm"], LabSettings(), 400.0, DEMO, BACKEND)
    warm, naive, budgeted = plan.steps
    assert warm.retries == 0
    assert (naive.retries, naive.retry_backoff, naive.retry_budget) == (3, 0.1, None)
    assert (budgeted.retries, budgeted.retry_budget) == (3, 0.1)
    assert naive.rate == budgeted.rate == 800.0
    assert {c.name: c.path for c in plan.classes}["outbound"] == "/api/outbound"
    assert {c.name: c.path for c in plan.classes}["recommendations"] == "/api/recommendations"


def test_network_faults_are_set_on_the_proxy_and_cleared_by_every_change() -> None:
    settings = LabSettings()
    plan = plan_for(SCENARIOS["outage"], settings, 400.0, DEMO, BACKEND, proxy=PROXY)
    calls = [[(a.port, a.path, a.body) for a in s.actions] for s in plan.steps]
    shape = {"latency": settings.backend_latency, "concurrency": settings.backend_concurrency}
    assert calls == [
        [],
        [],
        [(2, "/admin", shape), (3, "/faults", {"reset_rate": 1.0})],
        [(2, "/admin", shape), (3, "/faults", {})],  # a setting replaces the previous whole
    ]
    assert DependencyChange(error_rate=0.3).faults() == {"error_rate": 0.3}
    assert "error_rate" not in DependencyChange(error_rate=0.3).body(0.02, 8)
    assert SCENARIOS["outage"].proxied and SCENARIOS["partial-errors"].proxied
    assert not SCENARIOS["slow-dependency"].proxied and not SCENARIOS["capacity-loss"].proxied


def test_network_faults_without_the_proxy_are_refused() -> None:
    with pytest.raises(ValueError, match="proxy"):
        plan_for(SCENARIOS["partial-errors"], LabSettings(), 400.0, DEMO, BACKEND)


# -- the demo backend's knobs -------------------------------------------------------------------


async def _get(app: Backend, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    payload = json.dumps(body or {}).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope: dict[str, Any] = {
        "type": "http",
        "path": path,
        "method": "POST" if body is not None else "GET",
        "headers": [],
    }
    await app(scope, receive, send)
    return sent[0]["status"], sent[1]["body"]


async def test_backend_counts_arrivals_per_bin() -> None:
    backend = Backend(concurrency=2, latency=0.0)
    for _ in range(20):
        assert (await _get(backend, "/work"))[0] == 200
    stats = json.loads((await _get(backend, "/admin/stats"))[1])
    assert stats["served"] == 20
    assert sum(n for _, n in stats["arrivals"]) == 20
    now_bin = int(time.monotonic() / ARRIVAL_BIN)
    assert all(now_bin - 50 <= k <= now_bin for k, _ in stats["arrivals"])
    # behind a proxy the arrivals are the proxy's, counted by the caller
    backend.counts_arrivals = False
    await _get(backend, "/work")
    backend.count_arrivals(now_bin + 1, 5)
    stats = json.loads((await _get(backend, "/admin/stats"))[1])
    assert sum(n for _, n in stats["arrivals"]) == 25


def test_latency_signal_has_hysteresis() -> None:
    signal = LatencySignal(alpha=0.5, enter=2.5, leave=1.5)
    for _ in range(30):
        signal.observe(0.02)
    assert not signal()
    for _ in range(5):
        signal.observe(0.08)
    assert signal()
    signal.observe(0.04)  # between leave (0.03) and enter (0.05): stays slow
    assert signal()
    for _ in range(5):
        signal.observe(0.02)
    assert not signal()


# -- dependency figures and the report ---------------------------------------------------------


def _outbound_step(label: str, start: float, offered: int, ok: int, **kw: Any) -> StepResult:
    t = Tally(offered=offered, sent=offered, ok=ok, r503=offered - ok)
    t.success_latency += [0.02] * ok
    step = StepResult(label, offered / 2.0, 3.0, 1.0, True, start, {"outbound": t}, {"outbound": t})
    for name, value in kw.items():
        setattr(step, name, value)
    return step


def _outage_run(
    origin: float, per_bin: list[int], config: str = "brownout-adaptive"
) -> dict[str, Any]:
    """Three 3 s steps of 200 originals/s; ``per_bin`` arrivals per 100 ms from the origin."""
    retries = Tally(offered=60, sent=60, ok=40, r503=20)
    steps = [
        _outbound_step("steady", 0.0, 400, 400),
        _outbound_step("outage", 3.0, 400, 0, retries_steady=retries, retries_withheld=7),
        _outbound_step("returned", 6.0, 400, 400),
    ]
    result = PlanResult(steps, 0.5, [{"ok": 1, "refused": 0, "expired": 0, "failed": 0}] * 18, 3)
    result.origin = origin
    run: dict[str, Any] = {"configuration": config, "scenario": "outage"}
    run |= summarize_plan(result, SCENARIOS["outage"])
    first = round(origin / ARRIVAL_BIN)
    backend = {
        "arrival_bin": ARRIVAL_BIN,
        "arrivals": [[first + i, n] for i, n in enumerate(per_bin) if n],
    }
    add_dependency_figures(run, backend)
    return run


def test_dependency_figures_from_backend_bins() -> None:
    # 20 per 100 ms (200/s) steady; 0 during the outage; back with a 2-bin burst of 60.
    bins = [20] * 30 + [0] * 30 + [60, 60] + [20] * 28
    run = _outage_run(1000.0, bins)
    steady, outage, returned = (s["dependency"] for s in run["steps"])
    assert steady == {
        "attempts": 400,
        "attempts_per_s": 200.0,
        "amplification": 1.0,
        "peak_1s": 200.0,
        "peak_100ms": 20,
    }
    assert outage["attempts"] == 0 and outage["peak_1s"] == 0.0
    # the burst is in the settle second: out of the steady rate, in the peak
    assert returned["attempts_per_s"] == 200.0
    assert returned["peak_1s"] == 280.0
    assert returned["peak_100ms"] == 60
    assert run["dependency_timeline"][:2] == [200.0, 200.0]
    assert run["dependency_timeline"][12] == 360.0  # 60 + 60 + 3 x 20 in 0.5 s
    assert run["steps"][1]["retries"]["offered"] == 60
    assert run["steps"][1]["retries_withheld"] == 7


def _lab(runs: list[dict[str, Any]]) -> dict[str, Any]:
    configs = [CONFIGURATIONS["unprotected"], CONFIGURATIONS["brownout-adaptive"]]
    sc = SCENARIOS["outage"]
    return {
        "settings": asdict(LabSettings()),
        "target": None,
        "calibration": {"capacity": 400.0, "service_time": 0.021, "levels": []},
        "configurations": [asdict(c) for c in configs],
        "scenarios": [
            {"name": sc.name, "title": sc.title, "description": sc.description, "outbound": True}
        ],
        "runs": runs,
    }


def test_outbound_table_and_the_herd_target(tmp_path: Path) -> None:
    herd = [20] * 30 + [240] * 30 + [60] * 10 + [20] * 20
    calm = [20] * 30 + [0] * 30 + [25] * 10 + [20] * 20
    lab = _lab([_outage_run(50.0, herd, "unprotected"), _outage_run(50.0, calm)])
    rows = outbound_rows(lab, "outage")
    assert len(rows) == 6 and all(len(r) == len(OUTBOUND_COLUMNS) for r in rows)
    col = OUTBOUND_COLUMNS.index
    assert rows[1][col("amplification")] == "12.00x"
    assert rows[1][col("client retries/s (ok/s, withheld)")] == "30 (20, 7)"
    assert rows[2][col("dependency peak 1 s")] == "600"
    assert rows[5][col("dependency peak 1 s")] == "250"
    # the herd target is judged on brownout configurations only, and reported, not enforced
    [check] = [c for c in targets(lab) if c["scenario"] == "outage"]
    assert check["configuration"] == "brownout-adaptive"
    assert check["passed"] and check["value"] == 250.0 and check["limit"] == 300.0
    assert all(c["passed"] for c in evaluate(lab))
    text = markdown(lab, [])
    assert "What reached the dependency:" in text and "| 12.00x |" in text
    assert "dependency peak 1 s" in text
    written = write_report(lab, tmp_path)
    assert (tmp_path / "timeline-outage.png") in written
    assert "What reached the dependency" in (tmp_path / "index.html").read_text()


def _herd_checks(lab: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in evaluate(lab) if c["check"].startswith("arrivals at the dependency")]


def test_the_outage_file_judges_the_herd_per_100_ms_while_down_and_after() -> None:
    # The demo's dependency: 8 slots of 40 ms, 200/s, so 2.5x allows 50 arrivals per 100 ms.
    calm = [20] * 30 + [30] * 30 + [50] * 2 + [20] * 28
    burst = [20] * 30 + [0] * 30 + [51] + [20] * 29
    storm = [20] * 30 + [120] * 30 + [20] * 30
    lab = _lab([_outage_run(50.0, burst, "unprotected"), _outage_run(50.0, calm)])
    checks = _herd_checks(lab)  # brownout's configurations only
    assert [(c["configuration"], c["step"], c["value"], c["passed"]) for c in checks] == [
        ("brownout-adaptive", "outage", 30, True),
        ("brownout-adaptive", "returned", 50, True),
    ]
    assert {c["limit"] for c in checks} == {50.0}
    statuses = [c["status"] for c in _herd_checks(_lab([_outage_run(50.0, burst)]))]
    assert statuses == ["passed", "failed"]
    statuses = [c["status"] for c in _herd_checks(_lab([_outage_run(50.0, storm)]))]
    assert statuses == ["failed", "passed"]


def test_drill_names_a_declared_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--drill", "nonsense"]) == 2
    assert "recommendations" in capsys.readouterr().out
    assert main(["lab", "--drill", "recommendations", "--target", "http://127.0.0.1:1/x"]) == 2


def test_the_protected_fronts_retries_are_bounded_and_its_recovery_jittered() -> None:
    from brownout._lab.protect import OUTBOUND_ATTEMPTS, RETRY_RATIO, outbound_dependency

    dep = outbound_dependency()
    assert dep.retry.attempts == OUTBOUND_ATTEMPTS == 3
    assert getattr(dep.retry.budget, "ratio", None) == RETRY_RATIO
    assert dep.breaker is not None and dep.breaker.half_open_probes == 3
    assert dep.breaker.open_jitter > 0  # recovery is not a synchronized wave (R5)
