"""Whole-system checks on virtual data: each kind passing, failing and not measured; their
keys in a scenario file; the metrics parser; the proxy's arrival ring on a virtual clock;
the figures a run gathers; the report and junit.xml for a check that was not measured."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import asdict
from typing import Any

import pytest

from brownout._lab.ci_report import junit_xml, verdict_summary
from brownout._lab.proxy import _Arrivals
from brownout._lab.report import check_line
from brownout._lab.scenario_file import ScenarioFileError, parse_scenario
from brownout._lab.system_checks import (
    NOT_MEASURED,
    SystemObserver,
    late_success_check,
    parse_metrics,
    queue_gauges,
    retries_counter,
    system_checks,
)
from brownout._lab.verdict import evaluate

HEAD = """
version = 1
name = "shop"
[classes.checkout]
priority = "critical"
[[endpoints]]
name = "order"
path = "/order"
class = "checkout"
[[endpoints]]
name = "browse"
path = "/browse"
[[steps]]
label = "base"
load = 0.5
[[steps]]
label = "fault"
load = 2.0
[[steps]]
label = "after"
load = 0.5
"""

FULL = (
    HEAD
    + """
[[invariants]]
check = "queue_bounded"
max = 50
max_age = 0.5
metrics = "http://127.0.0.1:9/metrics"
[[invariants]]
check = "retry_budget"
max = 0.1
min_per_second = 2
window = 2
[[invariants]]
check = "priority_goodput_stable"
min = 0.9
class = "checkout"
baseline = "base"
[[invariants]]
check = "no_thundering_herd"
max = 2
capacity = 100
proxy = "http://127.0.0.1:9"
steps = ["fault", "after"]
[[invariants]]
check = "late_success_reconciled"
source = "http://127.0.0.1:9/idempotency"
"""
)


def _invariants() -> list[dict[str, Any]]:
    return [asdict(i) for i in parse_scenario(FULL, env={}).invariants]


def test_the_system_checks_are_invariant_kinds_with_their_keys() -> None:
    sf = parse_scenario(FULL, env={})
    by = {i.check: i for i in sf.invariants}
    assert by["queue_bounded"].threshold == 50
    assert by["queue_bounded"].options == {"max_age": 0.5, "metrics": "http://127.0.0.1:9/metrics"}
    assert by["retry_budget"].options == {"min_per_second": 2.0, "window": 2.0}
    assert by["priority_goodput_stable"].traffic_class == "checkout"
    assert by["priority_goodput_stable"].options == {"baseline": "base"}
    assert by["no_thundering_herd"].steps == ("fault", "after")
    assert by["late_success_reconciled"].threshold == 0.0  # no duplicate: the default


@pytest.mark.parametrize(
    ("invariant", "message"),
    [
        ('check = "queue_bounded"', r"invariants\[0\]\.max: is required"),
        ('check = "queue_bounded"\nmin = 3', r"invariants\[0\]\.min: queue_bounded takes max"),
        ('check = "queue_bounded"\nmax = 3\nproxy = "http://x"', r"\.proxy: unknown field"),
        ('check = "retry_budget"\nmax = 0.1\nmetrics = "ftp://x"', r"\.metrics: must be an http"),
        (
            'check = "priority_goodput_stable"\nmin = 0.9\nclass = "checkout"',
            r"\.baseline: is required",
        ),
        (
            'check = "priority_goodput_stable"\nmin = 0.9\nclass = "checkout"\nbaseline = "x"',
            r"\.baseline: no step is labelled 'x'",
        ),
        ('check = "priority_goodput_stable"\nmin = 1.5\nbaseline = "base"', r"\.min: is a share"),
        (
            'check = "priority_goodput_stable"\nmin = 0.9\nbaseline = "base"',
            r"\.class: priority_goodput_stable needs class",
        ),
        ('check = "no_thundering_herd"\nmax = 0', r"\.max: must be > 0"),
        ('check = "no_thundering_herd"\nmax = 2\ncapacity = -1', r"\.capacity: must be > 0"),
        ('check = "late_success_reconciled"\nsteps = ["nope"]', r"\.steps: no step is labelled"),
    ],
)
def test_bad_system_invariants_name_the_field(invariant: str, message: str) -> None:
    with pytest.raises(ScenarioFileError, match=message):
        parse_scenario(HEAD + "[[invariants]]\n" + invariant + "\n", env={})


def test_a_system_check_may_name_an_endpoint_as_its_class() -> None:
    text = HEAD + '[[invariants]]\ncheck = "priority_goodput_stable"\nmin = 0.9\n'
    text += 'class = "browse"\nbaseline = "base"\n'
    assert parse_scenario(text, env={}).invariants[0].traffic_class == "browse"


# -- the server's metrics -------------------------------------------------------------------

METRICS = """
# HELP brownout_queue_depth_requests Requests waiting in a bulkhead's queue.
# TYPE brownout_queue_depth_requests gauge
brownout_queue_depth_requests{bulkhead="api"} 12.0
brownout_queue_depth_requests{bulkhead="admin"} 3.0
brownout_queue_oldest_age_seconds{bulkhead="api"} 0.25
brownout_retries_total{cause="timeout",source="db"} 4.0
brownout_retries_total{cause="error",source="db"} 1.0
brownout_requests_offered_total 100
"""


def test_the_queue_gauges_and_retries_come_from_the_metrics_text() -> None:
    samples = parse_metrics(METRICS)
    assert samples['brownout_queue_depth_requests{bulkhead="api"}'] == 12.0
    assert samples["brownout_requests_offered_total"] == 100.0
    assert queue_gauges(samples) == (12.0, 0.25)
    assert retries_counter(samples) == 5.0
    assert queue_gauges({"brownout_requests_offered_total": 1.0}) is None
    assert retries_counter({}) is None
    with pytest.raises(ValueError):  # a scrape of such a page reads as none
        parse_metrics(METRICS + "garbage line\n")


# -- the checks on virtual runs -------------------------------------------------------------


def _step(
    label: str,
    start: float,
    *,
    order: float = 50.0,
    offered: int = 200,
    retries: int = 0,
    system: dict[str, Any] | None = None,
    bound: list[str] | None = None,
) -> dict[str, Any]:
    step: dict[str, Any] = {
        "label": label,
        "load": 1.0,
        "start": start,
        "duration": 3.0,
        "steady_seconds": 2.0,
        "valid": True,
        "host_bound": bound or [],
        "steady": {"offered": offered, "ok": offered},
        "classes": {
            "order": {"goodput_per_s": order, "offered": 100},
            "browse": {"goodput_per_s": 40.0, "offered": 100},
        },
        "retries": {"offered": retries},
    }
    if system is not None:
        step["system"] = system
    return step


def _run(*steps: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"configuration": "target", "scenario": "shop", "steps": list(steps), **extra}


def _members(name: str | None) -> list[str]:
    return ["order"] if name == "checkout" else [name] if name else []


def _checks(kind: str, run: dict[str, Any], capacity: float | None = None) -> list[Any]:
    chosen = [i for i in _invariants() if i["check"] == kind]
    return system_checks(chosen, [run], _members, capacity)


def _queue(depth: float | None, age: float | None = 0.1) -> dict[str, Any]:
    figures = {"scrapes": 8, "queue_depth_max": depth, "queue_age_max": age}
    return {"metrics": {"http://127.0.0.1:9/metrics": {**figures, "server_retries": None}}}


def test_queue_bounded_passes_fails_and_is_not_measured_without_gauges() -> None:
    run = _run(
        _step("base", 0.0, system=_queue(4.0)),
        _step("fault", 3.0, system=_queue(80.0, 0.9)),
        _step("after", 6.0, system=_queue(None, None)),
    )
    checks = _checks("queue_bounded", run)
    got = [(c["step"], c["unit"], c["status"]) for c in checks]
    assert got == [
        ("base", "requests", "passed"),
        ("base", "s", "passed"),
        ("fault", "requests", "failed"),
        ("fault", "s", "failed"),
        ("after", "requests", NOT_MEASURED),
        ("after", "s", NOT_MEASURED),
    ]
    assert not any(c["passed"] for c in checks[4:])
    assert checks[2]["value"] == 80.0 and checks[2]["limit"] == 50.0


def test_a_passing_value_on_a_host_bound_step_is_host_bound() -> None:
    run = _run(_step("base", 0.0, system=_queue(4.0), bound=["generator late"]))
    assert {c["status"] for c in _checks("queue_bounded", run)} == {"host-bound"}


def test_retry_budget_counts_client_and_server_retries() -> None:
    server = {"metrics": {"u": {"server_retries": 9.0}}}
    run = _run(
        _step("base", 0.0, offered=200, retries=24),  # 24 <= 0.1 x 200 + 2/s x 2 s
        _step("fault", 3.0, offered=200, retries=20, system=server),  # 29 > 24
    )
    checks = _checks("retry_budget", run)
    assert [(c["value"], c["limit"], c["passed"]) for c in checks] == [
        (24, 24.0, True),
        (29, 24.0, False),
    ]
    assert "client + server" in checks[1]["check"]
    unmeasured = _run({**_step("base", 0.0), "retries": {}})
    assert _checks("retry_budget", unmeasured)[0]["status"] == NOT_MEASURED
    # Without a window, RetryBudget's 10 s: its floor may all go in one short step.
    (default,) = [i for i in _invariants() if i["check"] == "retry_budget"]
    default = {**default, "options": {"min_per_second": 2.0}}
    (check,) = system_checks(
        [default], [_run(_step("base", 0.0, offered=200, retries=24))], _members
    )
    assert check["limit"] == 0.1 * 200 + 2.0 * 10


def test_priority_goodput_against_the_baseline_step() -> None:
    run = _run(
        _step("base", 0.0, order=50.0),
        _step("fault", 3.0, order=45.0),  # 90% of the baseline: the limit itself
        _step("after", 6.0, order=44.9),
    )
    checks = _checks("priority_goodput_stable", run)
    assert [(c["step"], c["limit"], c["passed"]) for c in checks] == [
        ("fault", 45.0, True),
        ("after", 45.0, False),
    ]
    no_base = _run(_step("base", 0.0, order=0.0), _step("fault", 3.0))
    assert _checks("priority_goodput_stable", no_base)[0]["status"] == NOT_MEASURED


def _arrivals(busiest: int | None) -> dict[str, Any]:
    got = None if busiest is None else {"bin_seconds": 0.1, "max": busiest, "bins": 30}
    return {"arrivals": {"http://127.0.0.1:9": got}}


def test_no_thundering_herd_reads_the_proxy_bins_of_the_named_steps() -> None:
    run = _run(
        _step("base", 0.0, system=_arrivals(99)),  # not named: not checked
        _step("fault", 3.0, system=_arrivals(20)),  # 2 x 100/s x 0.1 s = 20
        _step("after", 6.0, system=_arrivals(21)),
    )
    checks = _checks("no_thundering_herd", run)
    assert [(c["step"], c["value"], c["limit"], c["passed"]) for c in checks] == [
        ("fault", 20, 20.0, True),
        ("after", 21, 20.0, False),
    ]
    missing = _run(_step("fault", 3.0, system=_arrivals(None)))
    assert _checks("no_thundering_herd", missing)[0]["status"] == NOT_MEASURED


def test_no_thundering_herd_on_the_demo_backends_bins() -> None:
    inv = {"check": "no_thundering_herd", "threshold": 1.5, "steps": [], "options": {}}
    step = {**_step("returned", 0.0), "dependency": {"peak_100ms": 31}}
    checks = system_checks([inv], [_run(step)], _members, dependency_capacity=200.0)
    assert (checks[0]["value"], checks[0]["limit"], checks[0]["passed"]) == (31, 30.0, False)
    no_capacity = system_checks([inv], [_run(step)], _members)
    assert no_capacity[0]["status"] == NOT_MEASURED


def test_late_success_reconciled() -> None:
    run = _run()
    assert late_success_check(run, {"duplicates": 0, "replayed": 12})["passed"]
    assert not late_success_check(run, {"duplicates": 1, "replayed": 12})["passed"]
    assert not late_success_check(run, {"duplicates": 0, "replayed": 3, "unreconciled": 1})[
        "passed"
    ]
    assert late_success_check(run, None)["status"] == NOT_MEASURED
    assert late_success_check(run, {"duplicates": 0, "replayed": 0})["status"] == NOT_MEASURED
    source = "http://127.0.0.1:9/idempotency"
    run["system"] = {"idempotency": {source: {"duplicates": 2, "replayed": 5}}}
    (check,) = _checks("late_success_reconciled", run)
    assert (check["value"], check["status"]) == (2, "failed")


# -- gathering ------------------------------------------------------------------------------


def test_the_observer_files_scrapes_and_proxy_bins_under_their_steps() -> None:
    invs = [i for i in _invariants() if i["check"] in ("queue_bounded", "retry_budget")]
    observer = SystemObserver(invs, "http://127.0.0.1:9/default")
    assert sorted(observer.samples) == ["http://127.0.0.1:9/default", "http://127.0.0.1:9/metrics"]
    origin = 1000.0

    def scrape(depth: float, retries: float) -> dict[str, float]:
        return {
            "brownout_queue_depth_requests": depth,
            'brownout_retries_total{cause="timeout"}': retries,
        }

    # Scrapes on the generator's clock: step "base" is [1000, 1003), "fault" [1003, 1006).
    observer.samples["http://127.0.0.1:9/metrics"] = deque(
        [(1001.0, scrape(2, 10)), (1002.0, scrape(5, 12)), (1004.0, scrape(70, 13))]
    )
    run = _run(_step("base", 0.0), _step("fault", 3.0), origin=origin)
    observer.attach(run)
    base = run["steps"][0]["system"]["metrics"]["http://127.0.0.1:9/metrics"]
    fault = run["steps"][1]["system"]["metrics"]["http://127.0.0.1:9/metrics"]
    assert (base["queue_depth_max"], base["server_retries"], base["scrapes"]) == (5, 2.0, 2)
    assert (fault["queue_depth_max"], fault["server_retries"]) == (70, None)  # one scrape
    nothing = run["steps"][0]["system"]["metrics"]["http://127.0.0.1:9/default"]
    assert nothing["queue_depth_max"] is None


def test_the_proxy_ring_counts_per_bin_and_forgets_the_oldest() -> None:
    ring = _Arrivals(width=0.1, size=5)
    for t in (10.00, 10.05, 10.12, 10.31):
        ring.add(t)
    answer = ring.as_dict(10.35)
    assert answer["bins"] == [[100, 2], [101, 1], [103, 1]]
    assert (answer["oldest_bin"], answer["newest_bin"]) == (99, 103)
    ring.add(10.61)  # bin 106 reuses bin 101's slot
    later = ring.as_dict(10.65)
    assert later["bins"] == [[103, 1], [106, 1]]
    assert later["oldest_bin"] == 102


# -- the report -----------------------------------------------------------------------------


def test_a_scenario_files_system_checks_reach_the_verdict_and_junit() -> None:
    sf = parse_scenario(FULL, env={})
    lab = {
        "calibration": {"capacity": 100.0},
        "scenario_file": {
            "endpoints": [
                {"name": e.name, "class": e.traffic_class, "deadline": sf.deadline(e)}
                for e in sf.endpoints
            ],
            "invariants": [asdict(i) for i in sf.invariants],
        },
        "runs": [_run(_step("base", 0.0), _step("fault", 3.0), _step("after", 6.0))],
    }
    checks = evaluate(lab)
    kinds = {c["status"] for c in checks}
    assert NOT_MEASURED in kinds and "passed" in kinds  # retries and priority are measured
    assert verdict_summary(checks).startswith("NOT MEASURED")
    root = ET.fromstring(junit_xml(lab))
    skipped = [s.get("message") for s in root.iter("skipped")]
    assert any(m and m.startswith("not measured: no queue gauge") for m in skipped)
    assert root.get("failures") == "0" and int(root.get("skipped") or 0) == len(skipped)


def test_the_exit_status_fails_on_a_check_not_measured_and_says_so() -> None:
    from rich.console import Console

    from brownout._cli import conclude

    console = Console(record=True, width=200)
    assert conclude([{"passed": True}, {"passed": False, "status": NOT_MEASURED}], console) == 1
    out = console.export_text()
    assert "1 check(s) not measured" in out and "invariant check(s) failed" not in out
    line = check_line(late_success_check(_run(), None))
    assert line.startswith("NOT MEASURED target / shop / whole run:") and "(no counts)" in line
