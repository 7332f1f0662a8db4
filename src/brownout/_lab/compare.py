"""``brownout lab --compare OLD.json``: this run against an older report.json, step by step.

Per (configuration, scenario, step) present in either report: goodput and success p99 in
both, and the invariant checks that passed before and do not now. A step regressed when such
a check exists, when goodput fell by more than `GOODPUT_DROP` of its old value, or when
success p99 rose by more than `P99_RISE` of its old value. Only reported: the lab's exit
status stays what its own checks make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .verdict import evaluate

__all__ = [
    "COMPARE_COLUMNS",
    "GOODPUT_DROP",
    "P99_RISE",
    "StepDelta",
    "compare_markdown",
    "compare_reports",
    "compare_rows",
]

GOODPUT_DROP = 0.05
P99_RISE = 0.20

COMPARE_COLUMNS = (
    "configuration",
    "scenario",
    "step",
    "goodput/s old -> new",
    "ok p99 ms old -> new",
    "passed before, not now",
)


@dataclass(frozen=True)
class StepDelta:
    """One (configuration, scenario, step) in both reports; ``None``: not in that report.
    ``newly_failed``: checks that passed in the old report and not in the new one (named
    with "(host-bound)" when the new value held but on a host-bound step)."""

    configuration: str
    scenario: str
    step: str | None
    goodput_old: float | None
    goodput_new: float | None
    p99_old: float | None
    p99_new: float | None
    newly_failed: tuple[str, ...]

    @property
    def goodput_delta(self) -> float | None:
        if self.goodput_old is None or self.goodput_new is None:
            return None
        return self.goodput_new - self.goodput_old

    @property
    def p99_delta(self) -> float | None:
        if self.p99_old is None or self.p99_new is None:
            return None
        return self.p99_new - self.p99_old

    @property
    def regressed(self) -> bool:
        fell = self.goodput_delta is not None and self.goodput_old is not None
        rose = self.p99_delta is not None and self.p99_old is not None
        return bool(
            self.newly_failed
            or (fell and -(self.goodput_delta or 0.0) > GOODPUT_DROP * (self.goodput_old or 0.0))
            or (rose and (self.p99_delta or 0.0) > P99_RISE * (self.p99_old or 0.0))
        )


Key = tuple[str, str, str | None]


def _steps(report: dict[str, Any]) -> dict[Key, tuple[float | None, float | None]]:
    out: dict[Key, tuple[float | None, float | None]] = {}
    for run in report.get("runs") or []:
        for step in run["steps"]:
            s = step["steady"]
            key = (run["configuration"], run["scenario"], step["label"])
            out[key] = (s.get("goodput_per_s"), s.get("success_p99_ms"))
    return out


def _statuses(report: dict[str, Any]) -> dict[Key, dict[str, str]]:
    out: dict[Key, dict[str, str]] = {}
    for c in evaluate(report):
        key = (c["configuration"], c["scenario"], c["step"])
        status = c.get("status") or ("passed" if c["passed"] else "failed")
        out.setdefault(key, {})[c["check"]] = status
    return out


def compare_reports(old: dict[str, Any], new: dict[str, Any]) -> list[StepDelta]:
    """The deltas of every (configuration, scenario, step) in either report, new's order
    first; see `StepDelta.regressed`."""
    old_steps, new_steps = _steps(old), _steps(new)
    old_checks, new_checks = _statuses(old), _statuses(new)
    keys = list(dict.fromkeys([*new_steps, *new_checks, *old_steps, *old_checks]))
    deltas = []
    for key in keys:
        before = old_checks.get(key, {})
        now = new_checks.get(key, {})
        newly = tuple(
            name if now[name] == "failed" else f"{name} ({now[name]})"
            for name, status in before.items()
            if status == "passed" and now.get(name, "passed") != "passed"
        )
        g_old, p_old = old_steps.get(key, (None, None))
        g_new, p_new = new_steps.get(key, (None, None))
        deltas.append(StepDelta(*key, g_old, g_new, p_old, p_new, newly))
    return deltas


def _pair(old: float | None, new: float | None, digits: int) -> str:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    text = f"{cell(old)} -> {cell(new)}"
    if old is not None and new is not None:
        text += f" ({new - old:+,.{digits}f})"
    return text


def compare_rows(deltas: list[StepDelta]) -> list[list[str]]:
    """The regressed deltas as table rows, in `COMPARE_COLUMNS` order."""
    return [
        [
            d.configuration,
            d.scenario,
            d.step or "-",
            _pair(d.goodput_old, d.goodput_new, 0),
            _pair(d.p99_old, d.p99_new, 1),
            "; ".join(d.newly_failed) or "-",
        ]
        for d in deltas
        if d.regressed
    ]


def compare_markdown(deltas: list[StepDelta], old_name: str) -> str:
    """compare.md: the regressed steps against ``old_name``, or that none regressed."""
    rows = compare_rows(deltas)
    out = [
        f"# Compared with {old_name}",
        "",
        f"{len(deltas)} steps compared; regressed: an invariant that passed before fails now, "
        f"goodput down more than {GOODPUT_DROP:.0%} or success p99 up more than "
        f"{P99_RISE:.0%}.",
        "",
    ]
    if not rows:
        return "\n".join([*out, "No step regressed.", ""])
    out.append("| " + " | ".join(COMPARE_COLUMNS) + " |")
    out.append("|" + "---|" * len(COMPARE_COLUMNS))
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join([*out, ""])
