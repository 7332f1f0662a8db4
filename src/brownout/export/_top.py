"""``brownout top``: a live terminal view of a running service's ``/metrics`` (O1, O2, O5).

    brownout top http://127.0.0.1:8000/metrics          # refresh every 2 s until Ctrl-C
    brownout top http://127.0.0.1:8000/metrics --once   # print one frame and exit

Reads the Prometheus text format (parsed with ``prometheus_client.parser``) and shows, per hop
and operation, offered / admitted / shed / goodput / late / expired work (rates per second
after the first refresh), shed by reason and by caller, success latency quantiles, limit vs
in-flight, queue depth and age, retry budgets, open breakers, degraded modes and any
false-positive shedding. Needs ``rich`` and ``prometheus_client`` (``brownout[lab]``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

try:
    from prometheus_client.parser import text_string_to_metric_families
    from rich.console import Console, Group, RenderableType
    from rich.table import Table
    from rich.text import Text
except ModuleNotFoundError as e:  # the extras are not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "prometheus,lab", e) from e

__all__ = ["Scrape", "fetch", "main", "parse", "render"]

_WORK = (
    ("offered", "brownout_requests_offered_total"),
    ("admitted", "brownout_requests_admitted_total"),
    ("shed", "brownout_requests_shed_total"),
    ("goodput", "brownout_requests_completed_total"),
    ("late", "brownout_requests_completed_late_total"),
    ("expired", "brownout_requests_expired_total"),
    ("failed", "brownout_requests_failed_total"),
    ("abandoned", "brownout_requests_abandoned_total"),
)
_CAPACITY = (
    ("in flight", "brownout_in_flight_requests"),
    ("limit", "brownout_concurrency_limit"),
    ("queued", "brownout_queue_depth_requests"),
    ("oldest age s", "brownout_queue_oldest_age_seconds"),
    ("overload", "brownout_overload_level"),
    ("retry tokens", "brownout_retry_budget_tokens"),
)


@dataclass
class Scrape:
    """One parsed scrape: samples as (name, sorted label pairs) -> value, and when."""

    at: float
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def sum(self, name: str, by: Iterable[str] = (), **match: str) -> dict[tuple[str, ...], float]:
        """Sum samples of ``name`` whose labels include ``match``, grouped by labels ``by``."""
        keys = tuple(by)
        out: dict[tuple[str, ...], float] = {}
        for (n, labels), v in self.samples.items():
            if n != name:
                continue
            d = dict(labels)
            if any(d.get(k) != val for k, val in match.items()):
                continue
            group = tuple(d.get(k, "") for k in keys)
            out[group] = out.get(group, 0.0) + v
        return out

    def total(self, name: str, **match: str) -> float:
        return sum(self.sum(name, **match).values())


def parse(text: str, at: float | None = None) -> Scrape:
    """Parse Prometheus text exposition into a `Scrape`."""
    scrape = Scrape(time.monotonic() if at is None else at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return scrape


MAX_SCRAPE_BYTES = 32 * 1024 * 1024
"""A page larger than this is not a brownout service's metrics; `fetch` refuses it rather than
hold it in memory."""


class ScrapeError(OSError):
    """The URL answered, but not with Prometheus metrics `brownout top` can read."""


def fetch(url: str, timeout: float = 5.0) -> Scrape:
    """GET ``url`` and parse it; `OSError` (`ScrapeError` for an answer that is not metrics)
    when it cannot be read."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise ScrapeError(f"not an http:// or https:// URL: {url!r}")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read(MAX_SCRAPE_BYTES + 1)
    if len(body) > MAX_SCRAPE_BYTES:
        raise ScrapeError(f"the page is larger than {MAX_SCRAPE_BYTES // 2**20} MiB")
    try:
        return parse(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise ScrapeError(f"not Prometheus text exposition: {exc}") from None


def _quantile(buckets: Mapping[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (le -> count) buckets."""
    items = sorted(buckets.items())
    if not items or items[-1][1] == 0:
        return math.nan
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    if digits == 0 and float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.{digits or 2}f}"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def render(now: Scrape, before: Scrape | None = None, *, title: str = "") -> RenderableType:
    """One frame: totals, or per-second rates when a previous scrape is given."""
    elapsed = (now.at - before.at) if before is not None else 0.0
    rates = before is not None and elapsed > 0

    def value(name: str, group: tuple[str, ...], by: tuple[str, ...]) -> str:
        v = now.sum(name, by).get(group, 0.0)
        if rates and before is not None:
            return f"{(v - before.sum(name, by).get(group, 0.0)) / elapsed:.1f}"
        return _fmt(v)

    parts: list[RenderableType] = []
    fp = now.total("brownout_requests_shed_false_positive_total")
    head = Text(title or "brownout top", style="bold")
    head.append(f"   {'rates per second' if rates else 'totals since start'}", style="dim")
    if fp:
        head.append(f"   FALSE-POSITIVE SHEDDING: {int(fp)}", style="bold red")
    parts.append(head)

    by = ("source", "operation")
    work = Table(title="Work by hop and operation", title_justify="left", expand=False)
    for col in ("source", "operation", *(label for label, _ in _WORK)):
        work.add_column(col, justify="left" if col in by else "right")
    groups = sorted(now.sum("brownout_requests_offered_total", by))
    for group in groups:
        work.add_row(*group, *(value(name, group, by) for _, name in _WORK))
    parts.append(work)

    shed = Table(title="Shed", title_justify="left")
    shed.add_column("reason")
    shed.add_column("count", justify="right")
    for (reason,), n in sorted(
        now.sum("brownout_requests_shed_total", ("reason",)).items(), key=lambda kv: -kv[1]
    ):
        shed.add_row(reason, _fmt(n))
    callers = Table(title="Shed by caller (top 5)", title_justify="left")
    callers.add_column("caller")
    callers.add_column("count", justify="right")
    top = sorted(
        now.sum("brownout_requests_shed_total", ("caller",)).items(), key=lambda kv: -kv[1]
    )[:5]
    for (caller,), n in top:
        callers.add_row(caller, _fmt(n))

    latency = Table(title="Useful-success latency", title_justify="left")
    for col in ("operation", "p50", "p99", "count"):
        latency.add_column(col, justify="left" if col == "operation" else "right")
    buckets = now.sum("brownout_success_latency_seconds_bucket", ("operation", "le"))
    per_op: dict[str, dict[float, float]] = {}
    for (op, le), n in buckets.items():
        per_op.setdefault(op, {})[float(le)] = n
    for op in sorted(per_op):
        b = per_op[op]
        latency.add_row(op, _ms(_quantile(b, 0.5)), _ms(_quantile(b, 0.99)), _fmt(max(b.values())))

    capacity = Table(
        title="Capacity (autoscaling signals: in flight, queue age)", title_justify="left"
    )
    capacity.add_column("source")
    for label, _ in _CAPACITY:
        capacity.add_column(label, justify="right")
    sources = sorted({g for _, name in _CAPACITY for g in now.sum(name, ("source",))})
    for (source,) in sources:
        capacity.add_row(
            source,
            *(
                _fmt(now.sum(name, ("source",)).get((source,)), 3 if "age" in label else 0)
                if (source,) in now.sum(name, ("source",))
                else "-"
                for label, name in _CAPACITY
            ),
        )

    state = Text()
    open_breakers = [
        s for (s,), v in now.sum("brownout_breaker_state", ("source",), state="open").items() if v
    ]
    modes = [m for (m,), v in now.sum("brownout_degraded_mode_active", ("mode",)).items() if v]
    state.append("breakers open: ", style="bold")
    state.append(
        ", ".join(sorted(open_breakers)) or "none", style="red" if open_breakers else "green"
    )
    state.append("   degraded modes: ", style="bold")
    state.append(", ".join(sorted(modes)) or "none", style="yellow" if modes else "green")
    exhausted = now.total("brownout_retry_budget_exhausted_total")
    state.append(f"   retry budget exhausted: {_fmt(exhausted)}")

    parts.extend([shed, callers, latency, capacity, state])
    return Group(*parts)


def main(argv: list[str]) -> int:
    """Entry point of ``brownout top``; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="brownout top", description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000/metrics")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape")
    args = parser.parse_args(argv)
    # NaN fails both comparisons; an interval of 0 would scrape the service in a busy loop.
    if not 0.1 <= args.interval <= 3600:
        parser.error(f"--interval {args.interval:g}: must be 0.1 to 3600 seconds")
    if not 0 < args.timeout <= 300:
        parser.error(f"--timeout {args.timeout:g}: must be more than 0 and at most 300 seconds")
    console = Console()
    try:
        first = fetch(args.url, args.timeout)
    except OSError as exc:
        print(f"brownout top: cannot read {args.url}: {exc}", file=sys.stderr)
        return 2
    if args.once:
        console.print(render(first, title=f"brownout top {args.url}"))
        return 0

    from rich.live import Live

    before, now = None, first
    try:
        with Live(render(now, title=args.url), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    before, now = now, fetch(args.url, args.timeout)
                except OSError as exc:
                    live.update(Text(f"cannot read {args.url}: {exc}", style="red"), refresh=True)
                    continue
                live.update(render(now, before, title=args.url), refresh=True)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
