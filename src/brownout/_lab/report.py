"""The lab's report: a table per scenario (console, Markdown, HTML), PNG plots and raw JSON.

Everything renders from the raw result dict of `brownout._lab.runner.run_lab`, so a report
can be rebuilt from ``lab-report/report.json`` alone. Success latency and refusal latency sit
in separate columns (O3); "expired" counts requests whose deadline ran out anywhere (client
timeouts, sent or not, 2xx answers that came too late, and 504s).
"""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .ci_report import environment_lines, junit_xml, steps_csv
from .database import (
    DATABASE_COLUMNS,
    DATABASE_SECONDS_COLUMNS,
    DATABASE_TITLE,
    database_description,
    database_rows,
    database_runs,
    database_seconds,
    plot_database,
)
from .payments import (
    PAYMENTS_COLUMNS,
    PAYMENTS_TITLE,
    payments_description,
    payments_rows,
)
from .payments import payments_runs as _payments_runs
from .server_view import SERVER_COLUMNS, server_notes, server_rows
from .system_checks import NOT_MEASURED
from .timeline_plot import (
    declutter_ticks,
    legend_outside,
    load_axis,
    load_label,
    log_ms_axis,
    plot_timeline,
)
from .verdict import Check, evaluate, step_host_bound, targets

__all__ = [
    "BACKLOG_COLUMNS",
    "COLUMNS",
    "OUTBOUND_COLUMNS",
    "backlog_rows",
    "backlog_seconds",
    "check_line",
    "cpu_cell",
    "host_cell",
    "markdown",
    "outbound_rows",
    "rich_table",
    "scenario_rows",
    "write_markdown",
    "write_report",
]

COLUMNS = (
    "configuration",
    "step",
    "offered/s",
    "goodput/s",
    "% cap",
    "shed (reasons)",
    "expired",
    "ok p50/p99 ms",
    "refusal p50 ms",
    "by class: goodput/offered per s",
    "conns opened",
    "gen late p99 ms",
    "CPU front/dep/gen % (hog; core)",
    "host",
)


OUTBOUND_COLUMNS = (
    "configuration",
    "step",
    "originals/s",
    "goodput/s",
    "client retries/s (ok/s, withheld)",
    "at dependency/s",
    "amplification",
    "dependency peak 1 s",
    "degraded goodput/s (responses/s)",
)
"""The outbound table: what reached the dependency, per original request (T3, R1, G3).

``client retries/s``: retried attempts the clients sent (and how many of them succeeded
in time; ``withheld``: retries a budgeted client chose not to send). ``at dependency/s``:
requests that reached the dependency in steady state, retries of every layer included;
``amplification`` is that per original request offered; ``dependency peak 1 s``: the
busiest one-second window of the whole step. ``degraded goodput/s``: successes marked
``brownout-degraded`` (all responses so marked, per second, in brackets)."""


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _reasons(steady: dict[str, Any]) -> str:
    parts = [f"{n} {k}" for k, n in steady["shed_reasons"].items()]
    other = steady["other_status"] + steady["errors"]
    if other:
        parts.append(f"{other} other/errors")
    return ", ".join(parts) if parts else "0"


def _expired(steady: dict[str, Any]) -> str:
    # A 2xx after the deadline is expired work the server did anyway: named apart.
    late = steady.get("ok_late", 0)
    return f"{steady['expired']:,}" + (f" ({late:,} late 2xx)" if late else "")


def _classes(step: dict[str, Any]) -> str:
    out = []
    for name, c in step["classes"].items():
        text = f"{name} {c['goodput_per_s']:.0f}/{c['offered_per_s']:.0f}"
        if name == "health" and c["success_p99_ms"] is not None:
            text += f" (p99 {c['success_p99_ms']:.1f} ms)"
        out.append(text)
    return "; ".join(out)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def cpu_cell(step: dict[str, Any]) -> str:
    """CPU shares over the steady state, % of one core: front/dependency/generator, then the
    hog's and the front core's busy share in brackets ("-": not measured)."""
    cpu = step.get("cpu")
    if not cpu:
        return "-"
    text = "/".join(_pct(cpu.get(role)) for role in ("front", "dependency", "generator"))
    extra = [f"hog {_pct(cpu['hog'])}"] if "hog" in cpu else []
    if cpu.get("core") is not None:
        extra.append(f"core {_pct(cpu['core'])}")
    return text + (f" ({'; '.join(extra)})" if extra else "")


def host_cell(step: dict[str, Any]) -> str:
    """ "host-bound: why" or "ok" (see `brownout._lab.hostcpu`)."""
    bound = step_host_bound(step)
    return f"host-bound: {'; '.join(bound)}" if bound else "ok"


def _titles(lab: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["title"] for c in lab["configurations"]}


def scenario_rows(lab: dict[str, Any], scenario: str) -> list[list[str]]:
    """The table rows of one scenario, one per (configuration, step), in `COLUMNS` order."""
    capacity = float(lab["calibration"]["capacity"]) or 1.0
    titles = _titles(lab)
    rows: list[list[str]] = []
    for run in lab["runs"]:
        if run["scenario"] != scenario:
            continue
        name = titles.get(run["configuration"], run["configuration"])
        if run.get("attempts", 1) > 1:
            name += f" (measured {run['attempts']}x: host-bound)"
        for step in run["steps"]:
            s = step["steady"]
            rows.append(
                [
                    name,
                    step["label"],
                    _num(s["offered_per_s"]),
                    _num(s["goodput_per_s"]),
                    f"{100 * s['goodput_per_s'] / capacity:.0f}%",
                    f"{s['refused']:,} ({_reasons(s)})",
                    _expired(s),
                    f"{_num(s['success_p50_ms'], 1)} / {_num(s['success_p99_ms'], 1)}",
                    _num(s["refusal_p50_ms"], 1),
                    _classes(step),
                    f"{step['connections_opened']:,}",
                    f"{step['lateness_p99_ms']:.1f}" + ("" if step["valid"] else " (late!)"),
                    cpu_cell(step),
                    host_cell(step),
                ]
            )
    return rows


