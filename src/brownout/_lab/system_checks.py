"""Whole-system checks: invariants on what the service, its clients and its dependency did,
beside the per-step goodput and latency checks of `brownout._lab.verdict` (issue 31).

Five kinds of a scenario file's ``[[invariants]]`` (docs/lab.md lists their keys):

- ``queue_bounded``: the server's queue depth (and oldest queued age) stay under a bound,
  from its ``brownout_queue_depth_requests`` / ``brownout_queue_oldest_age_seconds`` gauges;
- ``retry_budget``: retries (the clients' plus the server's ``brownout_retries_total``)
  stay within a ratio of the original requests plus a floor per second;
- ``priority_goodput_stable``: a class's goodput in the named steps keeps a share of its
  goodput in a baseline step;
- ``no_thundering_herd``: arrivals at the dependency per 100 ms stay under a multiple of its
  capacity per 100 ms (from `brownout proxy`'s arrival bins, or the demo backend's);
- ``late_success_reconciled``: work that succeeded after the client's timeout is answered by
  replay when retried with its idempotency key, never applied twice.

The checks read figures already attached to the lab's JSON (``step["system"]``,
``step["dependency"]``, ``run["system"]``, the payments scenario's counts): they run on
virtual data in tests and re-run on a saved report. A figure that was never measured gives
the status ``not measured``, which is not a pass. `SystemObserver` gathers the figures while
a scenario file runs against a user's service.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from . import server_view

__all__ = [
    "HERD_BIN_SECONDS",
    "NOT_MEASURED",
    "SYSTEM_CHECKS",
    "SystemObserver",
    "late_success_check",
    "parse_metrics",
    "parse_system_invariant",
    "queue_gauges",
    "retries_counter",
    "scrape_metrics",
    "system_checks",
    "system_keys",
]

NOT_MEASURED = "not measured"
"""A check's status when its figures were not available: not a pass."""
HERD_BIN_SECONDS = 0.1
"""Width of the arrival bins `no_thundering_herd` judges."""
SCRAPE_INTERVAL = 0.25
"""Seconds between two scrapes of the target's metrics while a scenario runs."""
MAX_SCRAPES = 20_000
"""Scrapes kept per URL (about 80 minutes at `SCRAPE_INTERVAL`): bounded memory."""
DEPTH_GAUGE = "brownout_queue_depth_requests"
AGE_GAUGE = "brownout_queue_oldest_age_seconds"
RETRIES_COUNTER = "brownout_retries_total"

Check = dict[str, Any]
Fail = Callable[[str, str], Exception]


@dataclass(frozen=True)
class _Kind:
    bound: str
    """The threshold's key: ``max`` or ``min``."""
    share: bool
    """The threshold is a share (0..1)."""
    numbers: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    default: float | None = None
    """The threshold when the file gives none (None: required)."""


SYSTEM_CHECKS: dict[str, _Kind] = {
    "queue_bounded": _Kind("max", False, ("max_age",), ("metrics",)),
    "retry_budget": _Kind("max", False, ("min_per_second", "window"), ("metrics",)),
    "priority_goodput_stable": _Kind("min", True),
    "no_thundering_herd": _Kind("max", False, ("capacity",), ("proxy",)),
    "late_success_reconciled": _Kind("max", False, (), ("source",), default=0.0),
}
"""The whole-system invariant kinds: threshold key, and the extra keys each one reads."""


def _number(table: Mapping[str, Any], key: str, fail: Fail, *, positive: bool) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(key, f"must be a number, not {type(value).__name__}")
    if value < 0 or (positive and value == 0):
        raise fail(key, f"must be {'>' if positive else '>='} 0")
    return float(value)


def _url(table: Mapping[str, Any], key: str, fail: Fail) -> str:
    value = table[key]
    if not isinstance(value, str) or urlsplit(value).scheme not in ("http", "https"):
        raise fail(key, "must be an http:// or https:// URL")
    return value


