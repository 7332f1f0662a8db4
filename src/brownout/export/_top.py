"""``brownout top``: a live terminal view of a running service's ``/metrics`` (O1, O2, O5).

    brownout top http://127.0.0.1:8000/metrics          # refresh every 2 s until Ctrl-C
    brownout top http://127.0.0.1:8000/metrics --once   # two scrapes, one frame, exit

Reads the Prometheus text format (parsed with ``prometheus_client.parser``). Rates and latency
percentiles cover a recent window (`Window`, the last 10 s by default): they come from the
increase of counters and histogram buckets between the newest scrape and the oldest scrape in
the window, never from totals since the service started. Gauges (in flight, limit, queue
depth and age, breakers, degraded modes) are the newest scrape's. Needs ``rich`` and
``prometheus_client`` (``brownout[top]``); nothing from the lab.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

try:
    from prometheus_client.parser import text_string_to_metric_families
    from rich.console import Console, Group, RenderableType
    from rich.table import Table
    from rich.text import Text
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "top", e) from e

from .._help import HelpFormatter

__all__ = ["Scrape", "ScrapeError", "Window", "fetch", "increase", "main", "parse", "render"]

Labels = tuple[tuple[str, str], ...]

_WORK = (
    # (column, short column, metric): the short names are for narrow terminals
    ("offered", "offer", "brownout_requests_offered_total"),
    ("admitted", "admit", "brownout_requests_admitted_total"),
    ("shed", "shed", "brownout_requests_shed_total"),
    ("goodput", "good", "brownout_requests_completed_total"),
    ("late", "late", "brownout_requests_completed_late_total"),
    ("expired", "expd", "brownout_requests_expired_total"),
    ("failed", "fail", "brownout_requests_failed_total"),
    ("abandoned", "aband", "brownout_requests_abandoned_total"),
)
_CAPACITY = (
    ("in flight", "infl", "brownout_in_flight_requests"),
    ("limit", "limit", "brownout_concurrency_limit"),
    ("queued", "queue", "brownout_queue_depth_requests"),
    ("oldest age s", "age s", "brownout_queue_oldest_age_seconds"),
    ("overload", "ovld", "brownout_overload_level"),
    ("retry tokens", "tokens", "brownout_retry_budget_tokens"),
)
_WIDE = 120
"""From this many columns on, tables use their long column names."""


@dataclass
class Scrape:
    """One parsed scrape: samples as (name, sorted label pairs) -> value, and when (monotonic
    seconds). ``families`` maps each sample name to its metric family's (name, type)."""

    at: float
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    families: dict[str, tuple[str, str]] = field(default_factory=dict)

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
    """Parse Prometheus text exposition into a `Scrape` taken at ``at`` (default: now)."""
    scrape = Scrape(time.monotonic() if at is None else at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
            scrape.families[s.name] = (family.name, family.type)
    return scrape


def _series(
    name: str, labels: Labels, families: Mapping[str, tuple[str, str]]
) -> tuple[str, Labels]:
    """The series a counter or histogram sample belongs to: its family and labels but ``le``."""
    family = families.get(name, (name, ""))[0]
    return family, tuple(kv for kv in labels if kv[0] != "le")


def _is_cumulative(name: str, families: Mapping[str, tuple[str, str]]) -> bool:
    kind = families.get(name, ("", ""))[1]
    return kind in ("counter", "histogram", "summary") and not name.endswith("_created")


def increase(now: Scrape, before: Scrape) -> Scrape:
    """How much each counter and histogram sample grew from ``before`` to ``now``.

    A series any of whose samples went down was reset (the process restarted): its increase
    is counted from zero, as Prometheus' ``rate()`` does. A series absent from ``before`` is
    new and counts from zero too. Gauges are left out."""
    reset: set[tuple[str, Labels]] = set()
    for (name, labels), value in now.samples.items():
        if _is_cumulative(name, now.families) and value < before.samples.get((name, labels), 0.0):
            reset.add(_series(name, labels, now.families))
    out = Scrape(now.at, families=now.families)
    for (name, labels), value in now.samples.items():
        if not _is_cumulative(name, now.families):
            continue
        if _series(name, labels, now.families) in reset:
            out.samples[(name, labels)] = value
        else:
            out.samples[(name, labels)] = value - before.samples.get((name, labels), 0.0)
    return out


class Window:
    """The scrapes of the last ``seconds``: rates and percentiles compare `newest` with `oldest`.

    A scrape older than the window is dropped once a newer one is inside it; when only the
    newest scrape is left inside (the window is shorter than the refresh, or scrapes failed
    for a while), the one before it stays as the baseline, so a frame always has two scrapes
    once two were taken (the header says how many seconds they span). At most
    ``max_scrapes`` are kept."""

    def __init__(self, seconds: float = 10.0, *, max_scrapes: int = 1024) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"window: {seconds!r} is not a positive number of seconds")
        if max_scrapes < 2:
            raise ValueError(f"max_scrapes: {max_scrapes!r}; a window needs two scrapes")
        self.seconds = seconds
        self._scrapes: deque[Scrape] = deque(maxlen=max_scrapes)

    def add(self, scrape: Scrape) -> None:
        """Add the newest scrape; `ValueError` if it is older than the last one added."""
        if self._scrapes and scrape.at < self._scrapes[-1].at:
            raise ValueError("scrapes must be added oldest first")
        self._scrapes.append(scrape)
        start = scrape.at - self.seconds
        while len(self._scrapes) > 2 and self._scrapes[0].at < start:
            self._scrapes.popleft()

    def __len__(self) -> int:
        return len(self._scrapes)

    @property
    def newest(self) -> Scrape | None:
        return self._scrapes[-1] if self._scrapes else None

    @property
    def oldest(self) -> Scrape | None:
        """The baseline of the rates; None until two scrapes were added."""
        return self._scrapes[0] if len(self._scrapes) >= 2 else None