def outbound_rows(lab: dict[str, Any], scenario: str) -> list[list[str]]:
    """The outbound table of one scenario, in `OUTBOUND_COLUMNS` order."""
    titles = _titles(lab)
    rows: list[list[str]] = []
    for run in lab["runs"]:
        if run["scenario"] != scenario:
            continue
        name = titles.get(run["configuration"], run["configuration"])
        for step in run["steps"]:
            s = step["steady"]
            r = step.get("retries") or {}
            dep = step.get("dependency") or {}
            amp = dep.get("amplification")
            rows.append(
                [
                    name,
                    step["label"],
                    _num(s["offered_per_s"]),
                    _num(s["goodput_per_s"]),
                    f"{_num(r.get('offered_per_s'))} ({_num(r.get('goodput_per_s'))}, "
                    f"{step.get('retries_withheld', 0):,})",
                    _num(dep.get("attempts_per_s")),
                    "-" if amp is None else f"{amp:.2f}x",
                    _num(dep.get("peak_1s")),
                    f"{_num(s.get('degraded_goodput_per_s'))} "
                    f"({_num(s.get('degraded_per_s', 0.0))})",
                ]
            )
    return rows


def _scenarios(lab: dict[str, Any]) -> list[dict[str, Any]]:
    present = {r["scenario"] for r in lab["runs"]}
    return [s for s in lab["scenarios"] if s["name"] in present]


BACKLOG_COLUMNS = (
    "consumer",
    "published",
    "in time/s after recovery",
    "late/s after recovery",
    "fresh in time again after",
    "completed in time / late",
    "parked (by reason)",
    "still queued",
    "lost",
    "duplicates",
    "SIGKILLs after recovery (messages held; restarted in)",
)
"""The backlog scenario's table: one row per consumer run (`brownout._lab.backlog`)."""

BACKLOG_TITLE = "Backlog after an outage (Redis Streams)"
SERVER_TITLE = "the server's view (brownout's metrics) beside the client's"