def parse_system_invariant(
    check: str, table: Mapping[str, Any], fail: Fail, labels: set[str]
) -> tuple[float, dict[str, Any]]:
    """(threshold, options) of a whole-system invariant's TOML table; ``fail(key, problem)``
    builds the error naming the field. ``class`` and ``steps`` are read by the caller."""
    kind = SYSTEM_CHECKS[check]
    other = "min" if kind.bound == "max" else "max"
    if other in table:
        raise fail(other, f"{check} takes {kind.bound} = ..., not {other}")
    if kind.bound in table:
        threshold = _number(table, kind.bound, fail, positive=check == "no_thundering_herd")
    elif kind.default is not None:
        threshold = kind.default
    else:
        raise fail(kind.bound, "is required")
    if kind.share and threshold > 1:
        raise fail(kind.bound, "is a share: between 0 and 1")
    options: dict[str, Any] = {}
    for key in kind.numbers:
        if key in table:
            options[key] = _number(table, key, fail, positive=True)
    for key in kind.urls:
        if key in table:
            options[key] = _url(table, key, fail)
    if check == "priority_goodput_stable":
        baseline = table.get("baseline")
        if not isinstance(baseline, str):
            raise fail("baseline", "is required: the label of the step to compare with")
        if baseline not in labels:
            raise fail("baseline", f"no step is labelled {baseline!r} (labels: {sorted(labels)})")
        options["baseline"] = baseline
    return threshold, options


def system_keys(check: str) -> tuple[str, ...]:
    """The TOML keys a whole-system invariant may carry besides ``check`` and ``steps``."""
    kind = SYSTEM_CHECKS[check]
    extra = ("class", "baseline") if check == "priority_goodput_stable" else ()
    return ("min", "max", *kind.numbers, *kind.urls, *extra)


# -- the server's metrics -------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{series: value}`` (series: the name with its labels, as
    ``name{key="value",...}``), read by the server view's strict parser
    (`brownout._lab.server_view.parse_metrics`: a malformed page is a `ValueError`)."""
    out: dict[str, float] = {}
    for sample in server_view.parse_metrics(text):
        labels = ",".join(f'{k}="{v}"' for k, v in sample.labels)
        out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _family(samples: Mapping[str, float], name: str) -> list[float]:
    return [v for k, v in samples.items() if k == name or k.startswith(name + "{")]


def queue_gauges(samples: Mapping[str, float]) -> tuple[float, float] | None:
    """(deepest queue, oldest queued age in seconds) over every bulkhead of one scrape; None
    when the scrape has no queue gauge."""
    depth, age = _family(samples, DEPTH_GAUGE), _family(samples, AGE_GAUGE)
    if not depth and not age:
        return None
    return max(depth, default=0.0), max(age, default=0.0)


def retries_counter(samples: Mapping[str, float]) -> float | None:
    """The server's outbound retries so far (every cause), or None when it reports none."""
    values = _family(samples, RETRIES_COUNTER)
    return sum(values) if values else None


