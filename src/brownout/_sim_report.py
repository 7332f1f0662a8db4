"""The simulator's report: plots per layer over time and an HTML page, verdict first.

``brownout sim FILE --out DIR`` writes ``DIR/index.html``, ``DIR/layers.png`` (offered,
admitted, shed, retried and completed in deadline per second, one panel per layer, fault
windows shaded), ``DIR/work.png`` (busy and wasted worker-seconds per second) and
``DIR/result.json``. matplotlib comes with the ``lab`` extra, loaded only here.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ._sim import Result

__all__ = ["LINES", "write_report"]

LINES: tuple[tuple[str, str], ...] = (
    ("offered", "#1f77b4"),
    ("admitted", "#9467bd"),
    ("shed", "#d62728"),
    ("retried", "#ff7f0e"),
    ("completed", "#2ca02c"),
)
"""The counts plotted per layer, with their colours (``completed``: in deadline)."""


def _rates(result: Result, layer: str, metric: str) -> tuple[list[float], list[float]]:
    """Bucket midpoints (seconds) and ``metric`` per second in each bucket."""
    series = result.layers[layer]
    xs: list[float] = []
    ys: list[float] = []
    for i, value in enumerate(series.column(metric)):
        start = i * result.bucket
        seconds = min(result.bucket, result.duration - start)
        xs.append(start + seconds / 2.0)
        ys.append(value / seconds)
    return xs, ys


def _fault_label(fault: Any) -> str:
    where = fault.zone if fault.kind == "zone_loss" else fault.service
    until = "end" if fault.until is None else f"{fault.until:g} s"
    return f"{fault.kind} ({where}) {fault.at:g} s to {until}"


def _shade(ax: Any, result: Result) -> None:
    for fault in result.system.faults:
        end = result.duration if fault.until is None else fault.until
        ax.axvspan(fault.at, end, color="0.9", zorder=0)


def _figure(result: Result, out: Path, plt: Any, metrics: tuple[tuple[str, str], ...],
            name: str, unit: str) -> str:  # fmt: skip
    layers = list(result.layers)
    fig, axes = plt.subplots(
        len(layers), 1, sharex=True, figsize=(8.5, 1.9 * len(layers) + 0.9), squeeze=False
    )
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        _shade(ax, result)
        for metric, colour in metrics:
            xs, ys = _rates(result, layer, metric)
            ax.plot(xs, ys, color=colour, label=metric, linewidth=1.4)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_title(layer, fontsize=9, loc="left")
        ax.set_xlim(0, result.duration)
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    # One legend for every panel, outside the plotting area (never over the data).
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(metrics), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 1.0))  # fmt: skip
    faults = "; ".join(_fault_label(f) for f in result.system.faults)
    if faults:
        fig.text(0.01, 0.005, f"shaded: {faults}", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def plot(result: Result, out: Path) -> list[str]:
    """Write the PNGs into ``out``; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = (("busy", "#1f77b4"), ("wasted", "#d62728"))
    return [
        _figure(result, out, plt, LINES, "layers.png", "req/s"),
        _figure(result, out, plt, work, "work.png", "worker-s/s"),
    ]


def _title(result: Result) -> str:
    name = result.system.metadata.get("name")
    return str(name) if name else "brownout simulation"


def _html(result: Result, images: list[str], source: str | None) -> str:
    title = html.escape(_title(result))
    held = sum(v.passed for v in result.verdicts)
    total = len(result.verdicts)
    if not total:
        verdict, cls = "no invariants declared", "none"
    elif result.passed:
        verdict, cls = f"PASS: all {total} invariants held", "pass"
    else:
        verdict, cls = f"FAIL: {total - held} of {total} invariants failed", "fail"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px}th{background:#eee}"
        ".fail{color:#b00}.pass{color:#070}pre{font-size:11px}</style></head><body>",
        f"<h1>{title}</h1>",
        f"<p class='{cls}'><b>{html.escape(verdict)}</b></p><ul>",
    ]
    for v in result.verdicts:
        mark = "pass" if v.passed else "fail"
        parts.append(f"<li class='{mark}'>{html.escape(v.describe())}</li>")
    parts.append("</ul>")
    where = f" from <code>{html.escape(source)}</code>" if source else ""
    parts.append(
        f"<p>{result.duration:g} simulated seconds{where}, seed {result.system.seed}, "
        f"{result.requests} requests offered over all layers, {result.bucket:g} s buckets.</p>"
    )
    parts.append(
        "<table><tr><th>service</th><th>instances</th><th>workers</th>"
        "<th>mean service time (ms)</th><th>zones</th><th>calls</th></tr>"
    )
    for s in result.system.services:
        calls = ", ".join(f"{c.target} x{c.fanout}" for c in s.calls) or "-"
        parts.append(
            f"<tr><td>{html.escape(s.name)}</td><td>{s.instances}</td><td>{s.workers}</td>"
            f"<td>{s.service_time.mean * 1000:.1f}</td><td>{html.escape(', '.join(s.zones))}"
            f"</td><td>{html.escape(calls)}</td></tr>"
        )
    parts.append("</table>")
    if result.system.faults:
        parts.append("<h2>Faults</h2><ul>")
        for f in result.system.faults:
            parts.append(f"<li>{html.escape(_fault_label(f))}</li>")
        parts.append("</ul>")
    parts.append("<h2>Per layer over time</h2>")
    for name in images:
        parts.append(f"<p><img src='{html.escape(name)}' alt='{html.escape(name)}'></p>")
    every = max(1, result.n // 15)
    parts.append(f"<pre>{html.escape(result.table(every=every))}</pre>")
    parts.append("<p><a href='result.json'>raw JSON</a></p></body></html>")
    return "\n".join(parts)


def write_report(result: Result, out: Path, *, source: str | None = None) -> list[Path]:
    """Write ``result.json``, the PNGs and ``index.html`` into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result.to_json(), indent=1))
    images = plot(result, out)
    (out / "index.html").write_text(_html(result, images, source))
    return [out / "result.json", *(out / n for n in images), out / "index.html"]