def _backlog_runs(lab: dict[str, Any]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = (lab.get("backlog") or {}).get("runs", [])
    return runs


def backlog_description(lab: dict[str, Any]) -> str:
    """What the backlog scenario did, with its settings."""
    st = (lab.get("backlog") or {}).get("settings")
    if not st:
        return ""
    capacity = st["dependency_concurrency"] / st["dependency_latency"]
    kills = ", ".join(f"+{k:g} s" for k in st["kills"])
    return (
        f"A producer publishes {st['rate']:g} messages/s (open loop) to a Redis stream, each "
        f"valid for {st['ttl']:g} s; the consumer's dependency serves "
        f"{st['dependency_concurrency']} calls at a time of "
        f"{st['dependency_latency'] * 1000:g} ms ({capacity:.0f} messages/s) and is down for "
        f"{st['outage']:g} s after {st['before']:g} s; then {st['after']:g} s after recovery. "
        "naive: redis-py, FIFO, a failure requeued at once, no deadline check; brownout: "
        "redis_streams.Consumer with the default MessagePolicy; brownout-killed: the same, "
        f"outage {st['outage'] * st['killed_scale']:g} s, its process SIGKILLed at {kills} "
        "after recovery and restarted. 'fresh in time again after': seconds from recovery "
        f"until messages published after it are served within their deadline (>= 95% of "
        "each second's) for good."
    )


def backlog_rows(lab: dict[str, Any]) -> list[list[str]]:
    """One row per run of the backlog scenario."""
    rows = []
    for run in _backlog_runs(lab):
        acc = run["accounting"]
        reasons = ", ".join(f"{n} {r}" for r, n in run["parked_by_reason"].items())
        fresh = run["fresh_recovery_s"]
        kills = ", ".join(
            f"{k['at'] - run['recovered_at']:+.1f} s ({k.get('held', '?')} held; "
            f"{k['restarted_in']:.1f} s)"
            for k in run["kills"]
        )
        rows.append(
            [
                run["configuration"],
                str(acc["published"]),
                _num(run["after_in_time_per_s"], 1),
                _num(run["after_late_per_s"], 1),
                f"{fresh:.1f} s" if fresh is not None else f"> {run['after']:g} s (not in the run)",
                f"{acc['completed_in_time']} / {acc['completed_late']}",
                f"{acc['parked']} ({reasons})" if reasons else str(acc["parked"]),
                str(acc["queued"]),
                str(acc["lost"]),
                str(acc["duplicates"]),
                kills or "-",
            ]
        )
    return rows


def backlog_seconds(lab: dict[str, Any], before: int = 2) -> tuple[list[str], list[list[str]]]:
    """Per-second figures around and after recovery, naive vs brownout: (columns, rows);
    each cell is in-time/late completions (parked) and the queue's depth."""
    runs = [r for r in _backlog_runs(lab) if not r.get("kills_planned")]
    if not runs:
        return [], []
    cols = ["s after recovery"] + [
        f"{r['configuration']}: in time / late (parked), depth" for r in runs
    ]
    start = int(runs[0]["recovered_at"]) - before
    rows = []
    for second in range(start, max(len(r["timeline"]) for r in runs)):
        row = [f"{second - runs[0]['recovered_at']:+g}"]
        for r in runs:
            if second < len(r["timeline"]):
                b = r["timeline"][second]
                row.append(f"{b['in_time']} / {b['late']} ({b['parked']}), {b['depth']}")
            else:
                row.append("-")
        rows.append(row)
    return cols, rows


def _database_markdown(lab: dict[str, Any]) -> list[str]:
    """The database scenario's section: the summary table, then the per-second table."""
    out = [f"## {DATABASE_TITLE}", "", database_description(lab), ""]
    for cols, rows in (
        (DATABASE_COLUMNS, database_rows(lab)),
        (DATABASE_SECONDS_COLUMNS, database_seconds(lab)),
    ):
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        out += ["| " + " | ".join(row) + " |" for row in rows]
        out.append("")
    return out


def _backlog_markdown(lab: dict[str, Any]) -> list[str]:
    if not (lab.get("backlog") or {}).get("runs"):
        return []
    out = [f"## {BACKLOG_TITLE}", "", backlog_description(lab), ""]
    out.append("| " + " | ".join(BACKLOG_COLUMNS) + " |")
    out.append("|" + "---|" * len(BACKLOG_COLUMNS))
    out += ["| " + " | ".join(row) + " |" for row in backlog_rows(lab)]
    cols, rows = backlog_seconds(lab)
    if rows:
        out += ["", "Per second (completions by the second they completed in):", ""]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        out += ["| " + " | ".join(row) + " |" for row in rows]
    out.append("")
    return out


_CAPACITY_SOURCES = {
    "calibration": "closed-loop calibration",
    "knee": "the knee: the highest offered rate kept up with",
    "declared": "declared in the scenario file",
}


def _service_time(cal: dict[str, Any]) -> str:
    """The demo dependency's service time, when calibration measured one."""
    if cal.get("source", "calibration") != "calibration":
        return ""
    return f"service time {cal['service_time'] * 1000:.1f} ms, "


def rich_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Any:
    """A console table with folding columns, as every lab table is printed."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_tables(lab: dict[str, Any], console: Any) -> None:
    """Print one rich table per scenario, then the verdict."""
    cal = lab["calibration"]
    if cal:
        console.print(
            f"[bold]capacity[/] {cal['capacity']:.0f} req/s "
            f"({_CAPACITY_SOURCES[cal.get('source', 'calibration')]}), "
            f"{_service_time(cal)}client deadline {lab['settings']['deadline'] * 1000:.0f} ms"
        )
    if _backlog_runs(lab):
        title = f"{BACKLOG_TITLE}: {backlog_description(lab)}"
        console.print(rich_table(title, BACKLOG_COLUMNS, backlog_rows(lab)))
    if _payments_runs(lab):
        title = f"{PAYMENTS_TITLE}: {payments_description(lab)}"
        console.print(rich_table(title, PAYMENTS_COLUMNS, payments_rows(lab)))
    if database_runs(lab):
        title = f"{DATABASE_TITLE}: {database_description(lab)}"
        console.print(rich_table(title, DATABASE_COLUMNS, database_rows(lab)))
    for sc in _scenarios(lab):
        title = f"{sc['title']}: {sc['description']}"
        console.print(rich_table(title, COLUMNS, scenario_rows(lab, sc["name"])))
        if sc.get("outbound"):
            title = f"{sc['title']}: at the dependency"
            console.print(rich_table(title, OUTBOUND_COLUMNS, outbound_rows(lab, sc["name"])))
        if rows := server_rows(lab, sc["name"]):
            console.print(rich_table(f"{sc['title']}: {SERVER_TITLE}", SERVER_COLUMNS, rows))
    for note in server_notes(lab):
        console.print(f"[yellow]server's view:[/] {note}", highlight=False)
    checks = evaluate(lab)
    colour = {"passed": "green", "failed": "red", "host-bound": "yellow", NOT_MEASURED: "yellow"}
    for c in checks:
        console.print(check_line(c, colour[_status(c)]), markup=True, highlight=False)
    for c in targets(lab):
        console.print(check_line(c, colour[_status(c)], target=True), highlight=False)
    bound = [c for c in checks if _status(c) == "host-bound"]
    if bound:
        console.print(
            f"[yellow]{len(bound)} check(s) host-bound:[/] their values passed, but on a step "
            "the host bounded; they are not counted as passes"
        )


def _status(check: Check) -> str:
    status: str = check.get("status") or ("passed" if check["passed"] else "failed")
    return status


def check_line(check: Check, colour: str | None = None, *, target: bool = False) -> str:
    """One verdict line: PASS, FAIL or HOST-BOUND (targets: met, missed, host-bound), the
    figures, and why the step was host-bound; ``colour``: rich markup for the mark."""
    status = _status(check)
    if target:
        mark = {"passed": "met", "failed": "missed", "host-bound": "host-bound"}.get(status, status)
    else:
        mark = {"passed": "PASS", "failed": "FAIL", "host-bound": "HOST-BOUND"}.get(
            status, status.upper()
        )
    if colour:
        mark = f"[{colour}]{mark}[/]"
    elif status == "failed" and not target:
        mark = f"**{mark}**"
    bound = check.get("host_bound") or (["generator late"] if check.get("generator_late") else [])
    why = f" (host-bound: {'; '.join(bound)})" if bound else ""
    if check.get("note"):
        why += f" ({check['note']})"
    where = f"{check['configuration']} / {check['scenario']} / {check['step']}"
    limit = f"(target {check['limit']})" if target else f"(limit {check['limit']})"
    head = f"target {mark}: " if target else f"{mark} "
    return f"{head}{where}: {check['check']}: {check['value']} {check['unit']} {limit}{why}"


# -- plots ---------------------------------------------------------------------------------------


def _mark_host_bound(ax: Any, runs: list[dict[str, Any]], figure: str) -> None:
    """Circle, in red, the points of host-bound steps (see the table for why)."""
    points = [
        (s["steady"]["offered_per_s"], s["steady"][figure])
        for r in runs
        for s in r["steps"]
        if step_host_bound(s) and s["steady"][figure] is not None
    ]
    if points:
        ax.scatter(
            [p[0] for p in points],
            [p[1] for p in points],
            s=120,
            facecolors="none",
            edgecolors="red",
            zorder=5,
            label="host-bound step",
        )


def _plot(lab: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = _titles(lab)
    written: list[str] = []
    if _backlog_runs(lab):
        written.append(_plot_backlog(lab, out, plt))
    if database_runs(lab):
        written.append(plot_database(lab, out, plt))
    if not lab["calibration"]:
        return written
    capacity = float(lab["calibration"]["capacity"])
    ramp = [r for r in lab["runs"] if r["scenario"] == "ramp"]
    if ramp:
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        top = max(s["steady"]["offered_per_s"] for r in ramp for s in r["steps"])
        ax.plot([0, top], [0, top], color="0.85", linestyle=":", label="offered")
        ax.axhline(capacity, color="0.6", linestyle="--", label="capacity")
        for run in ramp:
            xs = [s["steady"]["offered_per_s"] for s in run["steps"]]
            ys = [s["steady"]["goodput_per_s"] for s in run["steps"]]
            ax.plot(xs, ys, marker="o", label=titles.get(run["configuration"]))
        _mark_host_bound(ax, ramp, "goodput_per_s")
        ax.set_xscale("log")
        _ramp_load_axis(ax, ramp, capacity)
        ax.set_ylabel("goodput (2xx within deadline, requests/s)")
        ax.set_ylim(0, capacity * 1.3)
        ax.set_title("Goodput vs offered load")
        legend_outside(ax, fontsize=8)
        fig.tight_layout()
        declutter_ticks(fig, ax)
        fig.savefig(out / "goodput.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append("goodput.png")

        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        for run in ramp:
            pts = [
                (s["steady"]["offered_per_s"], s["steady"]["success_p50_ms"], s)
                for s in run["steps"]
                if s["steady"]["success_p50_ms"] is not None
            ]
            if not pts:
                continue
            (line,) = ax.plot(
                [p[0] for p in pts],
                [p[2]["steady"]["success_p99_ms"] for p in pts],
                marker="o",
                label=f"{titles.get(run['configuration'])} p99",
            )
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=".",
                linestyle="--",
                color=line.get_color(),
                label=f"{titles.get(run['configuration'])} p50",
            )
        _mark_host_bound(ax, ramp, "success_p99_ms")
        ax.axhline(
            lab["settings"]["deadline"] * 1000, color="0.6", linestyle="--", label="deadline"
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        log_ms_axis(ax)
        _ramp_load_axis(ax, ramp, capacity)
        ax.set_ylabel("success latency (ms, log)")
        ax.set_title("Success latency vs offered load (refusals excluded)")
        legend_outside(ax)
        fig.tight_layout()
        declutter_ticks(fig, ax)
        fig.savefig(out / "latency.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append("latency.png")

    deadline_ms = float(lab["settings"]["deadline"]) * 1000
    for sc in _scenarios(lab):
        runs = [r for r in lab["runs"] if r["scenario"] == sc["name"] and "timeline" in r]
        if not runs:
            continue
        written.append(
            plot_timeline(sc, runs, titles, capacity, deadline_ms, out, plt, step_host_bound)
        )
    return written


def _ramp_load_axis(ax: Any, ramp: list[dict[str, Any]], capacity: float) -> None:
    """The ramp's x axis (offered requests/s, log) ticked at each step's load multiple."""
    loads = sorted({float(s["load"]) for r in ramp for s in r["steps"]})
    load_axis(
        ax,
        [load * capacity for load in loads],
        [load_label(load) for load in loads],
        f"offered load (multiple of capacity {capacity:.0f} requests/s, log)",
    )


def _plot_backlog(lab: dict[str, Any], out: Path, plt: Any) -> str:
    """Completions in time and late per second, and the queue's depth, per consumer."""
    runs = [r for r in _backlog_runs(lab) if not r.get("kills_planned")]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        xs = [i - run["recovered_at"] for i in range(len(run["timeline"]))]
        (line,) = top.step(
            xs,
            [b["in_time"] for b in run["timeline"]],
            where="post",
            label=f"{run['configuration']}: in time",
        )
        top.step(
            xs,
            [b["late"] for b in run["timeline"]],
            where="post",
            linestyle=":",
            color=line.get_color(),
            label=f"{run['configuration']}: late",
        )
        bottom.step(
            xs,
            [b["depth"] for b in run["timeline"]],
            where="post",
            color=line.get_color(),
            label=run["configuration"],
        )
    if runs:
        outage = runs[0]["outage"]
        for ax in (top, bottom):
            ax.axvspan(-outage, 0, color="0.92", label="dependency down" if ax is top else None)
    top.set_ylabel("completions per second")
    top.set_title("Backlog after an outage: queue goodput (solid) and late work (dotted)")
    top.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    bottom.set_ylabel("messages queued")
    bottom.set_xlabel("seconds after the dependency recovered")
    bottom.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    name = "timeline-backlog.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


# -- Markdown and HTML ---------------------------------------------------------------------------


def _verdict_lines(lab: dict[str, Any]) -> list[str]:
    lines = [f"- {check_line(c)}" for c in evaluate(lab)]
    lines += [f"- {check_line(c, target=True)}" for c in targets(lab)]
    lines += [f"- server's view: {note}" for note in server_notes(lab)]
    return lines


PREAMBLE = """\
`brownout lab` proves, on your own machine and with no setup, that a service protected by
brownout keeps its goodput (responses that arrive while the caller still wants them) at
capacity past the breaking point, while the same service unprotected collapses (T1, T2, T4).

```console
$ python3 dev.py lab                  # creates .venv, then runs `brownout lab`
$ brownout lab --quick                # under a minute: ramp + priority mix
$ brownout lab --target http://127.0.0.1:8000/api/items --health-path /healthz
$ brownout lab --scenario examples/lab-scenario.toml   # your own traffic, below
```

**The demo system** is real: a dependency (uvicorn, 8 concurrent x 40 ms, about 200 requests/s,
queueing beyond that; sized so that a 10x flood fits a 2-core machine with a neighbour on the
front's core, see [benchmarks](benchmarks.md#the-front-short-of-cpu-issue-22)) and a front
service (uvicorn + Starlette) whose endpoints call it through a pooled aiohttp client, passing
the remaining budget. Both run in their own processes, pinned to a different core than the load
generator where the machine allows.
The same front runs in four configurations, side by side, each on fresh processes per
scenario:

- **unprotected**: the app as most services ship;
- **uvicorn --limit-concurrency**: uvicorn's own guard, which counts connections and answers
  503 by *closing* the connection (watch "conns opened");
- **brownout FixedLimit**: brownout's ASGI middleware with a fixed limit chosen by load test;
- **brownout Gradient2Limit()**: the same with an adaptive limit and library defaults (no
  number tuned for this demo).

The only difference between unprotected and protected is `brownout._lab.protect`: a
`Bulkhead` in an `EdgePolicy` given to `BrownoutMiddleware`, public API only.

**The sync front** (`sync-unprotected` on the ramp, `sync-brownout` on the ramp and the health
flood): the same endpoints as a Flask app under gunicorn (one gthread worker of 32 threads)
calling the dependency through a pooled `requests` session, unprotected as a sync service
ships today; protected, `brownout._lab.protect.protect_wsgi`: brownout's Flask middleware and
a `ThreadBulkhead` with the fixed configuration's limit and queue, passing the remaining
budget to the dependency. Its table: [the lab's sync
configuration](wsgi.md#the-labs-sync-configuration).

**The load generator** is open loop (arrivals on a schedule that never waits for responses),
runs in its own process on raw uvloop transports with HTTP/1.1 keep-alive, measures latency
from each request's *scheduled* time (no coordinated omission), abandons a request at its
client deadline (closing the connection, as an HTTP client with a timeout does) and counts
every offered request into exactly one outcome. It measures its own lateness: a step where
its p99 lateness exceeds 5 ms is host-bound (below).
Capacity is measured first, closed loop, by doubling concurrency until throughput stops
growing; loads are multiples of it.

**Pass/fail** (the exit status, so CI can run it): for brownout configurations (or your
`--target`), goodput at 2x, 4x and 10x >= 90% of capacity; success p99 <= half the client
deadline; at 0.8x, refusals <= 0.1% (no false positives, S8); below capacity (0.5x and 0.8x),
goodput >= 99% of offered; in the priority mix, interactive goodput >= 99% of interactive
demand (S3). Reported as targets, not enforced: brownout-adaptive at 10x >= 97% of capacity,
success p50 <= 1.5x and p99 <= 3x the dependency's service time; health checks under the
10x flood all answered, p99 <= 50 ms. `lab-report/` gets the plots, the raw
JSON, an HTML page and this Markdown. The plots: goodput and success latency against offered
load on the ramp, and per scenario a timeline in three panels over its schedule: requests/s
(offered, goodput, at the dependency), 2xx latency p50 and p99, refusals/s by reason (with
the offered load again); the x axes are in multiples of capacity, the legends beside the
data. In the default run a step lasts 6 s and the first 1 s of each is left out of the
figures, so every steady state is 5 s (`--quick`: 1.5 s and 0.5 s).

**For CI**: beside `report.json`, `junit.xml` holds one test suite per configuration and
scenario, one test case per invariant check (a failed check is a failure carrying its
verdict line; a check on a host-bound step is skipped, with the reason), and `steps.csv`
one row per configuration, scenario and step (offered/s, goodput/s, % of capacity, shed,
expired, success p50/p99 ms, refusal p50 ms, host-bound and why). `report.md` and
`index.html` open with the verdict, the date (UTC), the brownout and Python versions, the
CPU model and the cores (all, and usable by the lab). `--compare OLD.json` compares the run
with an older `report.json`, step by step: goodput and success p99 before and after, and
the checks that passed before and do not now; a step regressed when such a check exists,
goodput fell by more than 5% or p99 rose by more than 20%. The regressed steps are printed
and written to `lab-report/compare.md`; the exit status stays what the run's own checks
make it.

**CPU-starved front** (`cpu-starved`, in the default run on uvicorn --limit-concurrency and
both brownout configurations): 4x then 10x of capacity while a CPU hog, a pure spinner at nice
0 in its own process, started and killed by the lab, is pinned to the front's core from the
warm-up on (a noisy neighbour); brownout-adaptive must keep goodput >= 90% of capacity and
>= uvicorn's in the same step (less 2% of capacity), and success p99 <= half the deadline.

**Honest about its host**: every step reports the CPU used by the front, the dependency, the
generator (and the hog), in % of one core from `/proc` over the step's steady state, and how
busy the front's core was. A step is **host-bound** when the generator was late, the
dependency used >= 90% of a core, or the front's core was >= 95% busy with >= 10% of it used
by processes outside the lab; it is measured again once, and a check on it that would pass is
reported HOST-BOUND, not PASS, and fails the lab. The generator's own CPU is shown, not
judged: with sends under half a millisecond apart it spins between them, reading ~100%.

**Outbound and degraded scenarios** (opt-in, about 20 s per configuration each, so the
default run stays shorter; figures from such a run: [lab-outbound.md](lab-outbound.md)):

```console
$ brownout lab --scenarios retry-storm,partial-errors,outage,degraded
$ brownout lab --drill recommendations      # force the demo's degraded mode on for the run
```

They drive `/api/outbound`, which calls the dependency with retries: the unprotected front
retries naively (3 attempts, no budget), the protected front through brownout's
`BrownoutClientMiddleware` and one `Dependency` (3 attempts under a 20% `RetryBudget`, a
`CircuitBreaker` with jittered opening and 3 half-open probes; giving up answers 503 with
`brownout-retry: never`). The demo dependency counts every request that reaches it per
100 ms (behind the proxy, below: every request the proxy received, the ones it failed
included), so each of these scenarios gets a second table: attempts at the dependency per
second, amplification (attempts per original request), the busiest one-second window, client
retries (sent by the generator as new scheduled sends, counted apart from the originals) and
degraded goodput.

- **retry storm**: 2x capacity; clients retry each failure 3 times (0.1/0.2/0.4 s), first
  naively, then with a 10% retry budget, full jitter and the do-not-retry marker honoured;
- **partial errors**: 0.5x; `brownout proxy` in front of the dependency answers 30% of
  requests 503;
- **outage and recovery**: 0.5x from naive retrying clients; the proxy resets every
  request's connection for one step, then lets them through: the peak second after it
  returns vs steady;
- **degraded**: like the slow dependency, on `/api/recommendations`; protected, the declared
  mode `recommendations` (entered when the dependency's latency average passes 2.5x its
  baseline, left below 1.5x, held at least 1 s) serves them from a `StaleCache`; responses
  carrying `brownout-degraded` are counted and their goodput reported apart (G3). With
  `--drill recommendations` the mode is forced on from the start (a drill). Answers served
  by a fallback count as goodput but are never samples of the adaptive limit: a fallback's
  speed says nothing about the dependency, and taken as its no-load latency it would make the
  normal latency read as queueing once the mode left (the step after recovery shows the
  limit holding).

**Faults through `brownout proxy`**: in partial errors and outage the front calls the
dependency through `brownout proxy` (the same `FaultProxy` as the command, http mode, run in
the dependency's process and event loop), and each step sets its faults on the proxy's
control endpoint: errors at a rate and resets are the network's, not the dependency's, so
they are injected where a network or a load balancer would inject them. The slow dependency
and capacity loss stay in the dependency: they model its own capacity (service time x4: each
of its 8 slots is held 4x longer, so it serves a quarter; half of its slots gone), which
added latency at a proxy does not reproduce (a delayed request holds no slot of the
dependency, so no queue forms there: T2 is about that queue). Scenarios without network
faults run without the proxy, so their figures do not pay for its hop.

**Backlog after an outage** (`backlog`, opt-in, about 85 s; needs Redis 7 at
`--redis`, default `redis://127.0.0.1:6379/0`, and says so when it does not answer; figures
from a run: [durable queues](queues.md#backlog-after-an-outage-the-lab)):

```console
$ brownout lab --scenarios backlog
```

A durable queue instead of HTTP (Q1, Q2). A producer publishes 100 messages/s, open loop, to
a Redis stream, each valid for 3 s; the consumer's dependency (inside the consumer process:
4 calls at a time of 20 ms, 200 messages/s) is down for 10 s, then 12 s after recovery. A
naive consumer (plain redis-py, FIFO, a failure requeued at once, no deadline check) against
brownout's `redis_streams.Consumer` with the default `MessagePolicy`, each on a fresh stream,
then brownout again with an outage half as long while the scenario's supervisor SIGKILLs its
consumer process 0.5 s and 2.5 s after recovery and restarts it. Every message is accounted
for from Redis (a completion log the handler writes before the acknowledgement, the parked
stream, the stream and its retry set): published = completed + parked + still queued, and
lost must be 0. Pass/fail: brownout serves fresh messages (published after recovery) within
their deadline again within 5 s of recovery (at least 95% of each second's, for good), and
loses nothing, kills included. The table gives completions in time and late per second after
recovery, parked by reason, and a per-second table and plot around recovery.

**Payments slow after commit** (`payments`, opt-in, about 60 s; needs PostgreSQL at
`--postgres`, default `postgresql://postgres@127.0.0.1:5432/test`, and Redis at `--redis`,
and says so, exit 3, when they do not answer; figures from a run:
[idempotency](idempotency.md#the-whole-chain-client-front-payment)):

```console
$ brownout lab --scenarios payments
```

A client -> front -> payment chain, each service its own uvicorn process
(`brownout._lab.payments_service`). Orders arrive open loop at 20/s for 20 s; every fifth
one the payment service commits and then answers 1.5 s later, past the client's 0.5 s
per-attempt timeout. Naive: plain httpx retrying a timeout up to 3 attempts without a key,
a front that forwards nothing, a payment service that inserts on every request. Brownout:
`BrownoutTransport` with a `Dependency` (3 attempts under a `RetryBudget` of 0.1, a
`RedisOutcomeLedger`), a front behind `BrownoutMiddleware` calling through
`BrownoutTransport`, the idempotency layer on `PostgresIdempotencyStore`; after the run a
`Reconciler` asks the payment service by key about each unknown outcome and each one
applied is resent with its key for the stored answer. Rows per order are counted in
PostgreSQL. The table gives requested, applied once, applied twice or more, unknown
outcomes recorded, reconciled as applied, replays served. Pass/fail: brownout applies no
order twice and leaves no unknown outcome unreconciled.

**Slow database** (`database`, opt-in, about 65 s; needs PostgreSQL at `--postgres`, and
says so, exit 3, when it does not answer; figures from a run:
[the slow-database lab](lab-database.md)):

```console
$ brownout lab --scenarios database
```

A front (uvicorn) whose handler runs one query through a pool of 8 asyncpg connections
(100 ms each: 80 queries/s), offered 56 requests/s open loop with a 1 s client deadline.
From 8 s for 10 s the lab holds an advisory lock every query takes in shared mode, 1.5 s at
a time with 0.5 s free between. Unprotected: a plain pool, an unbounded wait for a
connection, no statement timeout. Brownout: `BrownoutMiddleware` and `BrownoutPool` (the
pool as admission with a 250 ms queue age bound, the statement timeout from the budget, a
cancel request to the server at the deadline). Each query's SQL comment carries its caller's
give-up time, and `pg_stat_activity`, sampled every 200 ms, tells the queries still running
for a caller who is gone. Pass/fail (brownout): no query runs on the server more than 1 s
past its caller's deadline; the pool wait's p99 within 350 ms; goodput back to 90% of its
level within 3 s of the slowdown's end; during the slowdown, at least the unprotected
front's goodput.

**Fault injection for your own stack**: `brownout proxy` is a TCP/HTTP proxy to put between
your service and one of its dependencies: latency and jitter, error responses at a rate,
resets, stalls and emulated packet loss, set by hand or on a timeline (a TOML file), with a
control endpoint so a load test can change them step by step; when `tc netem` is the better
tool and how to use it: [fault injection](proxy.md).

The three-layer chain (front -> mid -> backend) is not a lab scenario: it is measured by
counts in `tests/integration/test_retry_chain.py` (20 originals: 23 attempts at the bottom
with brownout, 540 with naive 3-attempt retries at every layer).
"""


def markdown(
    lab: dict[str, Any],
    images: list[str],
    image_prefix: str = "",
    command: str | None = None,
    *,
    header: bool = False,
) -> str:
    """The report as Markdown (what `docs/lab.md` commits); ``header``: the verdict and the
    run's environment under the title (report.md)."""
    cal = lab["calibration"]
    st = lab["settings"]
    out = ["# The overload lab", ""]
    if header:
        out += [f"- **{label}**: {value}" for label, value in environment_lines(lab)] + [""]
    sf = lab.get("scenario_file")
    if sf is not None:
        # A user's service: the demo's description would be wrong here.
        out += [
            f"A run of the scenario file `{sf['source']}` against {sf['base_url']}: "
            "open-loop load in steps, latency from each request's scheduled send time, every "
            "request counted into one outcome; the checks are the file's invariants.",
            "",
        ]
    else:
        out += [*PREAMBLE.splitlines(), ""]
    if command:
        out += ["## This run", "", "Produced by:", "", "```console", f"$ {command}", "```", ""]
    if _backlog_runs(lab):
        out += _backlog_markdown(lab)
        out += [f"![timeline-backlog.png]({image_prefix}timeline-backlog.png)", ""]
    if _payments_runs(lab):
        out += [f"## {PAYMENTS_TITLE}", "", payments_description(lab), ""]
        out += ["| " + " | ".join(PAYMENTS_COLUMNS) + " |"]
        out += ["|" + "---|" * len(PAYMENTS_COLUMNS)]
        out += ["| " + " | ".join(row) + " |" for row in payments_rows(lab)]
        out += [""]
    if database_runs(lab):
        out += _database_markdown(lab)
        out += [f"![timeline-database.png]({image_prefix}timeline-database.png)", ""]
    if not cal:
        return "\n".join([*out, "## Verdict", "", *_verdict_lines(lab), ""])
    source = cal.get("source", "calibration")
    measured = (
        f"Measured capacity: **{cal['capacity']:.0f} requests/s** (closed loop, concurrency "
        f"doubled until throughput stopped growing); dependency service time "
        f"{cal['service_time'] * 1000:.1f} ms"
        if source == "calibration"
        else f"Capacity: **{cal['capacity']:.0f} requests/s** ({_CAPACITY_SOURCES[source]})"
    )
    out += [
        f"{measured}; client deadline {st['deadline'] * 1000:.0f} ms; "
        f"steps of {st['step_seconds']:g} s, the first {st['settle_seconds']:g} s of each left "
        f"out of the figures; {st['arrivals']} arrivals.",
        "",
        "Columns: offered and goodput (2xx within the deadline) per second in steady state; "
        "health checks are shown per class and left out of goodput; "
        "shed = 503/429 refusals with the reason the server named; expired = client timeouts, "
        "2xx answers that came after the deadline (late 2xx) and 504s; success latency and "
        "refusal latency are separate; conns opened = new TCP connections the client had to "
        "open; gen p99 late = how late the load generator itself "
        "was (a step is suspect above 5 ms); CPU front/dep/gen % = CPU used by the front, "
        "the dependency and the load generator in % of one core over the steady state (hog: "
        "the CPU-starved scenario's spinner; core: how busy the front's core was); host = ok, "
        "or host-bound and why.",
        "",
    ]
    for sc in _scenarios(lab):
        out += [f"## {sc['title']}", "", sc["description"], ""]
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        for row in scenario_rows(lab, sc["name"]):
            out.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
        out.append("")
        if sc.get("outbound"):
            out += ["What reached the dependency:", ""]
            out.append("| " + " | ".join(OUTBOUND_COLUMNS) + " |")
            out.append("|" + "---|" * len(OUTBOUND_COLUMNS))
            for row in outbound_rows(lab, sc["name"]):
                out.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
            out.append("")
        if rows := server_rows(lab, sc["name"]):
            out += [f"{SERVER_TITLE[0].upper()}{SERVER_TITLE[1:]}:", ""]
            out.append("| " + " | ".join(SERVER_COLUMNS) + " |")
            out.append("|" + "---|" * len(SERVER_COLUMNS))
            out += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in rows]
            out.append("")
        for img in images:
            if (sc["name"] == "ramp" and not img.startswith("timeline-")) or img == (
                f"timeline-{sc['name']}.png"
            ):
                out += [f"![{img}]({image_prefix}{img})", ""]
    out += ["## Verdict", "", *_verdict_lines(lab), ""]
    return "\n".join(out)


