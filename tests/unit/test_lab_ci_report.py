"""The lab's report for CI: junit.xml, steps.csv, the run's environment, --compare."""

from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from brownout._cli import main
from brownout._lab.ci_report import (
    STEP_FIELDS,
    cpu_model,
    environment,
    environment_lines,
    junit_xml,
    steps_csv,
    verdict_summary,
)
from brownout._lab.compare import compare_markdown, compare_reports, compare_rows
from brownout._lab.report import markdown
from brownout._lab.verdict import evaluate

CAPACITY = 400.0


def _steady(goodput: float, p99: float | None, refused: int = 800) -> dict[str, Any]:
    offered = 1600
    ok = int(goodput * 2)
    return {
        "offered": offered,
        "sent": offered,
        "ok": ok,
        "ok_late": 0,
        "r429": 0,
        "r503": refused,
        "r504": 0,
        "other_status": 0,
        "errors": 0,
        "timeouts_sent": offered - ok - refused,
        "timeouts_unsent": 0,
        "offered_per_s": 800.0,
        "goodput_per_s": goodput,
        "degraded": 0,
        "degraded_ok": 0,
        "degraded_goodput_per_s": 0.0,
        "degraded_per_s": 0.0,
        "refused": refused,
        "expired": offered - ok - refused,
        "shed_reasons": {"queue_full": refused},
        "success_p50_ms": None if p99 is None else p99 / 2,
        "success_p99_ms": p99,
        "refusal_p50_ms": 0.5,
        "refusal_p99_ms": 0.5,
    }


def _step(label: str, goodput: float, p99: float | None, bound: list[str]) -> dict[str, Any]:
    steady = _steady(goodput, p99)
    return {
        "label": label,
        "load": 2.0 if label == "2x" else 4.0,
        "rate": 800.0,
        "duration": 3.0,
        "settle": 1.0,
        "start": 0.0,
        "steady_seconds": 2.0,
        "valid": True,
        "lateness_p99_ms": 1.0,
        "cpu": None,
        "host_bound": bound,
        "connections_opened": 5,
        "steady": steady,
        "classes": {"interactive": steady},
        "whole": steady,
        "retries_withheld": 0,
    }


def report(
    goodput: float = 390.0,
    p99: float | None = 60.0,
    bound_at_4x: list[str] | None = None,
    env: bool = True,
) -> dict[str, Any]:
    """A small report.json: brownout-adaptive on the ramp's 2x and 4x steps (real keys)."""
    lab: dict[str, Any] = {
        "settings": {
            "deadline": 1.0,
            "step_seconds": 3.0,
            "settle_seconds": 1.0,
            "arrivals": "constant",
        },
        "target": None,
        "calibration": {"capacity": CAPACITY, "service_time": 0.021, "levels": []},
        "configurations": [
            {"name": "brownout-adaptive", "title": "brownout Gradient2Limit()", "brownout": True}
        ],
        "scenarios": [{"name": "ramp", "title": "Ramp", "description": "a ramp"}],
        "runs": [
            {
                "configuration": "brownout-adaptive",
                "scenario": "ramp",
                "steps": [
                    _step("2x", goodput, p99, []),
                    _step("4x", goodput, p99, bound_at_4x or []),
                ],
            }
        ],
    }
    if env:
        lab["environment"] = {
            "date": "2026-01-02 03:04:05 UTC",
            "brownout": "9.9.9",
            "python": "3.12.1",
            "cpu_model": "Example CPU @ 3.0GHz",
            "cpu_count": 8,
            "usable_cpus": 4,
        }
    return lab


def test_a_healthy_report_passes_and_says_so() -> None:
    checks = evaluate(report())
    assert checks and all(c["passed"] for c in checks)
    assert verdict_summary(checks) == f"PASS ({len(checks)} checks)"
    assert verdict_summary([]) == "no invariant checked"


def _message(case: ET.Element, tag: str) -> str:
    child = case.find(tag)
    assert child is not None
    return child.get("message") or ""


