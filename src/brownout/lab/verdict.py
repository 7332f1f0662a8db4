"""Pass/fail: the invariants a brownout-protected service must hold in the lab.

Checked on every configuration protected by brownout (or on the user's ``--target``):

- goodput at 2x, 4x and 10x of capacity >= 90% of capacity (T1);
- success p99 <= half the client deadline at every ramp step (useful successes, O3);
- at 0.8x, refusals <= 0.1% of offered (no false-positive shedding, S8);
- in the priority mix, interactive goodput >= 99% of interactive demand (S3).

`targets` adds the demo's stricter goals (adaptive: >= 95% of capacity at 10x, success p50
<= 1.5x and p99 <= 3x the dependency's service time; every health check answered within
50 ms under the 10x flood, S7). They are reported, not enforced.
A check measured while the generator was late is flagged ``generator_late``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Check", "evaluate", "targets"]

Check = dict[str, Any]

OVERLOAD_LOADS = (2.0, 4.0, 10.0)
GOODPUT_FLOOR = 0.90
NO_FALSE_POSITIVE_LOAD = 0.8
MAX_FALSE_POSITIVES = 0.001
INTERACTIVE_FLOOR = 0.99
HEALTH_P99_MS = 50.0


def _check(
    run: dict[str, Any],
    step: dict[str, Any] | None,
    name: str,
    value: float | None,
    limit: float,
    passed: bool,
    unit: str,
) -> Check:
    return {
        "configuration": run["configuration"],
        "scenario": run["scenario"],
        "step": step["label"] if step else None,
        "check": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "passed": passed,
        "generator_late": bool(step is not None and not step["valid"]),
    }


def _judged(lab: dict[str, Any]) -> set[str]:
    if lab.get("target"):
        return {c["name"] for c in lab["configurations"]}
    return {c["name"] for c in lab["configurations"] if c.get("brownout")}


def evaluate(lab: dict[str, Any]) -> list[Check]:
    """Every invariant check of a lab result; the lab fails if any has ``passed`` false."""
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
                    goodput = steady["goodput_per_s"]
                    floor = GOODPUT_FLOOR * capacity
                    checks.append(
                        _check(
                            run,
                            step,
                            f"goodput >= {GOODPUT_FLOOR:.0%} of capacity",
                            goodput,
                            round(floor, 1),
                            goodput >= floor,
                            "req/s",
                        )
                    )
                p99 = steady["success_p99_ms"]
                if p99 is not None:
                    checks.append(
                        _check(
                            run,
                            step,
                            "success p99 <= half the deadline",
                            p99,
                            deadline_ms / 2,
                            p99 <= deadline_ms / 2,
                            "ms",
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
    capacity = float(lab["calibration"]["capacity"])
    service_ms = float(lab["calibration"]["service_time"]) * 1000
    out: list[Check] = []
    for run in lab["runs"]:
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
                    "goodput >= 95% of capacity",
                    goodput,
                    round(0.95 * capacity, 1),
                    goodput >= 0.95 * capacity,
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
