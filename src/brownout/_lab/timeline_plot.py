"""The lab's plots over time: per scenario, offered load, goodput, latency percentiles and
refusals by reason over the plan's schedule, the x axis in load multiples.

Layout rules every plot of the lab follows (`load_axis`, `legend_outside`,
`declutter_ticks`): ticks name the load as a multiple of capacity ("0.5x", "2x"), legends sit
outside the axes (never over data), and tick labels that would overlap are rotated, then
thinned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

__all__ = [
    "declutter_ticks",
    "legend_outside",
    "load_axis",
    "load_label",
    "log_ms_axis",
    "plot_timeline",
    "tick_overlaps",
    "timeline_figure",
]


def load_label(load: float) -> str:
    """``0.5`` -> ``"0.5x"``: a load as a multiple of capacity."""
    return f"{load:g}x"


def legend_outside(ax: Any, fontsize: int = 7) -> Any:
    """The axes' legend to its right, outside the data area (None when nothing is labelled)."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    return ax.legend(
        handles, labels, fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0)
    )


def tick_overlaps(fig: Any, ax: Any) -> int:
    """How many neighbouring visible x tick labels of ``ax`` overlap once drawn."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = sorted(
        (
            t.get_window_extent(renderer)
            for t in ax.get_xticklabels()
            if t.get_visible() and t.get_text()
        ),
        key=lambda b: b.x0,
    )
    return sum(1 for a, b in pairwise(boxes) if a.x1 > b.x0)


def declutter_ticks(fig: Any, ax: Any) -> None:
    """When ``ax``'s x tick labels overlap: a word a line in a smaller font, then rotated,
    then every other one kept, until they do not."""
    if not tick_overlaps(fig, ax):
        return
    for label in ax.get_xticklabels():
        label.set_text(label.get_text().replace(" ", "\n"))
        label.set_fontsize(7)
    ax.set_xticks(ax.get_xticks(), [t.get_text() for t in ax.get_xticklabels()], fontsize=7)
    if not tick_overlaps(fig, ax):
        return
    for label in ax.get_xticklabels():
        label.set_rotation(30)
        label.set_horizontalalignment("right")
    step = 2
    while tick_overlaps(fig, ax) and step < 16:
        for i, label in enumerate(ax.get_xticklabels()):
            label.set_visible(i % step == 0)
        step *= 2


def load_axis(ax: Any, positions: Sequence[float], labels: Sequence[str], title: str) -> None:
    """Major x ticks at ``positions`` named ``labels`` (load multiples); no minor labels."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xticks(list(positions), list(labels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(title)