def test_junit_has_one_suite_per_configuration_and_scenario() -> None:
    root = ET.fromstring(junit_xml(report(goodput=300.0, bound_at_4x=["front saturated"])))
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["brownout-adaptive / ramp"]
    cases = suites[0].findall("testcase")
    assert root.get("tests") == str(len(cases)) == suites[0].get("tests")
    failed = [c for c in cases if c.find("failure") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    # 2x: the goodput floor fails; 4x: it fails too (a failing value is a failure even
    # on a host-bound step); 4x's p99 held on a host-bound step: skipped, with the reason
    assert [c.get("name") for c in failed] == [
        "2x: goodput >= 90% of capacity",
        "4x: goodput >= 90% of capacity",
    ]
    message = _message(failed[0], "failure")
    assert message.startswith("FAIL brownout-adaptive / ramp / 2x")
    assert "300.0" in message and "**" not in message
    assert [c.get("name") for c in skipped] == ["4x: success p99 <= half the deadline"]
    assert _message(skipped[0], "skipped") == "host-bound: front saturated"
    assert root.get("failures") == "2" and root.get("skipped") == "1"


def test_junit_without_checks_is_an_empty_suite_list() -> None:
    lab = report()
    lab["configurations"][0]["brownout"] = False  # nothing judged
    root = ET.fromstring(junit_xml(lab))
    assert root.tag == "testsuites" and root.get("tests") == "0" and not list(root)


def test_steps_csv_has_a_row_per_step() -> None:
    rows = list(csv.DictReader(io.StringIO(steps_csv(report(bound_at_4x=["generator late"])))))
    assert tuple(rows[0]) == STEP_FIELDS
    assert [(r["configuration"], r["scenario"], r["step"]) for r in rows] == [
        ("brownout-adaptive", "ramp", "2x"),
        ("brownout-adaptive", "ramp", "4x"),
    ]
    first = rows[0]
    assert first["offered_per_s"] == "800.0" and first["goodput_per_s"] == "390.0"
    assert first["pct_capacity"] == "97.5"
    assert first["shed"] == "800" and first["expired"] == "20"
    assert (first["ok_p50_ms"], first["ok_p99_ms"], first["refusal_p50_ms"]) == (
        "30.0",
        "60.0",
        "0.5",
    )
    assert first["host_bound"] == "false" and rows[1]["host_bound"] == "true"
    assert rows[1]["host_bound_why"] == "generator late"


def test_steps_csv_leaves_unknown_figures_empty() -> None:
    lab = report(p99=None)
    lab["calibration"] = None
    row = next(csv.DictReader(io.StringIO(steps_csv(lab))))
    assert row["ok_p99_ms"] == "" and row["pct_capacity"] == ""


def test_the_environment_heads_report_md_and_index_html(tmp_path: Path) -> None:
    from brownout._lab.report import write_report

    lab = report()
    lines = dict(environment_lines(lab))
    assert lines["verdict"].startswith("PASS")
    assert lines["CPU"] == "Example CPU @ 3.0GHz" and lines["cores"] == "8 (4 usable)"
    md = markdown(lab, [], header=True)
    head = md.split("## ")[0]
    for text in ("**verdict**: PASS", "2026-01-02 03:04:05 UTC", "9.9.9", "3.12.1", "8 (4 usable)"):
        assert text in head
    assert "**verdict**" not in markdown(lab, [])  # the docs page keeps its own top
    files = {f.name for f in write_report(lab, tmp_path)}
    assert {"junit.xml", "steps.csv", "report.md", "index.html"} <= files
    page = (tmp_path / "index.html").read_text()
    assert page.index("Example CPU @ 3.0GHz") < page.index("<h2>")
    assert "<b>Python</b>: 3.12.1" in page
    old = dict(environment_lines(report(env=False)))  # a report from before: no environment
    assert old["date"] == "-" and old["cores"] == "- (- usable)"


def test_environment_reads_this_host(tmp_path: Path) -> None:
    env = environment()
    assert env["date"].endswith(" UTC") and env["python"].count(".") == 2
    assert env["usable_cpus"] >= 1 and env["cpu_model"]
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t: fpu\n")
    assert cpu_model(info) == "Some CPU 9000"
    assert cpu_model(tmp_path / "absent")  # falls back to platform.processor() or "unknown"


def test_compare_reports_names_steps_that_regressed() -> None:
    old, new = report(), report(goodput=300.0, p99=80.0)
    deltas = compare_reports(old, new)
    assert [(d.configuration, d.scenario, d.step) for d in deltas] == [
        ("brownout-adaptive", "ramp", "2x"),
        ("brownout-adaptive", "ramp", "4x"),
    ]
    d = deltas[0]
    assert (d.goodput_old, d.goodput_new, d.goodput_delta) == (390.0, 300.0, -90.0)
    assert (d.p99_old, d.p99_new, d.p99_delta) == (60.0, 80.0, 20.0)
    assert d.newly_failed == ("goodput >= 90% of capacity",)
    assert d.regressed
    rows = compare_rows(deltas)
    assert rows[0] == [
        "brownout-adaptive",
        "ramp",
        "2x",
        "390 -> 300 (-90)",
        "60.0 -> 80.0 (+20.0)",
        "goodput >= 90% of capacity",
    ]
    assert "| brownout-adaptive | ramp | 2x |" in compare_markdown(deltas, "old.json")


def test_compare_reports_small_changes_and_improvements_are_not_regressions() -> None:
    deltas = compare_reports(report(goodput=370.0, p99=70.0), report(goodput=360.0, p99=80.0))
    assert not any(d.regressed for d in deltas)  # -2.7% goodput, +14% p99: noise
    assert compare_rows(deltas) == []
    assert "No step regressed." in compare_markdown(deltas, "old.json")
    assert not any(d.regressed for d in compare_reports(report(goodput=300.0), report()))


def test_compare_reports_latency_alone_and_host_bound_checks() -> None:
    (d2, d4) = compare_reports(report(), report(p99=120.0, bound_at_4x=["front saturated"]))
    assert d2.regressed and not d2.newly_failed  # p99 doubled, still within its limit
    assert d4.newly_failed == (
        "goodput >= 90% of capacity (host-bound)",
        "success p99 <= half the deadline (host-bound)",
    )


def test_compare_reports_keeps_steps_found_in_one_report_only() -> None:
    old, new = report(), report()
    new["runs"][0]["steps"].pop()
    deltas = compare_reports(old, new)
    gone = deltas[-1]
    assert gone.step == "4x" and gone.goodput_new is None and gone.goodput_delta is None
    assert not gone.regressed


def test_cli_refuses_a_compare_file_that_is_not_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"not": "a report"}))
    assert main(["lab", "--compare", str(bad)]) == 2
    assert "not a lab report.json" in capsys.readouterr().out
    assert main(["lab", "--compare", str(tmp_path / "absent.json")]) == 2
