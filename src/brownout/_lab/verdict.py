"""Pass/fail: the invariants a brownout-protected service must hold in the lab.

Checked on every configuration protected by brownout (or on the user's ``--target``):

- goodput at 2x, 4x and 10x of capacity >= 90% of capacity (T1);
- success p99 <= half the client deadline at every ramp step (useful successes, O3);
- at 0.8x, refusals <= 0.1% of offered (no false-positive shedding, S8);
- in the priority mix, interactive goodput >= 99% of interactive demand (S3).

`targets` adds the demo's stricter goals (adaptive: >= 97% of capacity at 10x, success p50
<= 1.5x and p99 <= 3x the dependency's service time; every health check answered within
50 ms under the 10x flood, S7) and the outbound goals on brownout configurations (outage:
the busiest second at the dependency after it returns <= 1.5x its steady rate, R5; retry
storm: the dependency never asked more than 1.25x capacity, R1/R3; degraded: goodput while
the dependency is slow >= 90% of offered, G3). They are reported, not enforced.

In the CPU-starved scenario (a hog shares the front's core) brownout-adaptive must keep, at
4x and 10x, goodput >= 90% of capacity and >= the goodput of uvicorn --limit-concurrency in
the same step of the same lab run (less `STARVED_SLACK` of capacity), and success p99 <= half
the deadline; the same are reported as targets for brownout-fixed.

In the backlog scenario (opt-in, on Redis Streams: `brownout._lab.backlog`), brownout's
consumer must serve fresh messages within their deadline again within `FRESH_RECOVERY_S` of
the dependency's recovery, and lose no message: none in its plain run, none in the run where
its process is killed (SIGKILL) and restarted (every kill must have happened). The killed
run's recovery time and the naive consumer's are reported beside them, not enforced.

A check on a host-bound step (`brownout._lab.hostcpu`: the generator late, or a process
saturated) does not pass even when its value would: its ``status`` is ``host-bound`` and
``passed`` is false, so the lab fails. A value that fails is a failure whether or not the
step was host-bound (``host_bound`` lists why it was, for the reader to weigh).

In the payments scenario (opt-in, on PostgreSQL and Redis: `brownout._lab.payments`),
brownout applies no payment twice and leaves no unknown outcome unreconciled. In the database
scenario (opt-in, on PostgreSQL: `brownout._lab.database`), no query outlives its caller's
deadline on the server, the pool wait stays within its bound, goodput recovers after the
slowdown, and brownout serves at least what the unprotected front serves while it lasts.

The whole-system invariants a scenario file declares (`brownout._lab.system_checks`: queue,
retries, a class's goodput, the herd at the dependency) are judged on the demo's brownout
configurations and on a user's target alike.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .database import database_checks
from .payments import payments_checks
from .scenarios import DEMO_FILES, demo_file
from .server_view import compare_step
from .system_checks import system_checks

__all__ = [
    "Check",
    "backlog_checks",
    "backlog_targets",
    "demo_system_checks",
    "evaluate",
    "judged_runs",
    "scenario_checks",
    "step_host_bound",
    "targets",
]

Check = dict[str, Any]

OVERLOAD_LOADS = (2.0, 4.0, 10.0)
GOODPUT_FLOOR = 0.90
NO_FALSE_POSITIVE_LOAD = 0.8
MAX_FALSE_POSITIVES = 0.001
UNDERLOAD_GOODPUT = 0.99
INTERACTIVE_FLOOR = 0.99
HEALTH_P99_MS = 50.0
HERD_PEAK_FACTOR = 1.5
ADAPTIVE_GOODPUT_TARGET = 0.97
STORM_DEPENDENCY_FACTOR = 1.25
DEGRADED_GOODPUT_SHARE = 0.90
STARVED = "cpu-starved"
STARVED_RIVAL = "uvicorn-limit"
STARVED_SLACK = 0.02
"""Share of capacity brownout's goodput may trail uvicorn's by in the CPU-starved scenario:
two separate runs' 2-second counts are compared, and those vary from run to run; an adaptive
limit also spends some goodput re-measuring its no-load latency at half the limit every 5 s."""


def _check(
    run: dict[str, Any],
    step: dict[str, Any] | None,
    name: str,
    value: float | None,
    limit: float,
    passed: bool,
    unit: str,
    also_bound: list[str] | None = None,
) -> Check:
    """One check; ``also_bound``: host-bound reasons of another step the value depends on."""
    bound = step_host_bound(step) + (also_bound or [])
    return {
        "configuration": run["configuration"],
        "scenario": run["scenario"],
        "step": step["label"] if step else None,
        "check": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "passed": passed and not bound,
        "status": "failed" if not passed else "host-bound" if bound else "passed",
        "host_bound": bound,
        "generator_late": bool(step is not None and not step["valid"]),
    }


def step_host_bound(step: dict[str, Any] | None) -> list[str]:
    """Why ``step`` was host-bound ([] if it was not; results from before CPU was read only
    know the generator's lateness)."""
    if step is None:
        return []
    if "host_bound" in step:
        return list(step["host_bound"])
    return [] if step["valid"] else [f"generator late (p99 {step['lateness_p99_ms']} ms)"]


def _floor_check(run: dict[str, Any], step: dict[str, Any], capacity: float) -> Check:
    """Goodput >= `GOODPUT_FLOOR` of capacity (T1)."""
    goodput = step["steady"]["goodput_per_s"]
    floor = GOODPUT_FLOOR * capacity
    return _check(
        run,
        step,
        f"goodput >= {GOODPUT_FLOOR:.0%} of capacity",
        goodput,
        round(floor, 1),
        goodput >= floor,
        "req/s",
    )


def _p99_check(run: dict[str, Any], step: dict[str, Any], deadline_ms: float) -> Check:
    """Success p99 <= half the client deadline (O3)."""
    p99 = step["steady"]["success_p99_ms"]
    return _check(
        run,
        step,
        "success p99 <= half the deadline",
        p99,
        deadline_ms / 2,
        p99 is not None and p99 <= deadline_ms / 2,
        "ms",
    )


def _judged(lab: dict[str, Any]) -> set[str]:
    if lab.get("target"):
        return {c["name"] for c in lab["configurations"]}
    return {c["name"] for c in lab["configurations"] if c.get("brownout")}


def judged_runs(lab: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs whose configuration the invariants apply to (brownout's, or ``--target``)."""
    judged = _judged(lab)
    return [run for run in lab["runs"] if run["configuration"] in judged]


def evaluate(lab: dict[str, Any]) -> list[Check]:
    """Every invariant check of a lab result; the lab fails if any has ``passed`` false."""
    if lab.get("scenario_file"):  # its own invariants, not the demo's
        return scenario_checks(lab)
    checks = _http_checks(lab) + demo_system_checks(lab) if lab.get("calibration") else []
    return checks + backlog_checks(lab) + payments_checks(lab) + database_checks(lab)


def demo_system_checks(lab: dict[str, Any]) -> list[Check]:
    """The whole-system invariants the demo's scenario files declare, on the judged runs;
    the dependency's capacity is the demo backend's (slots / service time)."""
    settings = lab["settings"]
    slots, latency = settings.get("backend_concurrency"), settings.get("backend_latency")
    capacity = float(slots) / float(latency) if slots and latency else None
    out: list[Check] = []
    for run in judged_runs(lab):
        if run["scenario"] not in DEMO_FILES:
            continue
        invariants = [asdict(i) for i in demo_file(run["scenario"]).invariants]
        out += system_checks(invariants, [run], lambda c: [c] if c else [], capacity)
    return out


def _http_checks(lab: dict[str, Any]) -> list[Check]:
    capacity = float(lab["calibration"]["capacity"])
    deadline_ms = float(lab["settings"]["deadline"]) * 1000
    judged = _judged(lab)
    checks: list[Check] = []
    for run in lab["runs"]:
        if run["configuration"] not in judged:
            continue
        if run["scenario"] == "ramp":
            for step in run["steps"]:
                steady = step["steady"]
                if step["load"] in OVERLOAD_LOADS:
                    checks.append(_floor_check(run, step, capacity))
                if steady["success_p99_ms"] is not None or steady["offered"]:
                    # No success at all is a missing figure, not a passing one.
                    checks.append(_p99_check(run, step, deadline_ms))
                if step["load"] < 1.0 and steady["offered"]:
                    # The refusal check alone would pass a service that times out
                    # everything below capacity without refusing.
                    served = steady["ok"] / steady["offered"]
                    checks.append(
                        _check(
                            run,
                            step,
                            f"goodput >= {UNDERLOAD_GOODPUT:.0%} of offered below capacity",
                            round(served * 100, 2),
                            UNDERLOAD_GOODPUT * 100,
                            served >= UNDERLOAD_GOODPUT,
                            "%",
                        )
                    )
                if step["load"] == NO_FALSE_POSITIVE_LOAD:
                    offered = max(steady["offered"], 1)
                    share = steady["refused"] / offered
                    checks.append(
                        _check(
                            run,
                            step,
                            f"refusals <= {MAX_FALSE_POSITIVES:.1%} below capacity",
                            round(share * 100, 3),
                            MAX_FALSE_POSITIVES * 100,
                            share <= MAX_FALSE_POSITIVES,
                            "%",
                        )
                    )
        elif run["scenario"] == STARVED and run["configuration"] == "brownout-adaptive":
            checks += _starved_checks(lab, run, capacity, deadline_ms)
        elif run["scenario"] == "priority":
            for step in run["steps"]:
                interactive = step["classes"].get("interactive")
                if not interactive or not interactive["offered"]:
                    continue
                share = interactive["ok"] / interactive["offered"]
                checks.append(
                    _check(
                        run,
                        step,
                        f"interactive goodput >= {INTERACTIVE_FLOOR:.0%} of its demand",
                        round(share * 100, 2),
                        INTERACTIVE_FLOOR * 100,
                        share >= INTERACTIVE_FLOOR,
                        "%",
                    )
                )
    return checks


def targets(lab: dict[str, Any]) -> list[Check]:
    """The demo's stricter goals: adaptive at 10x, health under the flood (reported only)."""
    if lab.get("scenario_file"):
        return []
    out = _http_targets(lab) if lab.get("calibration") else []
    return out + backlog_targets(lab)


def _http_targets(lab: dict[str, Any]) -> list[Check]:
    capacity = float(lab["calibration"]["capacity"])
    service_ms = float(lab["calibration"]["service_time"]) * 1000
    out: list[Check] = []
    deadline_ms = float(lab["settings"]["deadline"]) * 1000
    for run in lab["runs"]:
        if run["configuration"] in _judged(lab):
            out += _outbound_targets(run, capacity)
        if run["scenario"] == STARVED and run["configuration"] == "brownout-fixed":
            out += _starved_checks(lab, run, capacity, deadline_ms)
        if run["scenario"] == "health" and run["configuration"] in _judged(lab):
            for step in run["steps"]:
                health = step["classes"].get("health")
                if not health or not health["offered"]:
                    continue
                answered = health["ok"] / health["offered"]
                out.append(
                    _check(
                        run,
                        step,
                        "health checks all answered",
                        round(answered * 100, 1),
                        100.0,
                        answered == 1.0,
                        "%",
                    )
                )
                p99 = health["success_p99_ms"]
                out.append(
                    _check(
                        run,
                        step,
                        f"health p99 <= {HEALTH_P99_MS:g} ms under the flood",
                        p99,
                        HEALTH_P99_MS,
                        p99 is not None and p99 <= HEALTH_P99_MS,
                        "ms",
                    )
                )
        if run["configuration"] != "brownout-adaptive" or run["scenario"] != "ramp":
            continue
        for step in run["steps"]:
            if step["load"] != 10.0:
                continue
            steady = step["steady"]
            goodput = steady["goodput_per_s"]
            p50 = steady["success_p50_ms"]
            p99 = steady["success_p99_ms"]
            out.append(
                _check(
                    run,
                    step,
                    f"goodput >= {ADAPTIVE_GOODPUT_TARGET:.0%} of capacity",
                    goodput,
                    round(ADAPTIVE_GOODPUT_TARGET * capacity, 1),
                    goodput >= ADAPTIVE_GOODPUT_TARGET * capacity,
                    "req/s",
                )
            )
            out.append(
                _check(
                    run,
                    step,
                    "success p50 <= 1.5x service time",
                    p50,
                    round(1.5 * service_ms, 2),
                    p50 is not None and p50 <= 1.5 * service_ms,
                    "ms",
                )
            )
            out.append(
                _check(
                    run,
                    step,
                    "success p99 <= 3x service time",
                    p99,
                    round(3 * service_ms, 2),
                    p99 is not None and p99 <= 3 * service_ms,
                    "ms",
                )
            )
    return out


def _starved_checks(
    lab: dict[str, Any], run: dict[str, Any], capacity: float, deadline_ms: float
) -> list[Check]:
    """The CPU-starved scenario's checks on one run, against uvicorn's run of the same lab."""
    rival = {
        s["label"]: s
        for r in lab["runs"]
        if r["scenario"] == STARVED and r["configuration"] == STARVED_RIVAL
        for s in r["steps"]
    }
    out: list[Check] = []
    for step in run["steps"]:
        steady = step["steady"]
        goodput = steady["goodput_per_s"]
        out.append(_floor_check(run, step, capacity))
        other = rival.get(step["label"])
        if other is not None:
            limit = other["steady"]["goodput_per_s"] - STARVED_SLACK * capacity
            out.append(
                _check(
                    run,
                    step,
                    f"goodput >= {STARVED_RIVAL}'s ({other['steady']['goodput_per_s']} req/s) "
                    f"less {STARVED_SLACK:.0%} of capacity",
                    goodput,
                    round(limit, 1),
                    goodput >= limit,
                    "req/s",
                    [f"{STARVED_RIVAL}: {why}" for why in step_host_bound(other)],
                )
            )
        out.append(_p99_check(run, step, deadline_ms))
    return out


def _outbound_targets(run: dict[str, Any], capacity: float) -> list[Check]:
    """Goals of the outbound and degraded scenarios on one brownout run (reported only)."""
    out: list[Check] = []
    steps = run["steps"]
    if run["scenario"] == "outage" and len(steps) >= 3:
        steady, returned = steps[0].get("dependency"), steps[-1].get("dependency")
        if steady and returned and steady["attempts_per_s"]:
            limit = round(HERD_PEAK_FACTOR * steady["attempts_per_s"], 1)
            out.append(
                _check(
                    run,
                    steps[-1],
                    f"dependency peak after it returns <= {HERD_PEAK_FACTOR:g}x steady",
                    returned["peak_1s"],
                    limit,
                    returned["peak_1s"] <= limit,
                    "req/s",
                )
            )
    elif run["scenario"] == "retry-storm":
        limit = round(STORM_DEPENDENCY_FACTOR * capacity, 1)
        for step in steps:
            dep = step.get("dependency")
            if dep:
                out.append(
                    _check(
                        run,
                        step,
                        f"at the dependency <= {STORM_DEPENDENCY_FACTOR:g}x capacity",
                        dep["attempts_per_s"],
                        limit,
                        dep["attempts_per_s"] <= limit,
                        "req/s",
                    )
                )
    elif run["scenario"] == "degraded" and len(steps) >= 2:
        slow = steps[1]["steady"]
        if slow["offered"]:
            share = slow["ok"] / slow["offered"]
            out.append(
                _check(
                    run,
                    steps[1],
                    f"goodput while the dependency is slow >= {DEGRADED_GOODPUT_SHARE:.0%}",
                    round(share * 100, 1),
                    DEGRADED_GOODPUT_SHARE * 100,
                    share >= DEGRADED_GOODPUT_SHARE,
                    "%",
                )
            )
    return out


FRESH_RECOVERY_S = 5.0
"""Backlog scenario: seconds after recovery within which brownout serves fresh work in time."""


def _backlog_check(
    run: dict[str, Any], name: str, value: float | None, limit: float, passed: bool, unit: str
) -> Check:
    return {
        "configuration": run["configuration"],
        "scenario": run["scenario"],
        "step": "after recovery",
        "check": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "passed": passed,
        "status": "passed" if passed else "failed",
        "host_bound": [],
        "generator_late": False,
    }


def _recovery_check(run: dict[str, Any]) -> Check:
    value = run["fresh_recovery_s"]
    return _backlog_check(
        run,
        f"fresh messages served within their deadline <= {FRESH_RECOVERY_S:g} s after recovery",
        value,
        FRESH_RECOVERY_S,
        value is not None and value <= FRESH_RECOVERY_S,
        "s",
    )


def backlog_checks(lab: dict[str, Any]) -> list[Check]:
    """The backlog scenario's invariants (brownout's consumer; see the module docstring)."""
    backlog = lab.get("backlog") or {}
    out: list[Check] = []
    for run in backlog.get("runs", []):
        if run["kind"] != "brownout":
            continue
        acc = run["accounting"]
        wanted = int(run.get("kills_planned", 0))
        if not wanted:
            out.append(_recovery_check(run))
        killed = f", {len(run['kills'])} of {wanted} SIGKILLs survived" if wanted else ""
        out.append(
            _backlog_check(
                run,
                f"messages lost (published = completed + parked + queued){killed}",
                acc["lost"],
                0,
                acc["lost"] == 0 and len(run["kills"]) == wanted,
                "messages",
            )
        )
    return out


def backlog_targets(lab: dict[str, Any]) -> list[Check]:
    """Reported beside the checks: the killed run's recovery time."""
    backlog = lab.get("backlog") or {}
    return [
        _recovery_check(run)
        for run in backlog.get("runs", [])
        if run["kind"] == "brownout" and run.get("kills_planned")
    ]


def _applies(kind: str, labels: list[str], step: dict[str, Any]) -> bool:
    if labels:
        return step["label"] in labels
    load = float(step["load"])
    if kind == "goodput":
        return load > 1.0
    if kind in ("served", "refusals"):
        return load < 1.0
    return True


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def scenario_checks(lab: dict[str, Any]) -> list[Check]:
    """The invariants a scenario file declares (``lab["scenario_file"]["invariants"]``).

    Defaults when an invariant names no ``steps``: ``goodput`` on steps above capacity
    (load > 1), ``served`` and ``refusals`` below it (load < 1), the others on every step.
    ``success_p99`` is checked per endpoint against its own deadline; ``class_goodput``
    sums the endpoints of the class.
    """
    spec = lab["scenario_file"]
    capacity = float(lab["calibration"]["capacity"])
    endpoints = {e["name"]: e for e in spec["endpoints"]}
    checks: list[Check] = []
    for run in lab["runs"]:
        for step in run["steps"]:
            failed = step.get("failed_actions") or []
            if failed:
                # The step ran without the faults it declares: what it measured is not it.
                checks.append(
                    _check(run, step, f"faults set ({'; '.join(failed)})", 0, 0, False, "")
                )
        for inv in spec["invariants"]:
            kind, limit, labels = inv["check"], float(inv["threshold"]), inv["steps"]
            for step in run["steps"]:
                if not _applies(kind, labels, step):
                    continue
                steady = step["steady"]
                if kind == "goodput":
                    goodput = steady["goodput_per_s"]
                    checks.append(
                        _check(
                            run,
                            step,
                            f"goodput >= {limit:.0%} of capacity",
                            goodput,
                            round(limit * capacity, 1),
                            goodput >= limit * capacity,
                            "req/s",
                        )
                    )
                elif kind == "served":
                    served = _share(steady["ok"], steady["offered"])
                    checks.append(
                        _check(
                            run,
                            step,
                            f"goodput >= {limit:.0%} of offered",
                            round(served * 100, 2),
                            limit * 100,
                            served >= limit,
                            "%",
                        )
                    )
                elif kind == "refusals":
                    refused = _share(steady["refused"], max(steady["offered"], 1))
                    checks.append(
                        _check(
                            run,
                            step,
                            f"refusals <= {limit:.1%} of offered",
                            round(refused * 100, 3),
                            limit * 100,
                            refused <= limit,
                            "%",
                        )
                    )
                elif kind == "success_p99":
                    for name, figures in step["classes"].items():
                        if not figures["offered"] or name not in endpoints:
                            continue
                        p99 = figures["success_p99_ms"]
                        bound = round(limit * float(endpoints[name]["deadline"]) * 1000, 2)
                        checks.append(
                            _check(
                                run,
                                step,
                                f"{name}: success p99 <= {limit:g}x its deadline",
                                p99,
                                bound,
                                p99 is not None and p99 <= bound,
                                "ms",
                            )
                        )
                elif kind == "class_goodput":
                    members = [
                        n for n, e in endpoints.items() if e["class"] == inv["traffic_class"]
                    ]
                    figures = [step["classes"][n] for n in members if n in step["classes"]]
                    offered = sum(f["offered"] for f in figures)
                    if not offered:
                        continue
                    served = _share(sum(f["ok"] for f in figures), offered)
                    checks.append(
                        _check(
                            run,
                            step,
                            f"{inv['traffic_class']} goodput >= {limit:.0%} of its demand",
                            round(served * 100, 2),
                            limit * 100,
                            served >= limit,
                            "%",
                        )
                    )
                elif kind == "server_agrees":
                    checks += _agreement_checks(run, step, limit)

    def class_members(name: str | None) -> list[str]:
        # A class's endpoints, or the one endpoint a system check may name instead.
        named = [n for n, e in endpoints.items() if name is not None and e["class"] == name]
        return named or ([name] if name in endpoints else [])

    return checks + system_checks(spec["invariants"], lab["runs"], class_members)


def _agreement_checks(run: dict[str, Any], step: dict[str, Any], limit: float) -> list[Check]:
    """The server's count of each figure against the client's (`compare_step`); a step
    without the server's figures fails (the metrics could not be read)."""
    rows = compare_step(step, limit)
    if not rows:
        return [_check(run, step, "server's view read", None, 1, False, "scrapes")]
    return [
        _check(
            run,
            step,
            f"server agrees on {r['figure']} within {limit:.0%} of the client's count",
            r["server"],
            r["client"],
            r["agrees"],
            "requests",
        )
        for r in rows
    ]