def log_ms_axis(ax: Any) -> None:
    """A log y axis of milliseconds ticked 20, 50, 100, 200 ... in plain numbers."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _offered(bins: list[dict[str, Any]], width: float) -> list[float]:
    return [sum(b.get(k, 0) for k in ("ok", "refused", "expired", "failed")) / width for b in bins]


def _edges(values: list[float]) -> list[float]:
    """``values`` with its last repeated: a post-step line drawn to the end of its last bin."""
    return values + values[-1:]


def _step_ticks(steps: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    """A tick in the middle of each step: its load, and its name when that says more."""
    positions, labels = [], []
    for step in steps:
        positions.append(float(step["start"]) + float(step["duration"]) / 2)
        load = load_label(float(step["load"]))
        labels.append(load if step["label"] == load else f"{load}\n{step['label']}")
    return positions, labels


def plot_timeline(
    sc: dict[str, Any],
    runs: list[dict[str, Any]],
    titles: dict[str, str],
    capacity: float,
    deadline_ms: float,
    out: Path,
    plt: Any,
    host_bound: Callable[[dict[str, Any]], Any],
) -> str:
    """Write `timeline_figure` as ``timeline-<scenario>.png`` in ``out``; its file name."""
    fig = timeline_figure(sc, runs, titles, capacity, deadline_ms, plt, host_bound)
    name = f"timeline-{sc['name']}.png"
    fig.savefig(out / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


def timeline_figure(
    sc: dict[str, Any],
    runs: list[dict[str, Any]],
    titles: dict[str, str],
    capacity: float,
    deadline_ms: float,
    plt: Any,
    host_bound: Callable[[dict[str, Any]], Any],
) -> Any:
    """One scenario's runs over time, three panels sharing the schedule: requests/s (offered,
    goodput, at the dependency), 2xx latency p50/p99, refusals/s by reason. ``host_bound``
    tells whether a step was host-bound (shaded)."""
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    offered_drawn = False
    shaded: set[str] = set()
    for run in runs:
        width = run["bin_seconds"]
        bins = run["timeline"][:-1]  # the last bin is cut short by the end of the plan
        # One edge more than bins: the last bin is drawn to its end, not as a point.
        xs = [i * width for i in range(len(bins) + 1)] if bins else []
        name = titles.get(run["configuration"], run["configuration"])
        if not offered_drawn and bins:
            for ax in (top, bottom):
                ax.step(
                    xs,
                    _edges(_offered(bins, width)),
                    where="post",
                    color="0.55",
                    linewidth=2.2,
                    alpha=0.6,
                    label="offered",
                )
            offered_drawn = True
        (line,) = top.step(xs, _edges([b["ok"] / width for b in bins]), where="post", label=name)
        colour = line.get_color()
        dep = run.get("dependency_timeline")
        if dep:
            top.step(
                xs,
                _edges(dep[: len(bins)]),
                where="post",
                linestyle=":",
                color=colour,
                label=f"{name}: at dependency",
            )
        for key, style in (("p99_ms", "-"), ("p50_ms", "--")):
            values = [b.get(key) for b in bins]
            if any(v is not None for v in values):
                middle.step(
                    xs,
                    _edges([float("nan") if v is None else v for v in values]),
                    where="post",
                    linestyle=style,
                    color=colour,
                    label=f"{name} {key[:3]}",
                )
        reasons = sorted({r for b in bins for r in b.get("reasons", {})})
        for i, reason in enumerate(reasons):
            # One run: a colour per reason; several: the run's colour, a style per reason.
            alone = len(runs) == 1
            bottom.step(
                xs,
                _edges([b.get("reasons", {}).get(reason, 0) / width for b in bins]),
                where="post",
                linestyle="-" if alone else ("-", "--", ":", "-.")[i % 4],
                color=f"C{(i + 1) % 10}" if alone else colour,
                label=reason if alone else f"{name}: {reason}",
            )
        for step in run["steps"]:
            if host_bound(step):
                label = None if name in shaded else f"host-bound step: {name}"
                shaded.add(name)
                top.axvspan(
                    float(step["start"]),
                    float(step["start"]) + float(step["duration"]),
                    color="red",
                    alpha=0.08,
                    label=label,
                )
    top.axhline(capacity, color="0.6", linestyle="--", label="capacity")
    middle.axhline(deadline_ms, color="0.6", linestyle="--", label="deadline")
    if runs:
        for ax in (top, middle, bottom):
            for step in runs[0]["steps"]:
                ax.axvline(float(step["start"]), color="0.85", linewidth=0.8)
    top_value = max((v for r in runs for v in r.get("dependency_timeline", [])), default=0.0)
    offered_top = max(
        (max(_offered(r["timeline"][:-1], r["bin_seconds"]), default=0.0) for r in runs),
        default=0.0,
    )
    top.set_ylim(0, max(capacity * 1.3, top_value * 1.05, offered_top * 1.05))
    top.set_ylabel("requests/s")
    top.set_title(f"{sc['title']}: over time (by scheduled send time)", fontsize=10)
    middle.set_yscale("log")
    log_ms_axis(middle)
    middle.set_ylabel("2xx latency (ms, log)")
    bottom.set_ylabel("refusals/s by reason")
    bottom.set_ylim(bottom=0)
    if runs and runs[0]["steps"]:
        last = runs[0]["steps"][-1]
        bottom.set_xlim(0, float(last["start"]) + float(last["duration"]))
        positions, labels = _step_ticks(runs[0]["steps"])
        load_axis(bottom, positions, labels, "offered load (multiple of capacity), step by step")
    seconds = top.secondary_xaxis("top")
    seconds.set_xlabel("seconds since the plan started", fontsize=8)
    seconds.tick_params(labelsize=7)
    for ax in (top, middle, bottom):
        legend_outside(ax)
    fig.tight_layout()
    declutter_ticks(fig, bottom)
    return fig
