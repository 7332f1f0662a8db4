"""The server's view beside the client's: brownout's own counters, scraped during a lab run.

When the service under test exposes brownout's Prometheus metrics (`brownout.export.prometheus`),
a `ServerWatch` scrapes them every `SCRAPE_PERIOD` seconds while a plan runs. Each scrape is
reduced to brownout's request counters (offered, admitted, shed by reason, expired by stage,
completed, retries) and read at the edges of every step's steady window by linear
interpolation between the scrapes around each edge, so the server's figures cover the same
seconds as the client's. `compare_step` then sets them beside what the client saw and flags
a figure that differs by more than a tolerance.

The text format is parsed here (`parse_metrics`), strictly: the lab does not need
prometheus_client. A metrics endpoint that cannot be read never stops a run: it becomes a
note in the report (`ScrapeError`).
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

__all__ = [
    "ABSOLUTE_SLACK",
    "RELATIVE_TOLERANCE",
    "SCRAPE_PERIOD",
    "SCRAPE_TIMEOUT",
    "SERVER_COLUMNS",
    "MetricsFormatError",
    "Sample",
    "ScrapeError",
    "ServerWatch",
    "add_server_view",
    "agreement",
    "compare_step",
    "figures_of",
    "parse_metrics",
    "resolve_metrics_url",
    "scrape",
    "server_notes",
    "server_rows",
    "step_figures",
]

SCRAPE_PERIOD = 0.5
"""Seconds between scrapes while a plan runs (the edges are interpolated between them)."""
SCRAPE_TIMEOUT = 1.0
"""Seconds a scrape may take before it counts as failed (an overloaded server answers late)."""
RELATIVE_TOLERANCE = 0.05
ABSOLUTE_SLACK = 5
"""A figure disagrees when server and client differ by more than `RELATIVE_TOLERANCE` of the
larger and by more than `ABSOLUTE_SLACK` requests: requests in flight at a window's edges
are counted by one side in this step and by the other in the next."""
EDGE_NOTED = 0.1
"""Seconds between a window's edge and its nearest scrape past which the table says so (the
edge scrape failed or was late: the figure is partly interpolated)."""
EXPIRY_REASONS = frozenset({"deadline_expired", "outcome_unknown"})
"""Shed reasons brownout answers 504 by default (``EdgePolicy.expired_status``), not 503."""

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class MetricsFormatError(ValueError):
    """Text that is not the Prometheus text exposition format; the message names the line."""


class ScrapeError(Exception):
    """A metrics endpoint that could not be read: unreachable, a non-200 answer, or not the
    Prometheus text format. ``kind`` says which (``unreachable``, ``http``, ``format``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Sample:
    """One sample line: a metric name, its labels, its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str:
        return dict(self.labels).get(key, "")


def _unescape(text: str, line: int) -> str:
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1 : i + 2]
            if nxt not in _ESCAPES:
                raise MetricsFormatError(f"line {line}: bad escape \\{nxt} in a label value")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _labels(text: str, line: int) -> tuple[tuple[str, str], ...]:
    labels: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip(" \t")
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise MetricsFormatError(f"line {line}: malformed labels {{{text}}}")
        labels.append((m.group(1), _unescape(m.group(2), line)))
        pos = m.end()
    names = [k for k, _ in labels]
    if len(set(names)) != len(names):
        raise MetricsFormatError(f"line {line}: a label appears twice")
    return tuple(labels)


def _value(text: str, line: int) -> float:
    special = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    try:
        return float(text)
    except ValueError:
        raise MetricsFormatError(f"line {line}: {text!r} is not a number") from None


def parse_metrics(text: str) -> list[Sample]:
    """The samples of a Prometheus text-format page (version 0.0.4; an OpenMetrics ``# EOF``
    is accepted); `MetricsFormatError` names the first line that is not well formed."""
    samples: list[Sample] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            typed = len(parts) >= 2 and parts[1] == "TYPE"
            if typed and (len(parts) != 4 or not re.fullmatch(_NAME, parts[2])):
                raise MetricsFormatError(f"line {number}: malformed # TYPE line")
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise MetricsFormatError(f"line {number}: not a sample: {line[:80]!r}")
        name, labels, value, _ = m.groups()
        samples.append(
            Sample(name, _labels(labels, number) if labels else (), _value(value, number))
        )
    return samples


# -- figures -------------------------------------------------------------------------------

_COUNTERS = {
    "brownout_requests_offered_total": "offered",
    "brownout_requests_admitted_total": "admitted",
    "brownout_requests_completed_total": "completed",
    "brownout_requests_completed_late_total": "completed_late",
    "brownout_requests_failed_total": "failed",
    "brownout_retries_total": "retried",
    "brownout_retry_budget_exhausted_total": "budget_exhausted",
    "brownout_requests_shed_retry_total": "shed_retry",
}
"""Counters of `brownout.export._catalog` read as they are (summed over their labels)."""
_BY_LABEL = {
    "brownout_requests_shed_total": ("shed", "reason"),
    "brownout_requests_expired_total": ("expired", "stage"),
}
"""Counters read per value of one label: ``shed.queue_full``, ``expired.queue``."""
_OUTBOUND = frozenset({"retried", "budget_exhausted"})
"""Figures of a service's calls out (a `Dependency`'s source), not of its inbound hop."""
QUEUE_DEPTH = "brownout_queue_depth_requests"


def figures_of(samples: list[Sample], source: str | None = None) -> dict[str, float]:
    """brownout's request counters in one scrape, flat (``offered``, ``shed.<reason>``,
    ``expired.<stage>``, ...) and summed over the other labels; ``source``: only the inbound
    series of that source (a bulkhead's or an edge's name), as a service with several hops
    counts a request at each (retries are outbound, their source a dependency's: all kept);
    ``queue_depth``: the sum of the queue-depth gauges, when exported."""
    out: dict[str, float] = {}
    for s in samples:
        key = _COUNTERS.get(s.name)
        outbound = key in _OUTBOUND
        if source is not None and not outbound and s.label("source") not in (source, ""):
            continue
        if key is None and s.name in _BY_LABEL:
            prefix, label = _BY_LABEL[s.name]
            key = f"{prefix}.{s.label(label) or 'unknown'}"
        elif key is None and s.name == QUEUE_DEPTH:
            key = "queue_depth"
        if key is None:
            continue
        out[key] = out.get(key, 0.0) + s.value
    return out


def resolve_metrics_url(metrics_url: str, base_url: str) -> str:
    """``metrics_url`` as an absolute URL: a path is taken on ``base_url``'s host and port."""
    if metrics_url.startswith("/"):
        return urljoin(base_url, metrics_url)
    parts = urlsplit(metrics_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"metrics_url must be a path or an http(s):// URL, not {metrics_url!r}")
    return metrics_url


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT) -> list[Sample]:
    """GET ``url`` and parse it; `ScrapeError` when that fails, whatever the cause."""
    request = urllib.request.Request(url, headers={"accept": "text/plain; version=0.0.4"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        raise ScrapeError("http", f"{url} answered HTTP {e.code}") from None
    except (OSError, ValueError) as e:  # refused, reset, timed out, DNS, bad URL
        reason = getattr(e, "reason", None) or e
        raise ScrapeError("unreachable", f"{url} could not be read: {reason}") from None
    try:
        return parse_metrics(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ScrapeError("format", f"{url}: not UTF-8 text (compressed?)") from None
    except MetricsFormatError as e:
        raise ScrapeError("format", f"{url}: not the Prometheus text format: {e}") from None


@dataclass
class ServerWatch:
    """Scrapes ``url`` every ``period`` seconds in a thread while ``running``, and at the
    times `expect` names (a step's edges: the counters change rate there, so a read on the
    edge beats an interpolation across it); keeps each scrape's figures with the
    `time.monotonic` midpoint of its request."""

    url: str
    source: str | None = None
    period: float = SCRAPE_PERIOD
    timeout: float = SCRAPE_TIMEOUT
    points: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    failures: int = 0
    first_error: ScrapeError | None = None
    _due: list[float] = field(default_factory=list, repr=False)
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def scrape_once(self) -> None:
        before = time.monotonic()
        try:
            samples = scrape(self.url, self.timeout)
        except ScrapeError as e:
            self.failures += 1
            self.first_error = self.first_error or e
            return
        self.points.append(((before + time.monotonic()) / 2, figures_of(samples, self.source)))

    def expect(self, *times: float) -> None:
        """Scrape also at these `time.monotonic` times (those already past: at once)."""
        with self._changed:
            self._due = sorted([*self._due, *times])
            self._changed.notify()

    @contextlib.contextmanager
    def running(self) -> Iterator[ServerWatch]:
        stopped = False

        def loop() -> None:
            periodic = time.monotonic()
            while True:
                with self._changed:
                    while not stopped:
                        now = time.monotonic()
                        due = min(periodic, self._due[0] if self._due else periodic)
                        if due <= now:
                            break
                        self._changed.wait(due - now)
                    if stopped:
                        break
                    now = time.monotonic()
                    self._due = [t for t in self._due if t > now]
                self.scrape_once()
                if time.monotonic() >= periodic:
                    periodic = time.monotonic() + self.period
            self.scrape_once()  # one after the plan's end: the last edge is bracketed

        thread = threading.Thread(target=loop, name="server-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            with self._changed:
                stopped = True
                self._changed.notify()
            thread.join(self.timeout * 2 + self.period)

    def summary(self) -> dict[str, Any]:
        """What the watch did, for the report: the URL, scrapes, failures and the note."""
        note = None
        if self.first_error is not None:
            note = f"{self.first_error.kind}: {self.first_error}"
            if not self.points:
                note = f"no server view: {note}"
        return {
            "url": self.url,
            "source": self.source,
            "scrapes": len(self.points),
            "failures": self.failures,
            "note": note,
        }


def _at(points: list[tuple[float, dict[str, float]]], t: float) -> tuple[dict[str, float], float]:
    """Counters at ``t``, interpolated between the scrapes around it (the nearest scrape when
    ``t`` is outside them); and how far ``t`` is from the nearest scrape, seconds (how much
    of the reading is interpolation)."""
    after = next((i for i, (pt, _) in enumerate(points) if pt >= t), None)
    if after is None:
        return points[-1][1], t - points[-1][0]
    if after == 0:
        return points[0][1], points[0][0] - t
    (t0, v0), (t1, v1) = points[after - 1], points[after]
    w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
    keys = v0.keys() | v1.keys()
    value = {k: v0.get(k, 0.0) + (v1.get(k, 0.0) - v0.get(k, 0.0)) * w for k in keys}
    return value, min(t - t0, t1 - t)


def step_figures(
    points: list[tuple[float, dict[str, float]]], start: float, end: float
) -> dict[str, Any] | None:
    """The server's counts over [``start``, ``end``] (monotonic seconds), or None without
    scrapes. Counters are interpolated at both edges; ``queue_depth_max`` is the largest
    queue depth scraped inside the window (None when no gauge is exported); ``edge_s`` how
    far an edge was from its nearest scrape (the larger of the two), seconds."""
    if not points:
        return None
    (a, gap_a), (b, gap_b) = _at(points, start), _at(points, end)

    def delta(key: str) -> int:
        # A counter that went down means the server restarted: count from zero.
        later, earlier = b.get(key, 0.0), a.get(key, 0.0)
        return round(later - earlier if later >= earlier else later)

    def by(prefix: str) -> dict[str, int]:
        keys = sorted(k for k in a.keys() | b.keys() if k.startswith(prefix + "."))
        counts = {k.split(".", 1)[1]: delta(k) for k in keys}
        return {k: n for k, n in counts.items() if n}

    depths = [v["queue_depth"] for t, v in points if start <= t <= end and "queue_depth" in v]
    out: dict[str, Any] = {k: delta(k) for k in _COUNTERS.values()}
    out["shed"] = by("shed")
    out["expired"] = by("expired")
    out["queue_depth_max"] = round(max(depths)) if depths else None
    out["edge_s"] = round(max(gap_a, gap_b), 3)
    return out


# -- server beside client ------------------------------------------------------------------


def agreement(
    server: float, client: float, tolerance: float = RELATIVE_TOLERANCE, slack: int = ABSOLUTE_SLACK
) -> bool:
    """True unless the two counts differ by more than ``tolerance`` of the larger and by more
    than ``slack`` requests."""
    diff = abs(server - client)
    return diff <= slack or diff <= tolerance * max(abs(server), abs(client))


def _client(step: Mapping[str, Any]) -> dict[str, Any]:
    s, r = step["steady"], step.get("retries") or {}
    reasons = dict(s.get("shed_reasons") or {})
    for reason, n in (r.get("shed_reasons") or {}).items():
        reasons[reason] = reasons.get(reason, 0) + n
    return {
        "offered": s["sent"] + r.get("sent", 0),
        "refused": s["r429"] + s["r503"] + r.get("r429", 0) + r.get("r503", 0),
        "expired": s["r504"] + r.get("r504", 0),
        "shed": reasons,
    }


def compare_step(
    step: Mapping[str, Any], tolerance: float = RELATIVE_TOLERANCE
) -> list[dict[str, Any]]:
    """The figures both sides count, server beside client, each with ``agrees``:

    - ``offered``: what the server was offered; the client's requests (and retries) sent;
    - ``refused``: the server's refusals answered 503/429; the client's 503s and 429s;
    - ``expired``: the server's expiries (queue and running) and refusals answered 504; the
      client's 504s.

    Empty when the step has no server figures."""
    server = step.get("server")
    if not server:
        return []
    client = _client(step)
    shed = server["shed"]
    expiry = sum(n for reason, n in shed.items() if reason in EXPIRY_REASONS)
    pairs = (
        ("offered", server["offered"], client["offered"]),
        ("refused", sum(shed.values()) - expiry, client["refused"]),
        ("expired", sum(server["expired"].values()) + expiry, client["expired"]),
    )
    return [
        {"figure": f, "server": s, "client": c, "agrees": agreement(s, c, tolerance)}
        for f, s, c in pairs
    ]


def add_server_view(run: dict[str, Any], watch: ServerWatch, origin: float) -> None:
    """Attach the server's figures to each step of ``run`` (``step["server"]``, None without
    scrapes) over the step's steady window, with ``server_agrees`` (`compare_step` at the
    default tolerance), and what the watch did as ``run["server_view"]``. ``origin``: the
    plan's start on `time.monotonic` (the generator's clock: one clock per machine on Linux)."""
    for step in run["steps"]:
        start = origin + float(step["start"])
        window = (start + float(step["settle"]), start + float(step["duration"]))
        step["server"] = step_figures(watch.points, *window)
        rows = compare_step(step)
        step["server_agrees"] = all(r["agrees"] for r in rows) if rows else None
    run["server_view"] = watch.summary()


# -- the report's table ----------------------------------------------------------------------

SERVER_COLUMNS = (
    "configuration",
    "step",
    "offered server/client",
    "refused server/client",
    "expired server/client",
    "shed by reason server/client",
    "admitted",
    "completed (late)",
    "retried (budget exhausted)",
    "queue depth max",
    "agrees",
)


def _reasons(server: Mapping[str, int], client: Mapping[str, int]) -> str:
    names = sorted(set(server) | set(client))
    return ", ".join(f"{n} {server.get(n, 0)}/{client.get(n, 0)}" for n in names) or "-"


def server_rows(lab: Mapping[str, Any], scenario: str) -> list[list[str]]:
    """One row per step with the server's figures, in `SERVER_COLUMNS` order; a step that
    disagrees says on which figures."""
    rows = []
    for run in lab["runs"]:
        if run["scenario"] != scenario or "server_view" not in run:
            continue
        for step in run["steps"]:
            server = step.get("server")
            if not server:
                rows.append([run["configuration"], step["label"], *["-"] * 8, "no scrapes"])
                continue
            pairs = {r["figure"]: r for r in compare_step(step)}
            wrong = [f for f, r in pairs.items() if not r["agrees"]]
            verdict = "yes" if not wrong else "NO: " + ", ".join(wrong)
            if server["edge_s"] > EDGE_NOTED:
                verdict += f" (an edge read {server['edge_s']:.1f} s from a scrape)"
            depth = server["queue_depth_max"]
            rows.append(
                [
                    run["configuration"],
                    step["label"],
                    *(f"{pairs[f]['server']}/{pairs[f]['client']}" for f in pairs),
                    _reasons(server["shed"], _client(step)["shed"]),
                    str(server["admitted"]),
                    f"{server['completed']} ({server['completed_late']})",
                    f"{server['retried']} ({server['budget_exhausted']})",
                    "-" if depth is None else str(depth),
                    verdict,
                ]
            )
    return rows


def server_notes(lab: Mapping[str, Any]) -> list[str]:
    """One line per run whose metrics endpoint failed (some scrapes, or all of them)."""
    out = []
    for run in lab["runs"]:
        view = run.get("server_view")
        if view and view["note"]:
            out.append(
                f"{run['configuration']} / {run['scenario']}: {view['note']} "
                f"({view['failures']} failed scrapes, {view['scrapes']} read)"
            )
    return out