def scrape_metrics(url: str, timeout: float = 2.0) -> dict[str, float] | None:
    """One scrape of ``url`` (Prometheus text), or None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_metrics(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def _get_json(url: str, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


# -- gathering the figures while a scenario file runs ---------------------------------------


class SystemObserver:
    """Gathers the figures a scenario file's whole-system invariants need, for one run
    against a user's service: scrapes of the server's metrics every `SCRAPE_INTERVAL` on a
    thread (``scrape``: the function that reads one), the proxy's arrival bins and the
    idempotency counts once at the end. ``metrics_default``: the URL of invariants that name
    none. Use ``with``, then `attach` the figures to the run."""

    def __init__(
        self,
        invariants: Iterable[Mapping[str, Any]],
        metrics_default: str,
        scrape: Callable[[str], Mapping[str, float] | None] = scrape_metrics,
    ) -> None:
        self.invariants = [i for i in invariants if i["check"] in SYSTEM_CHECKS]
        self._scrape = scrape
        urls = {
            (i.get("options") or {}).get("metrics", metrics_default)
            for i in self.invariants
            if i["check"] in ("queue_bounded", "retry_budget")
        }
        self.samples: dict[str, deque[tuple[float, Mapping[str, float]]]] = {
            u: deque(maxlen=MAX_SCRAPES) for u in sorted(urls)
        }
        self.metrics_default = metrics_default
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SystemObserver:
        if self.samples:
            self._thread = threading.Thread(
                target=self._loop, name="brownout-lab-scrape", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for url, kept in self.samples.items():
                at = time.monotonic()
                got = self._scrape(url)
                if got is not None:
                    kept.append((at, got))
            self._stop.wait(SCRAPE_INTERVAL)

    def attach(self, run: dict[str, Any]) -> None:
        """Per step ``step["system"]``, per run ``run["system"]``: the figures each declared
        invariant reads, on the generator's clock (``run["origin"]``, ``time.monotonic``)."""
        origin = float(run.get("origin", 0.0))
        proxies: dict[str, Any] = {}
        idempotency: dict[str, Any] = {}
        for inv in self.invariants:
            options = inv.get("options") or {}
            if inv["check"] == "no_thundering_herd" and "proxy" in options:
                url = options["proxy"].rstrip("/") + "/arrivals"
                proxies.setdefault(options["proxy"], _get_json(url))
            if inv["check"] == "late_success_reconciled" and "source" in options:
                idempotency.setdefault(options["source"], _get_json(options["source"]))
        for step in run["steps"]:
            start = origin + float(step["start"])
            end = start + float(step["duration"])
            figures: dict[str, Any] = {"metrics": {}, "arrivals": {}}
            for url, kept in self.samples.items():
                figures["metrics"][url] = _metric_figures(
                    [s for at, s in kept if start <= at < end]
                )
            for url, answer in proxies.items():
                figures["arrivals"][url] = _busiest_bin(answer, start, end)
            step["system"] = figures
        run["system"] = {"idempotency": idempotency}


def _metric_figures(window: list[Mapping[str, float]]) -> dict[str, Any]:
    queues = [q for q in (queue_gauges(s) for s in window) if q is not None]
    retries = [r for r in (retries_counter(s) for s in window) if r is not None]
    return {
        "scrapes": len(window),
        "queue_depth_max": max((d for d, _ in queues), default=None),
        "queue_age_max": max((a for _, a in queues), default=None),
        "server_retries": max(retries) - min(retries) if len(retries) >= 2 else None,
    }


def _busiest_bin(answer: Any, start: float, end: float) -> dict[str, Any] | None:
    """The busiest `HERD_BIN_SECONDS` bin between ``start`` and ``end`` of a proxy's
    ``/arrivals`` answer (None when the answer is missing or covers none of it)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("bins"), list):
        return None
    width = float(answer.get("bin_seconds") or HERD_BIN_SECONDS)
    first, last = math.floor(start / width), math.floor(end / width)
    oldest = int(answer.get("oldest_bin", min(int(k) for k, _ in answer["bins"])))
    if oldest > first:
        return None  # the ring no longer holds the whole step
    counts = [int(n) for k, n in answer["bins"] if first <= int(k) < last]
    return {"bin_seconds": width, "max": max(counts, default=0), "bins": last - first}


# -- the checks -----------------------------------------------------------------------------


def _result(
    run: Mapping[str, Any],
    step: Mapping[str, Any] | None,
    name: str,
    value: float | None,
    limit: float,
    passed: bool | None,
    unit: str,
    note: str = "",
) -> Check:
    """A check in `brownout._lab.verdict`'s shape; ``passed`` None: not measured."""
    bound = list(step.get("host_bound") or []) if step is not None else []
    if passed is None:
        status, ok = NOT_MEASURED, False
    else:
        status = "failed" if not passed else "host-bound" if bound else "passed"
        ok = passed and not bound
    out: Check = {
        "configuration": run["configuration"],
        "scenario": run["scenario"],
        "step": step["label"] if step is not None else "whole run",
        "check": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "passed": ok,
        "status": status,
        "host_bound": bound if passed is not None else [],
        "generator_late": bool(step is not None and not step.get("valid", True)),
    }
    if note:
        out["note"] = note
    return out


