"""``brownout lab --quick`` end to end: real uvicorn processes, the real generator, the report.

The machine running the suite is shared and noisy, so this test asserts what must hold on
any machine (the report exists, every offered request is accounted for exactly once, the
figures are self-consistent, CPU was read for every step) plus the one invariant a slow host
does not excuse: brownout's goodput at the ramp's highest step >= 90% of capacity (T1), read
from the report's JSON. A step the lab marked host-bound fails it too (the reason is printed):
a front that collapses under its own refusal work saturates the same core a noisy host does,
so an excuse for the host would also excuse the collapse. The lab's other strict invariants
are its exit status (0, or 1 when one failed or was host-bound), checked on a quiet machine
(docs/lab.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from brownout._lab.runner import CONFIGURATIONS
from brownout._lab.scenarios import SCENARIOS
from brownout._lab.verdict import evaluate

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OUTCOMES = (
    "ok",
    "ok_late",
    "r429",
    "r503",
    "r504",
    "other_status",
    "errors",
    "timeouts_sent",
    "timeouts_unsent",
)


@pytest.mark.timeout(300)
def test_quick_lab_produces_a_consistent_report(tmp_path: Path) -> None:
    out = tmp_path / "lab-report"
    proc = subprocess.run(
        [sys.executable, "-m", "brownout._cli", "lab", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    # 0: every invariant held; 1: one failed (possible on a loaded machine); 2+: broken.
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("report.json", "index.html", "report.md", "goodput.png", "latency.png"):
        assert (out / name).stat().st_size > 0, name
    lab = json.loads((out / "report.json").read_text())
    capacity = lab["calibration"]["capacity"]
    assert 50 < capacity < 2000, lab["calibration"]  # the demo's dependency: ~200/s
    configs = {c["name"] for c in lab["configurations"]}
    assert configs == set(CONFIGURATIONS)
    assert {(r["configuration"], r["scenario"]) for r in lab["runs"]} == {
        (c.name, s)
        for c in CONFIGURATIONS.values()
        for s in ("ramp", "priority")
        if c.runs(SCENARIOS[s])
    }
    assert {"sync-unprotected", "sync-brownout"} <= configs  # the Flask front under gunicorn
    for run in lab["runs"]:
        assert run["unresolved"] == 0, run["configuration"]
        for step in run["steps"]:
            for figures in (step["whole"], step["steady"], *step["classes"].values()):
                # every offered request ended in exactly one outcome
                assert figures["offered"] == sum(figures[o] for o in OUTCOMES), step["label"]
                assert figures["sent"] + figures["timeouts_unsent"] <= figures["offered"]
                assert figures["refused"] == figures["r503"] + figures["r429"]
                assert sum(figures["shed_reasons"].values()) == figures["refused"]
            work = [c for name, c in step["classes"].items() if name != "health"]
            assert sum(c["offered"] for c in work) == step["steady"]["offered"]
            assert step["steady"]["offered"] <= step["whole"]["offered"]
    for run in lab["runs"]:
        for step in run["steps"]:
            cpu = step["cpu"]
            assert cpu is not None and cpu["seconds"] > 0, step["label"]
            for role in ("front", "dependency", "generator"):
                assert 0 <= cpu[role] <= 1.1, (role, cpu)
            assert 0 <= cpu["core"] <= 1.0, cpu
            assert isinstance(step["host_bound"], list)
    # The plateau (T1): brownout's goodput at the highest step of the ramp, from the JSON.
    floor = 0.9 * capacity
    for config in ("brownout-fixed", "brownout-adaptive", "sync-brownout"):
        ramp = next(
            r for r in lab["runs"] if (r["configuration"], r["scenario"]) == (config, "ramp")
        )
        top = max(ramp["steps"], key=lambda s: s["load"])
        if config == "sync-brownout" and max(top["cpu"]["front"], top["cpu"]["core"]) >= 0.9:
            # One gthread worker on one core: at 10x its refusals alone can fill the core
            # (gunicorn parses every request before brownout sees it), or fill what other
            # processes leave of it. The sync figure is 4x; at 10x it must still serve, and
            # the run prints what the core allowed.
            print(f"sync-brownout at {top['label']}: CPU {top['cpu']}")
            assert top["steady"]["goodput_per_s"] > 0.25 * capacity, top["steady"]
            top = next(s for s in ramp["steps"] if s["load"] == 4.0)
        goodput = top["steady"]["goodput_per_s"]
        bound = top["host_bound"]
        why = f"; the lab marked it host-bound: {', '.join(bound)}" if bound else ""
        print(f"{config} at {top['label']}: {goodput} req/s, floor {floor:.1f}{why}")
        assert goodput >= floor, (
            f"{config} at {top['label']}: goodput {goodput} req/s < 90% of capacity "
            f"{capacity} req/s (CPU {top['cpu']}){why}"
        )
    # Lenient sanity: brownout keeps serving under overload on any machine, and the report
    # says whether the strict invariants held (the exit status).
    adaptive_2x = next(
        s
        for r in lab["runs"]
        if r["configuration"] == "brownout-adaptive" and r["scenario"] == "ramp"
        for s in r["steps"]
        if s["load"] == 2.0
    )
    assert adaptive_2x["steady"]["goodput_per_s"] > 0.25 * capacity

    def ramp_step(config: str, load: float) -> dict[str, object]:
        return next(
            s
            for r in lab["runs"]
            if r["configuration"] == config and r["scenario"] == "ramp"
            for s in r["steps"]
            if s["load"] == load
        )

    # brownout names its reasons and keeps connections open (S2); uvicorn's guard closes them
    for config in ("brownout-fixed", "brownout-adaptive", "sync-brownout"):
        reasons = ramp_step(config, 10.0)["steady"]["shed_reasons"]  # type: ignore[index]
        assert reasons and all(not r.startswith("http_") for r in reasons), reasons
    churn = ramp_step("uvicorn-limit", 10.0)["connections_opened"]
    kept = ramp_step("brownout-adaptive", 10.0)["connections_opened"]
    assert churn > 2 * kept, (churn, kept)  # type: ignore[operator]
    assert ("all invariants held" in proc.stdout) == (proc.returncode == 0)
    # a check on a host-bound step is not a pass: the lab does not exit 0 with one
    if any(c["status"] == "host-bound" for c in evaluate(lab)):
        assert proc.returncode == 1


@pytest.mark.timeout(300)
def test_quick_outbound_and_degraded_scenarios_account_for_every_attempt(tmp_path: Path) -> None:
    """The opt-in scenarios, short: an outage and a slow dependency served degraded.

    Asserted: accounting (originals and client retries each end in one outcome), figures at
    the dependency for every step, and differences too large for noise to hide: during the
    outage the unprotected front's naive retries (3 per layer) reach the dependency many
    times more often than brownout's breaker lets through (measured ~12x vs ~0.02x per
    original); while the dependency is slow, the protected front serves degraded responses.
    """
    out = tmp_path / "lab-report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "brownout._cli",
            "lab",
            "--quick",
            "--configs",
            "unprotected,brownout-adaptive",
            "--scenarios",
            "outage,degraded",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    lab = json.loads((out / "report.json").read_text())
    assert "What reached the dependency" in (out / "report.md").read_text()
    runs = {(r["configuration"], r["scenario"]): r for r in lab["runs"]}
    assert set(runs) == {
        (c, s) for c in ("unprotected", "brownout-adaptive") for s in ("outage", "degraded")
    }
    for run in runs.values():
        assert run["unresolved"] == 0, run["configuration"]
        assert len(run["dependency_timeline"]) == len(run["timeline"])
        for step in run["steps"]:
            for figures in (step["steady"], step["retries"]):
                assert figures["offered"] == sum(figures[o] for o in OUTCOMES), step["label"]
            assert step["steady"]["degraded_ok"] <= step["steady"]["ok"]
            assert step["dependency"]["attempts"] >= 0
    outage = {
        c: runs[(c, "outage")]["steps"][1]["dependency"]["attempts_per_s"]
        for c in ("unprotected", "brownout-adaptive")
    }
    assert outage["unprotected"] > 3 * outage["brownout-adaptive"] + 10, outage
    slow = runs[("brownout-adaptive", "degraded")]["steps"][1]["steady"]
    assert slow["degraded"] > 0, slow
    assert runs[("unprotected", "degraded")]["steps"][1]["steady"]["degraded"] == 0
