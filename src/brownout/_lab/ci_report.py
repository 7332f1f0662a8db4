"""The lab's report for CI: the run's environment, ``junit.xml`` and ``steps.csv``.

Both files render from the raw result dict, like the rest of `brownout._lab.report`: one
JUnit test suite per (configuration, scenario) with one test case per invariant check, and
one CSV row per (configuration, scenario, step) of the HTTP scenarios.
"""

from __future__ import annotations

import csv
import io
import os
import platform
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._version import VERSION
from .process import usable_cpus
from .server_view import compare_step
from .system_checks import NOT_MEASURED
from .verdict import Check, evaluate, step_host_bound

__all__ = [
    "STEP_FIELDS",
    "environment",
    "environment_lines",
    "junit_xml",
    "steps_csv",
    "verdict_summary",
]

STEP_FIELDS = (
    "configuration",
    "scenario",
    "step",
    "offered_per_s",
    "goodput_per_s",
    "pct_capacity",
    "shed",
    "expired",
    "ok_p50_ms",
    "ok_p99_ms",
    "refusal_p50_ms",
    "host_bound",
    "host_bound_why",
    "server_offered",
    "server_refused",
    "server_expired",
    "server_agrees",
)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's "model name" from ``cpuinfo``, else `platform.processor`, else "unknown"."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    """Where and when the run happened, for ``lab["environment"]``."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "brownout": VERSION,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(usable_cpus()),
    }


def verdict_summary(checks: list[Check]) -> str:
    """One line: PASS, FAIL or HOST-BOUND with counts, or that nothing was checked."""
    if not checks:
        return "no invariant checked"
    failed = sum(1 for c in checks if c.get("status") == "failed")
    bound = sum(1 for c in checks if c.get("status") == "host-bound")
    unmeasured = sum(1 for c in checks if c.get("status") == NOT_MEASURED)
    if failed:
        return f"FAIL ({failed} of {len(checks)} checks failed, {bound} host-bound)"
    if unmeasured:
        return f"NOT MEASURED ({unmeasured} of {len(checks)} checks had no figures)"
    if bound:
        return f"HOST-BOUND ({bound} of {len(checks)} checks on host-bound steps)"
    return f"PASS ({len(checks)} checks)"


def environment_lines(lab: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs for the top of the report; "-" where an older report lacks one."""
    env = lab.get("environment") or {}

    def get(key: str) -> str:
        value = env.get(key)
        return "-" if value is None else str(value)

    return [
        ("verdict", verdict_summary(evaluate(lab))),
        ("date", get("date")),
        ("brownout", get("brownout")),
        ("Python", get("python")),
        ("CPU", get("cpu_model")),
        ("cores", f"{get('cpu_count')} ({get('usable_cpus')} usable)"),
    ]


def _failure_line(c: Check) -> str:
    """The verdict's FAIL line of a check, without Markdown."""
    where = f"{c['configuration']} / {c['scenario']} / {c['step']}"
    why = f" (host-bound: {'; '.join(c['host_bound'])})" if c.get("host_bound") else ""
    return f"FAIL {where}: {c['check']}: {c['value']} {c['unit']} (limit {c['limit']}){why}"


def junit_xml(lab: dict[str, Any]) -> str:
    """The invariant checks as JUnit XML: a failed check is a failure carrying its line, a
    check on a host-bound step or one not measured is skipped with the reason."""
    suites: dict[tuple[str, str], list[Check]] = {}
    for c in evaluate(lab):
        suites.setdefault((c["configuration"], c["scenario"]), []).append(c)
    root = ET.Element("testsuites", name="brownout lab")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for (config, scenario), checks in suites.items():
        failures = sum(1 for c in checks if c.get("status") == "failed")
        skipped = sum(1 for c in checks if c.get("status") in ("host-bound", NOT_MEASURED))
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"{config} / {scenario}",
            tests=str(len(checks)),
            failures=str(failures),
            errors="0",
            skipped=str(skipped),
        )
        for c in checks:
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"brownout.lab.{config}.{scenario}",
                name=f"{c['step'] or '-'}: {c['check']}",
            )
            if c.get("status") == "failed":
                line = _failure_line(c)
                ET.SubElement(case, "failure", message=line).text = line
            elif c.get("status") == "host-bound":
                why = "; ".join(c.get("host_bound") or ["generator late"])
                ET.SubElement(case, "skipped", message=f"host-bound: {why}")
            elif c.get("status") == NOT_MEASURED:
                why = c.get("note") or "no figures"
                ET.SubElement(case, "skipped", message=f"{NOT_MEASURED}: {why}")
        totals["tests"] += len(checks)
        totals["failures"] += failures
        totals["skipped"] += skipped
    for key, value in totals.items():
        root.set(key, str(value))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def steps_csv(lab: dict[str, Any]) -> str:
    """One row per (configuration, scenario, step) of the HTTP scenarios, in `STEP_FIELDS`."""
    cal = lab.get("calibration") or {}
    capacity = float(cal.get("capacity") or 0.0)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(STEP_FIELDS)
    for run in lab["runs"]:
        for step in run["steps"]:
            s = step["steady"]
            bound = step_host_bound(step)
            goodput = s["goodput_per_s"]
            server = {r["figure"]: r["server"] for r in compare_step(step)}
            agrees = step.get("server_agrees")
            writer.writerow(
                [
                    run["configuration"],
                    run["scenario"],
                    step["label"],
                    f"{s['offered_per_s']:.1f}",
                    f"{goodput:.1f}",
                    f"{100 * goodput / capacity:.1f}" if capacity else "",
                    s["refused"],
                    s["expired"],
                    _ms(s["success_p50_ms"]),
                    _ms(s["success_p99_ms"]),
                    _ms(s["refusal_p50_ms"]),
                    "true" if bound else "false",
                    "; ".join(bound),
                    server.get("offered", ""),
                    server.get("refused", ""),
                    server.get("expired", ""),
                    "" if agrees is None else str(agrees).lower(),
                ]
            )
    return buf.getvalue()