def _chosen(inv: Mapping[str, Any], run: Mapping[str, Any]) -> list[dict[str, Any]]:
    labels = inv.get("steps") or ()
    steps: list[dict[str, Any]] = run["steps"]
    return [s for s in steps if not labels or s["label"] in labels]


def _metrics_of(step: Mapping[str, Any], url: str | None) -> Mapping[str, Any] | None:
    metrics = (step.get("system") or {}).get("metrics") or {}
    if url is not None:
        found: Mapping[str, Any] | None = metrics.get(url)
        return found
    return next(iter(metrics.values()), None)


def _queue(inv: Mapping[str, Any], run: Mapping[str, Any]) -> list[Check]:
    options = inv.get("options") or {}
    limit = float(inv["threshold"])
    max_age = options.get("max_age")
    out = []
    for step in _chosen(inv, run):
        m = _metrics_of(step, options.get("metrics"))
        depth = None if m is None else m.get("queue_depth_max")
        name = f"queue depth <= {limit:g} (server metrics)"
        if depth is None:
            out.append(_result(run, step, name, None, limit, None, "requests", "no queue gauge"))
        else:
            out.append(_result(run, step, name, depth, limit, depth <= limit, "requests"))
        if max_age is not None:
            age = None if m is None else m.get("queue_age_max")
            name = f"oldest queued <= {max_age:g} s (server metrics)"
            passed = None if age is None else age <= max_age
            out.append(_result(run, step, name, age, max_age, passed, "s"))
    return out


def _retries(inv: Mapping[str, Any], run: Mapping[str, Any]) -> list[Check]:
    options = inv.get("options") or {}
    ratio = float(inv["threshold"])
    floor = float(options.get("min_per_second", 1.0))
    # A budget lets its floor's whole window (RetryBudget's default: 10 s) go at once.
    window = float(options.get("window", 10.0))
    out = []
    for step in _chosen(inv, run):
        originals = int(step["steady"]["offered"])
        client = step.get("retries") or {}
        m = _metrics_of(step, options.get("metrics"))
        server = None if m is None else m.get("server_retries")
        if not client and server is None:
            out.append(
                _result(run, step, "retries within budget", None, 0, None, "retries", "no count")
            )
            continue
        retries = int(client.get("offered", 0)) + int(server or 0)
        seconds = float(step.get("steady_seconds") or 0.0)
        limit = round(ratio * originals + floor * max(seconds, window), 1)
        whose = "client + server" if server is not None else "client"
        name = f"retries ({whose}) <= {ratio:g} x originals + {floor:g}/s"
        out.append(_result(run, step, name, retries, limit, retries <= limit, "retries"))
    return out


def _class_goodput(step: Mapping[str, Any], members: list[str]) -> float | None:
    figures = [step["classes"][n] for n in members if n in step.get("classes", {})]
    if not figures:
        return None
    return float(sum(f["goodput_per_s"] for f in figures))


def _priority(inv: Mapping[str, Any], run: Mapping[str, Any], members: list[str]) -> list[Check]:
    options = inv.get("options") or {}
    share = float(inv["threshold"])
    name_of = inv.get("traffic_class") or ", ".join(members)
    baseline_label = options["baseline"]
    baseline = next((s for s in run["steps"] if s["label"] == baseline_label), None)
    base = None if baseline is None else _class_goodput(baseline, members)
    out = []
    for step in _chosen(inv, run):
        if step["label"] == baseline_label:
            continue
        goodput = _class_goodput(step, members)
        name = f"{name_of} goodput >= {share:.0%} of its goodput in {baseline_label!r}"
        if base is None or goodput is None or base <= 0:
            note = "no baseline goodput" if goodput is not None else "class not offered"
            out.append(_result(run, step, name, goodput, 0.0, None, "req/s", note))
            continue
        limit, goodput = round(share * base, 1), round(goodput, 1)
        out.append(_result(run, step, name, goodput, limit, goodput >= limit, "req/s"))
    return out