def _html(lab: dict[str, Any], images: list[str]) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>brownout lab</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px}th{background:#eee}"
        ".fail{color:#b00}</style></head><body><h1>brownout overload lab</h1>",
        "<ul>",
        *(
            f"<li><b>{html.escape(label)}</b>: {html.escape(value)}</li>"
            for label, value in environment_lines(lab)
        ),
        "</ul>",
    ]
    cal = lab["calibration"]
    if cal:
        parts.append(
            f"<p>Capacity {cal['capacity']:.0f} req/s "
            f"({_CAPACITY_SOURCES[cal.get('source', 'calibration')]}), {_service_time(cal)}"
            f"deadline {lab['settings']['deadline'] * 1000:.0f} ms.</p>"
        )
    if _backlog_runs(lab):
        parts.append(f"<h2>{BACKLOG_TITLE}</h2><p>{html.escape(backlog_description(lab))}</p>")
        for cols, rows in ((list(BACKLOG_COLUMNS), backlog_rows(lab)), backlog_seconds(lab)):
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols))
            for row in rows:
                cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
                parts.append(f"<tr>{cells}</tr>")
            parts.append("</table>")
        parts.append("<p><img src='timeline-backlog.png'></p>")
    if _payments_runs(lab):
        parts.append(f"<h2>{PAYMENTS_TITLE}</h2><p>{html.escape(payments_description(lab))}</p>")
        parts.append(
            "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in PAYMENTS_COLUMNS)
        )
        for row in payments_rows(lab):
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    if database_runs(lab):
        parts.append(f"<h2>{DATABASE_TITLE}</h2><p>{html.escape(database_description(lab))}</p>")
        for cols, rows in (
            (DATABASE_COLUMNS, database_rows(lab)),
            (DATABASE_SECONDS_COLUMNS, database_seconds(lab)),
        ):
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols))
            for row in rows:
                parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
            parts.append("</table>")
        parts.append("<p><img src='timeline-database.png'></p>")
    for sc in _scenarios(lab):
        parts.append(f"<h2>{html.escape(sc['title'])}</h2><p>{html.escape(sc['description'])}</p>")
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS))
        for row in scenario_rows(lab, sc["name"]):
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
        if sc.get("outbound"):
            parts.append("<p>What reached the dependency:</p><table><tr>")
            parts.append("".join(f"<th>{html.escape(c)}</th>" for c in OUTBOUND_COLUMNS))
            for row in outbound_rows(lab, sc["name"]):
                cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
                parts.append(f"<tr>{cells}</tr>")
            parts.append("</table>")
        if rows := server_rows(lab, sc["name"]):
            parts.append(f"<p>{html.escape(SERVER_TITLE)}:</p><table><tr>")
            parts.append("".join(f"<th>{html.escape(c)}</th>" for c in SERVER_COLUMNS))
            for row in rows:
                cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
                parts.append(f"<tr>{cells}</tr>")
            parts.append("</table>")
        for img in images:
            if (sc["name"] == "ramp" and not img.startswith("timeline-")) or img == (
                f"timeline-{sc['name']}.png"
            ):
                parts.append(f"<p><img src='{html.escape(img)}'></p>")
    parts.append("<h2>Verdict</h2><ul>")
    for line in _verdict_lines(lab):
        cls = " class='fail'" if "FAIL" in line else ""
        parts.append(f"<li{cls}>{html.escape(line[2:].replace('**', ''))}</li>")
    parts.append("</ul><p><a href='report.json'>raw JSON</a></p></body></html>")
    return "\n".join(parts)


def write_report(lab: dict[str, Any], out_dir: Path, command: str | None = None) -> list[Path]:
    """Write report.json, junit.xml, steps.csv, the PNGs, index.html and report.md into
    ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(lab, indent=1))
    (out_dir / "junit.xml").write_text(junit_xml(lab))
    (out_dir / "steps.csv").write_text(steps_csv(lab))
    images = _plot(lab, out_dir)
    (out_dir / "index.html").write_text(_html(lab, images))
    (out_dir / "report.md").write_text(markdown(lab, images, command=command, header=True))
    names = ("report.json", "junit.xml", "steps.csv", "index.html", "report.md", *images)
    return [out_dir / n for n in names]


def write_markdown(lab: dict[str, Any], report_dir: Path, path: Path, command: str) -> None:
    """Write ``path`` (e.g. docs/lab.md) with the report's images copied beside it in lab/."""
    images = sorted(p.name for p in report_dir.glob("*.png"))
    image_dir = path.parent / path.stem
    image_dir.mkdir(parents=True, exist_ok=True)
    for name in images:
        shutil.copyfile(report_dir / name, image_dir / name)
    path.write_text(markdown(lab, images, image_prefix=f"{path.stem}/", command=command))
