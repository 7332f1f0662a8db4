"""The lab's honesty about its host: CPU shares from /proc, the host-bound rule, the hog."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from brownout._lab.generator import StepResult
from brownout._lab.hog import HOG_SOURCE, cpu_hog
from brownout._lab.hostcpu import (
    CpuSample,
    core_ticks,
    cpu_shares,
    host_bound,
    pid_ticks,
    read_sample,
)
from brownout._lab.report import COLUMNS, cpu_cell, host_cell, scenario_rows, write_report
from brownout._lab.runner import (
    CONFIGURATIONS,
    LabSettings,
    Target,
    host_bound_steps,
    plan_for,
    summarize_step,
)
from brownout._lab.scenarios import DEFAULT_SCENARIOS, SCENARIOS
from brownout._lab.tally import Tally
from brownout._lab.verdict import STARVED_SLACK, evaluate, targets

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _pid_stat(utime: int, stime: int, comm: str = "python3") -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
    # stime cutime cstime ...
    return f"4242 ({comm}) R 1 4242 4242 0 -1 4194304 900 0 3 0 {utime} {stime} 7 9 20 0 3 0\n"


def _proc_stat(cpu1: tuple[int, ...]) -> str:
    fields = " ".join(map(str, cpu1))
    return f"cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 100 0 50 900 10 0 5 0 0 0\ncpu1 {fields}\nintr 1 2 3\n"


def test_process_ticks_are_utime_plus_stime_whatever_the_command_name() -> None:
    assert pid_ticks(_pid_stat(250, 50)) == 300
    # a name with spaces and parentheses does not shift the fields
    assert pid_ticks(_pid_stat(11, 2, comm="a) b (c")) == 13


def test_core_ticks_count_busy_and_total_of_the_named_core() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    text = _proc_stat((300, 10, 100, 500, 40, 5, 15, 30, 77, 0))
    busy, total = core_ticks(text, 1)
    assert busy == 300 + 10 + 100 + 5 + 15 + 30  # guest is already inside user
    assert total == busy + 500 + 40
    assert core_ticks(text, 0) == (155, 1065)
    with pytest.raises(ValueError):
        core_ticks(text, 7)


def test_shares_are_cpu_seconds_over_the_measured_wall_time() -> None:
    before = CpuSample(10.0, {"front": 1000, "dependency": 50, "generator": 400, "hog": 0}, (0, 0))
    # 2 s later at 100 ticks/s: front 0.6 s, dependency 0.1 s, generator 1.0 s, hog 1.1 s;
    # the front's core was busy 196 of 200 ticks
    after = CpuSample(
        12.0, {"front": 1060, "dependency": 60, "generator": 500, "hog": 110}, (196, 200)
    )
    shares = cpu_shares(before, after, ["front", "dependency", "hog"], ticks_per_second=100)
    assert shares == {
        "seconds": 2.0,
        "front": 0.3,
        "dependency": 0.05,
        "generator": 0.5,
        "hog": 0.55,
        "core": 0.98,
        "outside": 0.08,
    }
    # a process that vanished has no share; outside cannot be told then
    gone = CpuSample(12.0, {**after.processes, "front": None}, (196, 200))
    shares = cpu_shares(before, gone, ["front", "dependency", "hog"], ticks_per_second=100)
    assert shares["front"] is None and shares["outside"] is None
    # tick rounding never makes outside negative
    full = CpuSample(12.0, after.processes, (170, 200))
    shares = cpu_shares(before, full, ["front", "dependency", "hog"], ticks_per_second=100)
    assert shares["core"] == 0.85 and shares["outside"] == 0.0


@pytest.mark.parametrize(
    ("cpu", "late", "expected"),
    [
        ({"generator": 0.5, "dependency": 0.2, "core": 0.99, "outside": 0.02}, False, []),
        ({"generator": 0.5, "dependency": 0.2, "core": 0.6, "outside": 0.3}, False, []),
        # a generator that spins between close sends reads ~100% while keeping schedule
        ({"generator": 0.99, "dependency": 0.2, "core": 0.5, "outside": 0.0}, False, []),
        (
            {"generator": 0.2, "dependency": 0.9, "core": 0.99, "outside": 0.0},
            False,
            ["dependency at 90% of a core"],
        ),
        (
            {"generator": 0.2, "dependency": 0.2, "core": 0.97, "outside": 0.25},
            False,
            ["front's core 97% busy, 25% of it by processes outside the lab"],
        ),
        (
            {"generator": 0.2, "dependency": 0.2, "core": 0.94, "outside": 0.5},
            True,
            ["generator late (p99 7.5 ms)"],
        ),
        (None, True, ["generator late (p99 7.5 ms)"]),
        (None, False, []),
    ],
)
def test_host_bound_rule(cpu: dict[str, Any] | None, late: bool, expected: list[str]) -> None:
    assert host_bound(cpu, late, 7.5) == expected


def _step_result(cpu: tuple[CpuSample, CpuSample] | None, late: bool = False) -> StepResult:
    t = Tally(offered=800, sent=800, ok=780, r503=20)
    return StepResult(
        "10x",
        4000.0,
        3.0,
        1.0,
        True,
        0.0,
        whole={"interactive": t},
        steady={"interactive": t},
        lateness=[0.02 if late else 0.001] * 10,
        cpu=cpu,
    )


def test_a_step_carries_its_cpu_shares_and_why_it_is_host_bound() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = CpuSample(0.0, {"generator": 0, "front": 0, "dependency": 0}, (0, 0))
    after = CpuSample(
        2.0,
        {"generator": int(1.9 * hz), "front": int(1.2 * hz), "dependency": int(1.8 * hz)},
        (int(1.98 * hz), 2 * hz),
    )
    step = summarize_step(_step_result((before, after)), 10.0, ["front", "dependency"])
    assert step["cpu"]["generator"] == 0.95
    assert step["cpu"]["front"] == 0.6 and step["cpu"]["dependency"] == 0.9
    assert step["cpu"]["core"] == 0.99 and step["cpu"]["outside"] == 0.0
    assert step["host_bound"] == ["dependency at 90% of a core"]
    assert cpu_cell(step) == "60/90/95 (core 99)"
    assert host_cell(step) == "host-bound: dependency at 90% of a core"
    # the same shares with the dependency on another core: the front's core had room
    # for 39% of something outside the lab
    apart = summarize_step(_step_result((before, after)), 10.0, ["front"])
    assert apart["cpu"]["outside"] == 0.39
    assert apart["host_bound"] == [
        "dependency at 90% of a core",
        "front's core 99% busy, 39% of it by processes outside the lab",
    ]
    run = {"label": "x", "steps": [step, summarize_step(_step_result(None), 4.0)]}
    assert host_bound_steps(run) == [f"10x ({', '.join(step['host_bound'])})"]
    unmeasured = summarize_step(_step_result(None), 4.0)
    assert unmeasured["cpu"] is None and unmeasured["host_bound"] == []
    assert cpu_cell(unmeasured) == "-" and host_cell(unmeasured) == "ok"


@linux_only
def test_read_sample_reads_this_process_as_the_kernel_accounts_it() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    sample = read_sample([("me", os.getpid()), ("nobody", 2**22 + 12345)], 0)
    times = os.times()
    mine = sample.processes["me"]
    assert mine is not None
    assert abs(mine - (times.user + times.system) * hz) <= 3
    assert sample.processes["nobody"] is None
    assert sample.core is not None and 0 <= sample.core[0] <= sample.core[1]


@linux_only
def test_the_hog_spins_on_its_core_and_dies_with_the_block() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with cpu_hog([cpu]) as pid:
        assert os.sched_getaffinity(pid) == {cpu}
        start = read_sample([("hog", pid)], None).processes["hog"]
        assert start is not None
        # It spins: it keeps using CPU (how fast depends on what else runs on that core, so
        # the test waits for 5 ticks rather than asking for a share).
        give_up = time.monotonic() + 10
        used = 0
        while used < 5 and time.monotonic() < give_up:
            time.sleep(0.05)
            now = read_sample([("hog", pid)], None).processes["hog"]
            assert now is not None
            used = now - start
        assert used >= 5
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
    with pytest.raises(KeyboardInterrupt), cpu_hog([cpu]) as pid:
        raise KeyboardInterrupt
    assert not os.path.exists(f"/proc/{pid}")


def test_the_hog_exits_by_itself_once_the_lab_is_not_its_parent() -> None:
    # Started with a parent pid that is not its parent, as after the lab died.
    proc = subprocess.Popen(
        [sys.executable, "-c", HOG_SOURCE, "0", str(os.getpid() + 1)],
        stdout=subprocess.DEVNULL,
    )
    assert proc.wait(10) == 0


def test_cpu_starved_runs_by_default_on_the_protected_and_uvicorn_configurations() -> None:
    starved = SCENARIOS["cpu-starved"]
    assert "cpu-starved" in DEFAULT_SCENARIOS and starved.hog and starved.needs_dependency
    assert [p.load for p in starved.phases] == [4.0, 10.0]
    assert [c for c in CONFIGURATIONS if starved.runs_on(c)] == [
        "uvicorn-limit",
        "brownout-fixed",
        "brownout-adaptive",
    ]
    settings = LabSettings()
    plan = plan_for(starved, settings, 300.0, Target("127.0.0.1", 1, ""), ("127.0.0.1", 2))
    assert [s.rate for s in plan.steps] == [150.0, 1200.0, 3000.0]  # warm-up, 4x, 10x
    assert not plan.steps[0].measured


def _starved_lab(goodput: dict[str, float], p99: float = 0.05) -> dict[str, Any]:
    capacity = 300.0
    runs = []
    for name, good in goodput.items():
        steps = []
        for label, load in (("4x + hog", 4.0), ("10x + hog", 10.0)):
            offered = int(load * capacity * 2)
            ok = int(good * 2)
            t = Tally(offered=offered, sent=offered, ok=ok, r503=offered - ok)
            t.success_latency += [p99] * ok
            t.shed_reasons["queue_full"] = offered - ok
            res = StepResult(label, load * capacity, 3.0, 1.0, True, 0.0, {"i": t}, {"i": t})
            res.lateness = [0.001]
            steps.append(summarize_step(res, load))
        runs.append({"configuration": name, "scenario": "cpu-starved", "steps": steps})
    return {
        "settings": asdict(LabSettings()),
        "target": None,
        "calibration": {"capacity": capacity, "service_time": 0.04, "levels": []},
        "configurations": [asdict(CONFIGURATIONS[n]) for n in goodput],
        "scenarios": [{"name": "cpu-starved", "title": "CPU-starved front", "description": ""}],
        "runs": runs,
    }


def test_cpu_starved_invariants_compare_adaptive_with_uvicorn_in_the_same_step() -> None:
    ok = _starved_lab({"uvicorn-limit": 290.0, "brownout-fixed": 280.0, "brownout-adaptive": 288})
    checks = evaluate(ok)
    assert {c["configuration"] for c in checks} == {"brownout-adaptive"}
    assert len(checks) == 6 and all(c["passed"] for c in checks), checks
    rival = [c for c in checks if "uvicorn-limit's" in c["check"]]
    assert [c["limit"] for c in rival] == [290.0 - STARVED_SLACK * 300] * 2
    # the fixed configuration's are reported as targets
    assert {c["configuration"] for c in targets(ok)} == {"brownout-fixed"}

    behind = evaluate(_starved_lab({"uvicorn-limit": 298.0, "brownout-adaptive": 280.0}))
    assert {c["check"] for c in behind if not c["passed"]} == {
        "goodput >= uvicorn-limit's (298.0 req/s) less 2% of capacity"
    }
    low = evaluate(_starved_lab({"uvicorn-limit": 200.0, "brownout-adaptive": 250.0}))
    assert {c["check"] for c in low if not c["passed"]} == {"goodput >= 90% of capacity"}
    slow = evaluate(_starved_lab({"brownout-adaptive": 290.0}, p99=0.6))
    assert {c["check"] for c in slow if not c["passed"]} == {"success p99 <= half the deadline"}


def test_a_host_bound_uvicorn_step_makes_the_comparison_host_bound() -> None:
    lab = _starved_lab({"uvicorn-limit": 280.0, "brownout-adaptive": 290.0})
    lab["runs"][0]["steps"][1]["host_bound"] = ["dependency at 96% of a core"]
    checks = {(c["step"], c["check"][:16]): c for c in evaluate(lab)}
    compared = checks[("10x + hog", "goodput >= uvico")]
    assert compared["status"] == "host-bound" and not compared["passed"]
    assert compared["host_bound"] == ["uvicorn-limit: dependency at 96% of a core"]
    assert checks[("10x + hog", "goodput >= 90% o")]["passed"]
    assert checks[("4x + hog", "goodput >= uvico")]["passed"]
    rows = scenario_rows(lab, "cpu-starved")
    assert rows[1][COLUMNS.index("host")] == "host-bound: dependency at 96% of a core"


def test_the_cpu_starved_report_has_a_timeline_and_names_host_bound_checks(
    tmp_path: Path,
) -> None:
    lab = _starved_lab({"uvicorn-limit": 280.0, "brownout-adaptive": 290.0})
    for run in lab["runs"]:
        run |= {"timeline": [{"ok": 5}] * 14, "bin_seconds": 0.5}
    lab["runs"][0]["steps"][1]["host_bound"] = ["dependency at 96% of a core"]
    files = {f.name for f in write_report(lab, tmp_path / "c")}
    assert "timeline-cpu-starved.png" in files
    assert (
        "HOST-BOUND brownout-adaptive / cpu-starved / 10x + hog"
        in (tmp_path / "c" / "report.md").read_text()
    )