def _herd(inv: Mapping[str, Any], run: Mapping[str, Any], capacity: float | None) -> list[Check]:
    options = inv.get("options") or {}
    factor = float(inv["threshold"])
    capacity = options.get("capacity", capacity)
    proxy = options.get("proxy")
    out = []
    for step in _chosen(inv, run):
        name = f"arrivals at the dependency per 100 ms <= {factor:g}x its capacity"
        busiest: int | None = None
        if proxy is not None:
            got = ((step.get("system") or {}).get("arrivals") or {}).get(proxy)
            busiest = None if got is None else int(got["max"])
        elif (step.get("dependency") or {}).get("peak_100ms") is not None:
            busiest = int(step["dependency"]["peak_100ms"])
        if busiest is None or capacity is None:
            why = "no dependency capacity" if capacity is None else "no arrival bins"
            out.append(_result(run, step, name, busiest, 0.0, None, "requests", why))
            continue
        limit = round(factor * float(capacity) * HERD_BIN_SECONDS, 1)
        out.append(_result(run, step, name, busiest, limit, busiest <= limit, "requests"))
    return out


def late_success_check(
    run: Mapping[str, Any], counts: Mapping[str, Any] | None, max_duplicates: float = 0.0
) -> Check:
    """``late_success_reconciled`` on counts ``{"duplicates": operations applied twice or
    more, "replayed": retries answered from the stored result}`` (and optionally
    ``"unreconciled"``: unknown outcomes left open). Not measured without counts, or when no
    late success was retried (nothing was replayed, so nothing was shown)."""
    name = "late successes replayed, not applied twice"
    if not isinstance(counts, Mapping) or "duplicates" not in counts:
        return _result(run, None, name, None, max_duplicates, None, "operations", "no counts")
    dup = int(counts["duplicates"])
    replayed = int(counts.get("replayed", 0))
    open_ = int(counts.get("unreconciled", 0))
    if dup <= max_duplicates and not replayed and not open_:
        return _result(
            run, None, name, dup, max_duplicates, None, "operations", "nothing was replayed"
        )
    passed = dup <= max_duplicates and open_ == 0
    note = f"{replayed} replayed, {open_} unknown outcomes left open"
    return _result(run, None, name, dup, max_duplicates, passed, "operations", note)


def system_checks(
    invariants: Iterable[Mapping[str, Any]],
    runs: Iterable[Mapping[str, Any]],
    members: Callable[[str | None], list[str]],
    dependency_capacity: float | None = None,
) -> list[Check]:
    """The whole-system invariants among ``invariants`` evaluated on ``runs``.

    ``members(class)``: the traffic names (per-class figures of a step) of a class;
    ``dependency_capacity``: requests/s of the dependency where no invariant declares it."""
    out: list[Check] = []
    chosen = [i for i in invariants if i["check"] in SYSTEM_CHECKS]
    for run in runs:
        for inv in chosen:
            kind = inv["check"]
            if kind == "queue_bounded":
                out += _queue(inv, run)
            elif kind == "retry_budget":
                out += _retries(inv, run)
            elif kind == "priority_goodput_stable":
                out += _priority(inv, run, members(inv.get("traffic_class")))
            elif kind == "no_thundering_herd":
                out += _herd(inv, run, dependency_capacity)
            elif kind == "late_success_reconciled":
                source = (inv.get("options") or {}).get("source")
                counts = ((run.get("system") or {}).get("idempotency") or {}).get(source)
                out.append(late_success_check(run, counts, float(inv["threshold"])))
    return out