MAX_SCRAPE_BYTES = 32 * 1024 * 1024
"""A page larger than this is not a brownout service's metrics; `fetch` refuses it rather than
hold it in memory."""


class ScrapeError(OSError):
    """The URL answered, but not with Prometheus metrics `brownout top` can read."""


def fetch(url: str, timeout: float = 5.0, *, at: float | None = None) -> Scrape:
    """GET ``url`` and parse it; `OSError` (`ScrapeError` for an answer that is not metrics)
    when it cannot be read. An HTTP error status is an `OSError` too."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise ScrapeError(f"not an http:// or https:// URL: {url!r}")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read(MAX_SCRAPE_BYTES + 1)
    if len(body) > MAX_SCRAPE_BYTES:
        raise ScrapeError(f"the page is larger than {MAX_SCRAPE_BYTES // 2**20} MiB")
    try:
        return parse(body.decode("utf-8"), at)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ScrapeError(f"not Prometheus text exposition: {exc}") from None


def _quantile(buckets: Mapping[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (le -> count) buckets."""
    items = sorted(buckets.items())
    if len(items) < 2 or not math.isinf(items[-1][0]) or items[-1][1] <= 0:
        return math.nan
    monotonic: list[tuple[float, float]] = []
    for le, count in items:  # as Prometheus does, a bucket below the one before is raised
        monotonic.append((le, max(count, monotonic[-1][1]) if monotonic else count))
    rank = q * monotonic[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in monotonic:
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
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _rate(count: float, seconds: float) -> str:
    return f"{count / seconds:.1f}"


def _tables(
    title: str,
    keys: Sequence[str],
    columns: Sequence[tuple[str, str]],
    rows: Sequence[tuple[Sequence[str], Sequence[str]]],
    width: int,
    empty: str = "",
) -> list[RenderableType]:
    """One table, or several sections of it, so that each fits ``width`` without cutting a
    header or a label: ``columns`` are (long, short) names, ``rows`` (keys, values). No rows:
    the line ``title: empty``, or nothing."""
    if not rows:
        return [Text(f"{title}: {empty}", style="italic", overflow="fold")] if empty else []
    names = [long if width >= _WIDE else short for long, short in columns]

    def natural(header: str, cells: Iterable[str]) -> int:
        return max([len(header), *(len(c) for c in cells)])

    # a long label folds onto more lines rather than pushing every figure into its own section
    cap = max(12, width // (2 * len(keys)))
    key_w = [min(natural(k, (r[0][i] for r in rows)), max(cap, len(k))) for i, k in enumerate(keys)]
    val_w = [natural(n, (r[1][i] for r in rows)) for i, n in enumerate(names)]
    sections: list[list[int]] = [[]]
    used = sum(key_w) + 3 * len(keys) + 1  # each column: its padding and one border
    for i, w in enumerate(val_w):
        if sections[-1] and used + w + 3 > width:
            sections.append([])
            used = sum(key_w) + 3 * len(keys) + 1
        sections[-1].append(i)
        used += w + 3
    out: list[RenderableType] = []
    for n, section in enumerate(sections):
        suffix = f" ({n + 1}/{len(sections)})" if len(sections) > 1 else ""
        out.append(Text(title + suffix, style="italic", overflow="fold"))
        table = Table(expand=False)
        for k, w in zip(keys, key_w):
            table.add_column(k, overflow="fold", max_width=w)
        for i in section:
            table.add_column(names[i], justify="right", overflow="fold")
        for key_cells, values in rows:
            table.add_row(*key_cells, *(values[i] for i in section))
        out.append(table)
    return out


def render(
    now: Scrape,
    before: Scrape | None = None,
    *,
    title: str = "",
    warning: str = "",
    width: int = 80,
) -> RenderableType:
    """One frame: rates and percentiles over ``before`` to ``now`` (counter and bucket
    increases), gauges from ``now``; "warming up" without ``before``. ``warning`` is shown
    above everything; tables are split into sections to fit ``width`` columns."""
    seconds = (now.at - before.at) if before is not None else 0.0
    window = increase(now, before) if before is not None and seconds > 0 else None

    parts: list[RenderableType] = []
    rows: list[tuple[Sequence[str], Sequence[str]]]
    head = Text(title or "brownout top", style="bold", overflow="fold")
    if window is not None:
        head.append(f"\nper second and percentiles over the last {seconds:.1f} s", style="dim")
    else:
        head.append("\nwarming up: rates and percentiles need a second scrape", style="yellow")
    if warning:
        head.append(f"\n{warning}", style="bold red")
    parts.append(head)

    if window is not None:
        fp = window.total("brownout_requests_shed_false_positive_total")
        if fp:
            parts.append(Text(f"FALSE-POSITIVE SHEDDING: {int(fp)} in the window", "bold red"))
        by = ("source", "operation")
        offered = window.sum("brownout_requests_offered_total", by)
        sums = {name: window.sum(name, by) for _, _, name in _WORK}
        work_rows = [
            (group, [_rate(sums[name].get(group, 0.0), seconds) for _, _, name in _WORK])
            for group in sorted(offered)
        ]
        cols = [(long, short) for long, short, _ in _WORK]
        parts.extend(_tables("Work per second", by, cols, work_rows, width, "no traffic"))

        shed = sorted(
            window.sum("brownout_requests_shed_total", ("reason",)).items(), key=lambda kv: -kv[1]
        )
        rows = [((reason,), [_rate(n, seconds)]) for (reason,), n in shed if n]
        parts.extend(_tables("Shed", ("reason",), [("per s", "per s")], rows, width, "none"))
        callers = sorted(
            window.sum("brownout_requests_shed_total", ("caller",)).items(), key=lambda kv: -kv[1]
        )
        rows = [((c,), [_rate(n, seconds)]) for (c,), n in callers[:5] if n]
        parts.extend(
            _tables("Shed by caller (top 5)", ("caller",), [("per s", "per s")], rows, width)
        )

        per_op: dict[str, dict[float, float]] = {}
        buckets = window.sum("brownout_success_latency_seconds_bucket", ("operation", "le"))
        for (op, le), n in buckets.items():
            per_op.setdefault(op, {})[float(le)] = n
        rows = []
        for op in sorted(per_op):
            b = per_op[op]
            qs = [_ms(_quantile(b, q)) for q in (0.5, 0.9, 0.99)]
            rows.append(((op,), [*qs, _fmt(b.get(math.inf, 0.0))]))
        cols = [("p50 ms", "p50 ms"), ("p90 ms", "p90 ms"), ("p99 ms", "p99 ms")]
        cols.append(("successes", "n"))
        parts.extend(
            _tables("Useful-success latency", ("operation",), cols, rows, width, "no successes")
        )

    gauges = {name: now.sum(name, ("source",)) for _, _, name in _CAPACITY}
    sources = sorted({g for values in gauges.values() for g in values})
    rows = [
        (
            source,
            [
                _fmt(gauges[name][source], 3 if "age" in label else 0)
                if source in gauges[name]
                else "-"
                for label, _, name in _CAPACITY
            ],
        )
        for source in sources
    ]
    cols = [(long, short) for long, short, _ in _CAPACITY]
    parts.extend(_tables("Capacity now", ("source",), cols, rows, width))

    state = Text(overflow="fold")
    open_breakers = [
        s for (s,), v in now.sum("brownout_breaker_state", ("source",), state="open").items() if v
    ]
    modes = [m for (m,), v in now.sum("brownout_degraded_mode_active", ("mode",)).items() if v]
    state.append("breakers open: ", style="bold")
    state.append(
        ", ".join(sorted(open_breakers)) or "none", style="red" if open_breakers else "green"
    )
    state.append("\ndegraded modes: ", style="bold")
    state.append(", ".join(sorted(modes)) or "none", style="yellow" if modes else "green")
    if window is not None:
        exhausted = window.total("brownout_retry_budget_exhausted_total")
        state.append(f"\nretry budget exhausted: {_rate(exhausted, seconds)}/s")
    parts.append(state)
    return Group(*parts)


def _seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds from ``low`` (excluded when 0) to ``high``."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (value >= low and value > 0 and value <= high):  # also false for NaN
            lowest = f"at least {low:g}" if low else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {lowest} and at most {high:g}")
        return value

    return seconds


def _url(text: str) -> str:
    if urlsplit(text).scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"not an http:// or https:// URL: {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``brownout top`` (shared with the ``brownout`` parser's completion)."""
    parser.add_argument(
        "url",
        nargs="?",
        type=_url,
        default="http://127.0.0.1:8000/metrics",
        help="the service's Prometheus metrics page",
    )
    parser.add_argument(
        "--interval", type=_seconds(0.1, 3600), default=2.0, help="seconds between refreshes"
    )
    parser.add_argument(
        "--window",
        type=_seconds(0.1, 3600),
        default=10.0,
        help="rates and latency percentiles cover this many recent seconds",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds(0, 300),
        default=None,
        help="seconds one scrape may take, shorter than --interval (default: 80%% of --interval)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="scrape twice, --interval apart, print one frame and exit",
    )
    parser.add_argument(
        "--count",
        type=int,
        default=None,
        metavar="N",
        help="exit after N refreshes (default: run until Ctrl-C)",
    )


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``brownout top``."""
    p = argparse.ArgumentParser(
        prog="brownout top",
        description="A live terminal view of a service's brownout metrics: work, shedding, "
        "latency and capacity per second over a recent window.",
        formatter_class=HelpFormatter,
        epilog="exit status: 0 ok, 2 usage error, 3 the metrics page could not be read "
        "(the first scrape, or the last one of --once or --count), 4 the top extra is not "
        "installed",
    )
    add_arguments(p)
    return p


EXIT_OK, EXIT_UNREACHABLE = 0, 3  # as in brownout._cli (usage errors: argparse's 2)


def run(
    url: str,
    *,
    interval: float = 2.0,
    window: float = 10.0,
    timeout: float | None = None,
    once: bool = False,
    count: int | None = None,
    console: Console | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    scrape: Callable[[str, float, float], Scrape] | None = None,
) -> int:
    """Scrape ``url`` every ``interval`` seconds and show a frame after each scrape; the exit
    status. A failed scrape keeps the last good frame on screen under a warning line."""
    console = console or Console()
    timeout = interval * 0.8 if timeout is None else timeout
    get = scrape or (lambda u, t, at: fetch(u, t, at=at))
    frames = Window(window)
    last_good = last_start = 0.0
    warning = ""
    refreshes = 2 if once else count

    def attempt() -> bool:
        nonlocal last_good, last_start, warning
        started = last_start = clock()
        try:
            frames.add(get(url, timeout, started))
        except OSError as exc:
            if frames.newest is None:
                warning = f"cannot read {url}: {_why(exc)}"
            else:
                age = started - last_good
                warning = (
                    f"WARNING: cannot read {url}: {_why(exc)}; "
                    f"showing the last good scrape, from {age:.1f} s ago"
                )
            return False
        last_good, warning = started, ""
        return True

    def frame() -> RenderableType:
        assert frames.newest is not None
        return render(
            frames.newest,
            frames.oldest,
            title=f"brownout top {url}",
            warning=warning,
            width=console.width,
        )

    if not attempt():
        print(f"brownout top: {warning}", file=sys.stderr)
        return EXIT_UNREACHABLE
    done, ok = 1, True

    def wait() -> None:  # the next scrape starts one interval after the last one started
        sleep(max(0.0, last_start + interval - clock()))

    try:
        if console.is_terminal and not once:
            from rich.live import Live

            with Live(frame(), console=console, auto_refresh=False) as screen:
                while refreshes is None or done < refreshes:
                    wait()
                    ok = attempt()
                    done += 1
                    screen.update(frame(), refresh=True)
        else:  # a pipe or a log, or --once: frames one after another
            if not once:
                console.print(frame())
            while refreshes is None or done < refreshes:
                wait()
                ok = attempt()
                done += 1
                console.print(frame())
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK if ok else EXIT_UNREACHABLE


def _why(exc: OSError) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    reason = getattr(exc, "reason", None)  # urllib's URLError wraps the socket's error
    return str(reason if reason is not None and not isinstance(exc, ScrapeError) else exc)


def main(argv: list[str]) -> int:
    """Entry point of ``brownout top``; returns the process exit status."""
    p = parser()
    args = p.parse_args(argv)
    if args.timeout is not None and args.timeout >= args.interval:
        p.error(f"--timeout {args.timeout:g} must be shorter than --interval {args.interval:g}")
    if args.count is not None and args.count < 1:
        p.error(f"--count {args.count}: must be at least 1")
    return run(
        args.url,
        interval=args.interval,
        window=args.window,
        timeout=args.timeout,
        once=args.once,
        count=args.count,
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
