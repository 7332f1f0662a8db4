"""The lab's plots over time: load multiples on the x axis, legends off the data, tick labels
apart (brownout._lab.timeline_plot)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from brownout._lab.report import write_report
from brownout._lab.timeline_plot import tick_overlaps, timeline_figure

plt = pytest.importorskip("matplotlib.pyplot")

LOADS = (0.5, 0.8, 1.0, 2.0, 4.0, 10.0)
WIDTH = 0.5


def _bin(second: float, load: float) -> dict[str, Any]:
    offered = int(400 * load * WIDTH)
    ok = min(offered, 200)
    refused = offered - ok
    return {
        "ok": ok,
        "refused": refused,
        "expired": 0,
        "failed": 0,
        "p50_ms": 20.0 + load,
        "p99_ms": 40.0 + 10 * load,
        "reasons": {"queue_timeout": refused // 2, "limit": refused - refused // 2}
        if refused
        else {},
    }


def _run(config: str, labels: tuple[str, ...]) -> dict[str, Any]:
    steps, timeline = [], []
    for i, (load, label) in enumerate(zip(LOADS, labels, strict=True)):
        steps.append(
            {"label": label, "load": load, "start": 1.0 + 3.0 * i, "duration": 3.0, "settle": 1.0}
        )
    for b in range(int((1.0 + 3.0 * len(LOADS)) / WIDTH) + 1):
        t = b * WIDTH
        load = 0.5 if t < 1.0 else LOADS[min(int((t - 1.0) / 3.0), len(LOADS) - 1)]
        timeline.append(_bin(t, load))
    return {
        "configuration": config,
        "scenario": "ramp",
        "steps": steps,
        "timeline": timeline,
        "bin_seconds": WIDTH,
        "dependency_timeline": [150.0] * len(timeline),
    }


def _figure(labels: tuple[str, ...]) -> Any:
    runs = [_run("unprotected", labels), _run("brownout-adaptive", labels)]
    titles = {"unprotected": "unprotected", "brownout-adaptive": "brownout Gradient2Limit()"}
    sc = {"name": "ramp", "title": "Ramp"}
    return timeline_figure(sc, runs, titles, 400.0, 1000.0, plt, lambda step: False)


def _overlap(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize(
    "labels",
    [
        tuple(f"{load:g}x" for load in LOADS),
        ("healthy", "30% errors", "a long step name here", "outage", "returned", "after"),
    ],
)
def test_timeline_ticks_are_load_multiples_and_nothing_overlaps(labels: tuple[str, ...]) -> None:
    fig = _figure(labels)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        top, middle, bottom = fig.axes[:3]
        texts = [t.get_text() for t in bottom.get_xticklabels() if t.get_visible()]
        assert texts
        assert all(re.fullmatch(r"\d+(\.\d+)?x", t.split("\n")[0]) for t in texts), texts
        assert {t.split("\n")[0] for t in texts} <= {f"{load:g}x" for load in LOADS}
        assert tick_overlaps(fig, bottom) == 0
        for ax in (top, middle, bottom):
            legend = ax.get_legend()
            assert legend is not None
            box = legend.get_window_extent(renderer)
            for other in (top, middle, bottom):
                assert not _overlap(box, other.get_window_extent(renderer))
        # offered load is drawn on the requests panel and the refusals panel
        assert "offered" in top.get_legend_handles_labels()[1]
        assert "offered" in bottom.get_legend_handles_labels()[1]
        assert any("p99" in label for label in middle.get_legend_handles_labels()[1])
        assert any("queue_timeout" in label for label in bottom.get_legend_handles_labels()[1])
    finally:
        plt.close(fig)


def test_crowded_tick_labels_are_rotated_or_thinned() -> None:
    fig, ax = plt.subplots(figsize=(3, 2))
    try:
        ax.set_xticks(range(12), [f"step number {i}" for i in range(12)])
        from brownout._lab.timeline_plot import declutter_ticks

        assert tick_overlaps(fig, ax) > 0
        declutter_ticks(fig, ax)
        assert tick_overlaps(fig, ax) == 0
    finally:
        plt.close(fig)


def test_a_report_writes_a_timeline_for_every_scenario(tmp_path: Path) -> None:
    from tests.unit.test_lab_report import make_lab

    names = {f.name for f in write_report(make_lab(), tmp_path)}
    assert {"timeline-ramp.png", "timeline-priority.png", "goodput.png"} <= names
