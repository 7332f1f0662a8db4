"""The lab's report, verdict and command line, on synthetic results (T1, S3, S8, O3)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from brownout._cli import TargetError, conclude, main, parse_target
from brownout._lab.generator import PlanResult, StepResult
from brownout._lab.report import (
    COLUMNS,
    markdown,
    print_tables,
    scenario_rows,
    write_markdown,
    write_report,
)
from brownout._lab.runner import CONFIGURATIONS, LabSettings, summarize_plan
from brownout._lab.scenarios import SCENARIOS, quick_variant
from brownout._lab.tally import Tally
from brownout._lab.verdict import evaluate, targets

CAPACITY = 400.0


def _tally(
    offered: int, ok: int, refused: int, latency: float, reason: str = "queue_full"
) -> Tally:
    expired = offered - ok - refused
    t = Tally(offered=offered, sent=offered, ok=ok, r503=refused, timeouts_sent=expired)
    t.success_latency += [latency] * ok
    t.refusal_latency += [0.0005] * refused
    if refused:
        t.shed_reasons[reason] = refused
    return t


def _step(label: str, load: float, classes: dict[str, Tally], late: bool = False) -> StepResult:
    return StepResult(
        label,
        load * CAPACITY,
        3.0,
        1.0,
        True,
        0.0,
        whole=classes,
        steady=classes,
        lateness=[0.02 if late else 0.001] * 10,
        connections_opened=5,
    )


def _ramp(
    goodput_at_overload: float,
    p99: float,
    refused_at_08: int,
    timeouts_at_05: int = 0,
    late_at: float | None = None,
) -> PlanResult:
    steps = []
    for phase in SCENARIOS["ramp"].phases:
        offered = int(phase.load * CAPACITY * 2)  # 2 s of steady state
        if phase.load == 0.5:
            t = _tally(offered, offered - timeouts_at_05, 0, p99)
        elif phase.load <= 1:
            ok = offered - refused_at_08 if phase.load == 0.8 else offered
            t = _tally(offered, ok, offered - ok, p99)
        else:
            ok = int(goodput_at_overload * 2)
            t = _tally(offered, ok, offered - ok, p99)
        steps.append(_step(phase.label, phase.load, {"interactive": t}, late=phase.load == late_at))
    return PlanResult(steps, 0.5, [{"ok": 10, "refused": 0, "expired": 0, "failed": 0}], 30)


def _priority(interactive_ok_share: float) -> PlanResult:
    interactive_offered = 400
    interactive = _tally(
        interactive_offered, int(interactive_offered * interactive_ok_share), 0, 0.03
    )
    interactive.timeouts_sent = interactive.offered - interactive.ok
    batch = _tally(2800, 400, 2400, 0.05)
    return PlanResult(
        [_step("4x mix", 4.0, {"interactive": interactive, "batch": batch})],
        0.5,
        [],
        12,
    )


def make_lab(
    *,
    goodput: float = 390.0,
    p99: float = 0.06,
    refused_at_08: int = 0,
    interactive: float = 1.0,
    timeouts_at_05: int = 0,
    late_at: float | None = None,
) -> dict[str, Any]:
    configs = [CONFIGURATIONS["unprotected"], CONFIGURATIONS["brownout-adaptive"]]
    runs = []
    for config in configs:
        protected = config.brownout
        ramp = _ramp(
            goodput if protected else 20.0,
            p99 if protected else 0.9,
            refused_at_08,
            timeouts_at_05 if protected else 0,
            late_at,
        )
        prio = _priority(interactive if protected else 0.1)
        for name, result in (("ramp", ramp), ("priority", prio)):
            run = {"configuration": config.name, "scenario": name}
            run |= summarize_plan(result, SCENARIOS[name])
            run["backend"] = {}
            runs.append(run)
    from dataclasses import asdict

    return {
        "settings": asdict(LabSettings()),
        "target": None,
        "calibration": {"capacity": CAPACITY, "service_time": 0.021, "levels": []},
        "configurations": [asdict(c) for c in configs],
        "scenarios": [
            {"name": s.name, "title": s.title, "description": s.description}
            for s in (SCENARIOS["ramp"], SCENARIOS["priority"])
        ],
        "runs": runs,
    }


def test_healthy_protection_passes_every_invariant() -> None:
    lab = make_lab()
    checks = evaluate(lab)
    assert checks
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    # only brownout configurations are judged
    assert {c["configuration"] for c in checks} == {"brownout-adaptive"}
    names = {c["check"] for c in checks}
    assert any("goodput >= 90%" in n for n in names)
    assert any("half the deadline" in n for n in names)
    assert any("refusals <= 0.1%" in n for n in names)
    assert any("interactive goodput" in n for n in names)
    assert {
        c["step"] for c in checks if "below capacity" in c["check"] and "goodput" in c["check"]
    } == {
        "0.5x",
        "0.8x",
    }
    assert all(c["status"] == "passed" and not c["host_bound"] for c in checks)


def test_checks_on_a_step_where_the_generator_was_late_are_not_passes() -> None:
    checks = evaluate(make_lab(late_at=10.0))
    at_10x = [c for c in checks if c["step"] == "10x"]
    assert at_10x and all(c["generator_late"] for c in at_10x)
    assert all(c["status"] == "host-bound" and not c["passed"] for c in at_10x)
    assert all(c["host_bound"] == ["generator late (p99 20.0 ms)"] for c in at_10x)
    assert all(c["passed"] for c in checks if c["step"] != "10x")
    # a value that fails on a host-bound step is a failure, not an excuse
    failed = [c for c in evaluate(make_lab(goodput=300.0, late_at=10.0)) if c["step"] == "10x"]
    assert {c["status"] for c in failed if "goodput" in c["check"]} == {"failed"}


@pytest.mark.parametrize(
    ("kwargs", "failing"),
    [
        ({"goodput": 300.0}, "goodput >= 90% of capacity"),
        ({"p99": 0.6}, "success p99 <= half the deadline"),
        ({"refused_at_08": 5}, "refusals <= 0.1% below capacity"),
        ({"interactive": 0.95}, "interactive goodput >= 99% of its demand"),
        # No refusal, yet 2% of the requests below capacity timed out (T1, T4).
        ({"timeouts_at_05": 8}, "goodput >= 99% of offered below capacity"),
    ],
)
def test_each_broken_invariant_fails_the_lab(kwargs: dict[str, Any], failing: str) -> None:
    failed = {c["check"] for c in evaluate(make_lab(**kwargs)) if not c["passed"]}
    assert failed == {failing}


def test_targets_are_reported_not_enforced() -> None:
    t = targets(make_lab(p99=0.2))
    assert {c["check"] for c in t} == {
        "goodput >= 97% of capacity",
        "success p50 <= 1.5x service time",
        "success p99 <= 3x service time",
    }
    assert not all(c["passed"] for c in t)


def test_health_targets_come_from_the_health_class() -> None:
    lab = make_lab()
    health = Tally(offered=20, sent=20, ok=19, timeouts_sent=1)
    health.success_latency += [0.002] * 18 + [0.09]
    work = _tally(8000, 800, 7200, 0.05)
    result = PlanResult(
        [_step("10x + health", 10.0, {"interactive": work, "health": health})], 0.5, [], 3
    )
    run = {"configuration": "brownout-adaptive", "scenario": "health"}
    run |= summarize_plan(result, SCENARIOS["health"])
    lab["runs"].append(run)
    found = {c["check"]: c for c in targets(lab) if c["scenario"] == "health"}
    assert found["health checks all answered"]["value"] == 95.0
    assert not found["health checks all answered"]["passed"]
    assert found["health p99 <= 50 ms under the flood"]["value"] == 90.0
    # health checks are not work: they stay out of goodput
    assert run["steps"][0]["steady"]["offered"] == 8000


def test_rows_keep_success_and_refusal_latency_apart() -> None:
    lab = make_lab()
    rows = scenario_rows(lab, "ramp")
    assert len(rows) == 2 * len(SCENARIOS["ramp"].phases)
    assert all(len(r) == len(COLUMNS) for r in rows)
    adaptive_10x = next(r for r in rows if r[0] == "brownout Gradient2Limit()" and r[1] == "10x")
    assert adaptive_10x[COLUMNS.index("ok p50/p99 ms")] == "60.0 / 60.0"
    assert adaptive_10x[COLUMNS.index("refusal p50 ms")] == "0.5"
    assert "queue_full" in adaptive_10x[COLUMNS.index("shed (reasons)")]
    assert adaptive_10x[COLUMNS.index("% cap")] == "98%"
    assert adaptive_10x[COLUMNS.index("gen late p99 ms")] == "1.0"
    assert adaptive_10x[COLUMNS.index("host")] == "ok"
    late = scenario_rows(make_lab(late_at=10.0), "ramp")[-1]
    assert late[COLUMNS.index("gen late p99 ms")] == "20.0 (late!)"
    assert late[COLUMNS.index("host")] == "host-bound: generator late (p99 20.0 ms)"
    prio = scenario_rows(lab, "priority")
    assert "interactive 200/200" in prio[1][COLUMNS.index("by class: goodput/offered per s")]


def test_write_report_produces_json_pngs_html_and_markdown(tmp_path: Path) -> None:
    lab = make_lab()
    files = write_report(lab, tmp_path / "out", command="brownout lab --quick")
    names = {f.name for f in files}
    assert {"report.json", "index.html", "report.md", "goodput.png", "latency.png"} <= names
    assert "timeline-priority.png" in names
    for f in files:
        assert f.exists() and f.stat().st_size > 0
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == lab
    page = (tmp_path / "out" / "index.html").read_text()
    assert "<table>" in page and "goodput.png" in page and "PASS" in page
    md = (tmp_path / "out" / "report.md").read_text()
    assert "brownout lab --quick" in md and "| configuration |" in md

    doc = tmp_path / "docs" / "lab.md"
    doc.parent.mkdir()
    write_markdown(lab, tmp_path / "out", doc, "brownout lab")
    assert "![goodput.png](lab/goodput.png)" in doc.read_text()
    assert (tmp_path / "docs" / "lab" / "goodput.png").exists()


def test_plots_mark_host_bound_steps(tmp_path: Path) -> None:
    clean = {f.name: f.read_bytes() for f in write_report(make_lab(), tmp_path / "a")}
    late = {f.name: f.read_bytes() for f in write_report(make_lab(late_at=10.0), tmp_path / "b")}
    assert clean["goodput.png"] != late["goodput.png"]
    assert clean["latency.png"] != late["latency.png"]
    again = {f.name: f.read_bytes() for f in write_report(make_lab(), tmp_path / "c")}
    assert clean["goodput.png"] == again["goodput.png"]  # the difference is the marking


def test_a_measurement_repeated_for_a_host_bound_step_says_so() -> None:
    lab = make_lab()
    lab["runs"][0]["attempts"] = 2
    rows = scenario_rows(lab, "ramp")
    assert rows[0][0] == "unprotected (measured 2x: host-bound)"
    assert rows[-1][0] == "brownout Gradient2Limit()"


def test_markdown_names_a_failure() -> None:
    md = markdown(make_lab(goodput=100.0), [])
    assert "**FAIL** brownout-adaptive / ramp / 2x" in md


def test_markdown_and_console_name_a_host_bound_check_and_why() -> None:
    lab = make_lab(late_at=10.0)
    md = markdown(lab, [])
    assert (
        "- HOST-BOUND brownout-adaptive / ramp / 10x: goodput >= 90% of capacity: 390.0 req/s "
        "(limit 360.0) (host-bound: generator late (p99 20.0 ms))"
    ) in md
    assert "PASS brownout-adaptive / ramp / 10x" not in md
    console = Console(width=300, record=True)
    print_tables(lab, console)
    text = console.export_text()
    assert "HOST-BOUND brownout-adaptive / ramp / 10x" in text
    assert "check(s) host-bound: their values passed" in text


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000/api", ("127.0.0.1", 8000, "/api")),
        ("http://localhost:81", ("127.0.0.1", 81, "/")),
        ("http://127.3.2.1:9/x?y=1", ("127.3.2.1", 9, "/x?y=1")),
        ("http://[::1]:8080/p", ("::1", 8080, "/p")),
    ],
)
def test_targets_on_loopback_are_accepted(url: str, expected: tuple[str, int, str]) -> None:
    assert parse_target(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:80/",
        "http://192.168.1.2:8000/",
        "http://example.com:80/",
        "https://127.0.0.1:443/",
        "http://127.0.0.1/",
        "127.0.0.1:8000",
    ],
)
def test_targets_off_this_machine_are_refused(url: str) -> None:
    with pytest.raises(TargetError):
        parse_target(url)


def test_cli_refuses_a_remote_target_before_sending_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["lab", "--target", "http://10.1.2.3:80/"]) == 2
    assert "not a loopback address" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert main([]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--deadline", "-1"],
        ["--deadline", "0"],
        ["--deadline", "nan"],
        ["--deadline", "inf"],
        ["--deadline", "61"],
        ["--deadline", "soon"],
        ["--step", "0"],
        ["--step", "-3"],
        ["--step", "nan"],
    ],
)
def test_cli_refuses_absurd_durations_before_starting_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # A negative, zero or non-finite duration used to start a full lab run (or, for 0, be
    # silently ignored); argparse now refuses it with its usage error (exit 2).
    with pytest.raises(SystemExit) as exit_info:
        main(["lab", "--quick", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err
    assert "seconds" in err


def test_cli_top_is_dispatched_lazily(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import brownout.export._top  # noqa: F401
    except ImportError:
        assert main(["top"]) == 2
        assert "not available" in capsys.readouterr().err
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(["top", "--help"])
        assert exit_info.value.code == 0
        assert "brownout top" in capsys.readouterr().out


def test_quick_ramp_keeps_the_checked_steps() -> None:
    quick = quick_variant(SCENARIOS["ramp"])
    assert [p.load for p in quick.phases] == [0.8, 2.0, 4.0, 10.0]
    assert quick_variant(SCENARIOS["priority"]) is SCENARIOS["priority"]


def test_the_verdict_line_says_when_nothing_was_judged() -> None:
    # `brownout lab --configs unprotected` used to print "all invariants held": nothing held,
    # nothing was checked.
    console = Console(record=True, width=200)
    assert conclude([], console, judged=False) == 0
    assert conclude([], console) == 0  # brownout ran, but only scenarios without invariants
    assert conclude([{"passed": True}, {"passed": True}], console) == 0
    assert conclude([{"passed": True}, {"passed": False}], console) == 1
    assert conclude([{"passed": False}], console, no_fail=True) == 0
    out = console.export_text()
    assert "none of them ran" in out
    assert "the scenarios that ran have none" in out
    assert "all invariants held (2 checks)" in out
    assert out.count("invariant check(s) failed") == 2


def _steady(offered: int, ok: int, refused: int) -> Tally:
    t = Tally(offered=offered, sent=offered, ok=ok, r503=refused)
    t.timeouts_sent = offered - ok - refused
    t.success_latency += [0.03] * ok
    t.refusal_latency += [0.0005] * refused
    if refused:
        t.shed_reasons["queue_full"] = refused
    return t


def _lab(ramp: PlanResult) -> dict[str, Any]:
    config = CONFIGURATIONS["brownout-fixed"]
    run: dict[str, Any] = {"configuration": config.name, "scenario": "ramp"}
    run |= summarize_plan(ramp, SCENARIOS["ramp"])
    return {
        "settings": asdict(LabSettings()),
        "target": None,
        "calibration": {"capacity": CAPACITY, "service_time": 0.021, "levels": []},
        "configurations": [asdict(config)],
        "scenarios": [],
        "runs": [run],
    }


def _ramp_no_success(no_success_at: tuple[float, ...]) -> PlanResult:
    steps = []
    for phase in SCENARIOS["ramp"].phases:
        offered = int(phase.load * CAPACITY * 2)
        if phase.load in no_success_at:
            t = _steady(offered, 0, 0)  # every request timed out: no success latency at all
        elif phase.load <= 1:
            t = _steady(offered, offered, 0)
        else:
            t = _steady(offered, 780, offered - 780)
        steps.append(
            StepResult(
                phase.label,
                phase.load * CAPACITY,
                3.0,
                1.0,
                True,
                0.0,
                whole={"interactive": t},
                steady={"interactive": t},
                lateness=[0.001] * 10,
            )
        )
    return PlanResult(steps, 0.5, [], 10)


def test_a_ramp_step_without_any_success_fails_instead_of_skipping_its_latency_check() -> None:
    healthy = evaluate(_lab(_ramp_no_success(())))
    assert healthy and all(c["passed"] for c in healthy)
    # At 0.8x and 1x every request timed out: no goodput, no refusal, success p99 missing.
    checks = evaluate(_lab(_ramp_no_success((0.8, 1.0))))
    failed = [(c["step"], c["check"]) for c in checks if not c["passed"]]
    assert ("0.8x", "success p99 <= half the deadline") in failed
    assert ("1x", "success p99 <= half the deadline") in failed


def test_late_successes_count_as_expired_and_are_named() -> None:
    # A 2xx after the client's deadline is not goodput; it appeared in no column at all.
    t = _steady(100, 90, 0)
    t.timeouts_sent = 4
    t.ok_late = 6
    step = StepResult(
        "2x", 2 * CAPACITY, 3.0, 1.0, True, 0.0, whole={"i": t}, steady={"i": t}, lateness=[0.001]
    )
    run: dict[str, Any] = {"configuration": "brownout-fixed", "scenario": "ramp"}
    run |= summarize_plan(PlanResult([step], 0.5, [], 1), SCENARIOS["ramp"])
    assert run["steps"][0]["steady"]["expired"] == 10
    lab = _lab(PlanResult([step], 0.5, [], 1))
    lab["scenarios"] = [{"name": "ramp", "title": "Ramp", "description": ""}]
    rows = scenario_rows(lab, "ramp")
    assert rows[0][COLUMNS.index("expired")] == "10 (6 late 2xx)"


def test_the_verdict_line_tells_host_bound_checks_from_failures() -> None:
    console = Console(record=True, width=200)
    bound = {"passed": False, "status": "host-bound"}
    assert conclude([{"passed": True}, bound], console) == 1
    assert conclude([{"passed": False, "status": "failed"}, bound], console) == 1
    out = console.export_text()
    assert out.count("1 check(s) passed on a host-bound step") == 2
    assert out.count("1 invariant check(s) failed") == 1


def test_the_sync_front_is_judged_like_the_async_ones() -> None:
    # Flask under gunicorn gets every ramp invariant, 10x included; its unprotected twin none.
    lab = make_lab()
    lab["configurations"] = [
        asdict(CONFIGURATIONS["sync-unprotected"]),
        asdict(CONFIGURATIONS["sync-brownout"]),
    ]
    lab["runs"] = [r for r in lab["runs"] if r["scenario"] == "ramp"]
    names = {"unprotected": "sync-unprotected", "brownout-adaptive": "sync-brownout"}
    for run in lab["runs"]:
        run["configuration"] = names[run["configuration"]]
    checks = evaluate(lab)
    assert checks and all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    assert {c["configuration"] for c in checks} == {"sync-brownout"}
    assert {c["step"] for c in checks if "of capacity" in c["check"]} == {"2x", "4x", "10x"}
    top = next(
        s
        for r in lab["runs"]
        if r["configuration"] == "sync-brownout"
        for s in r["steps"]
        if s["load"] == 10.0
    )
    top["steady"]["goodput_per_s"] = 100.0
    failed = [c for c in evaluate(lab) if not c["passed"]]
    assert [(c["step"], c["check"]) for c in failed] == [("10x", "goodput >= 90% of capacity")]
