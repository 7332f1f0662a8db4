"""Prometheus exporter: a collector that reads `Stats` at scrape time (O1, O2, O4, O5, S8).

The request path only updates `Stats` (a few dict operations per event); this collector turns
its counters, histograms and gauges into Prometheus metric families when Prometheus scrapes,
so exporting costs nothing between scrapes.

    stats = brownout.events.hub.subscribe(Stats())
    register(stats)                      # the default prometheus_client registry
    app = metrics_middleware(app)        # serve /metrics from any ASGI app

Needs ``prometheus_client`` (``pip install brownout[prometheus]``). Starlette and aiohttp are
imported only inside the helper that needs them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.asgi import make_asgi_app
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "prometheus", e) from e

from .._snapshot import items_of
from .._stats import LatencyHistogram, Stats
from ._catalog import COUNTERS, GAUGES, HISTOGRAMS, STATE_COUNTERS, CounterSpec, GaugeSpec
from ._workers import WorkersCollector, mark_process_dead

__all__ = [
    "BrownoutCollector",
    "MetricsApp",
    "WorkersCollector",
    "add_aiohttp_metrics",
    "mark_process_dead",
    "metrics_middleware",
    "mount_metrics",
    "register",
    "register_multiprocess",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BASE_LABELS = ("source", "operation", "priority")
_GAUGE_SPECS: dict[str, GaugeSpec] = {g.kind: g for g in GAUGES}
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def _metric_name(name: str) -> str:
    clean = _INVALID.sub("_", name)
    return f"brownout_{clean}" if not clean.startswith("brownout_") else clean


class BrownoutCollector(Collector):
    """Turns a `Stats` into Prometheus metric families at scrape time.

    ``caller_label=False`` drops the caller label from counters (sums over callers) for
    deployments that only want per-caller detail in shed logs. ``bucket_stride`` keeps every
    n-th histogram bucket of `LatencyHistogram`'s 8-per-decade buckets (2: 4 per decade, 26
    buckets), which are exact cumulative counts at those bounds.
    """

    def __init__(self, stats: Stats, *, caller_label: bool = True, bucket_stride: int = 2):
        if bucket_stride < 1:
            raise ValueError("bucket_stride must be >= 1")
        self.stats = stats
        self.caller_label = caller_label
        self.bucket_stride = bucket_stride

    # -- families ---------------------------------------------------------------------------
    def _counter_labels(self, spec: CounterSpec) -> list[str]:
        labels = list(_BASE_LABELS)
        if self.caller_label:
            labels.append("caller")
        if spec.reason_label:
            labels.append(spec.reason_label)
        return labels

    def _counter_families(self) -> dict[str, tuple[CounterSpec, CounterMetricFamily]]:
        return {
            spec.kind: (
                spec,
                CounterMetricFamily(spec.prom, spec.help, labels=self._counter_labels(spec)),
            )
            for spec in COUNTERS
        }

    def describe(self) -> Iterable[Metric]:
        """Every family this collector can produce (for the registry's duplicate check)."""
        for _spec, fam in self._counter_families().values():
            yield fam
        for prom_name, help_text, labels in self._state_counter_specs():
            yield CounterMetricFamily(prom_name, help_text, labels=list(labels))
        for h in HISTOGRAMS:
            yield HistogramMetricFamily(h.prom, h.help, labels=list(h.labels))
        for g in GAUGES:
            yield GaugeMetricFamily(g.prom, g.help, labels=[])
        yield GaugeMetricFamily("brownout_stats_series", "Counter and histogram series kept.")

    @staticmethod
    def _state_counter_specs() -> Iterator[tuple[str, str, tuple[str, ...]]]:
        for _attr, prom_name, _otel, labels, help_text in STATE_COUNTERS:
            yield prom_name, help_text, labels

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        stats.sync()  # one flush of the ledgers for the whole scrape
        families = self._counter_families()
        sums: dict[tuple[str, tuple[str, ...]], int] = {}
        for (kind, src, op, pr, ca, reason), n in items_of(stats.rows):
            spec = families[kind][0]
            values: tuple[str, ...] = (src, op, pr)
            if self.caller_label:
                values += (ca,)
            if spec.reason_label:
                values += (reason,)
            sums[kind, values] = sums.get((kind, values), 0) + n
        for (kind, values), n in sums.items():
            families[kind][1].add_metric(list(values), n)
        for _spec, fam in families.values():
            yield fam

        for attr, prom_name, _otel, label_names, help_text in STATE_COUNTERS:
            fam = CounterMetricFamily(prom_name, help_text, labels=list(label_names))
            table: dict[Any, int] = getattr(stats, attr)
            for row, count in items_of(table):
                fam.add_metric(list(row) if isinstance(row, tuple) else [row], count)
            yield fam

        for h in HISTOGRAMS:
            hfam = HistogramMetricFamily(h.prom, h.help, labels=list(h.labels))
            htable: dict[Any, LatencyHistogram] = getattr(stats, h.table)
            for hkey, hist in items_of(htable):
                hlabels = list(hkey) if isinstance(hkey, tuple) else [hkey]
                hfam.add_metric(hlabels, self._buckets(hist), sum_value=hist.sum)
            yield hfam

        yield from self._gauges()
        series = GaugeMetricFamily("brownout_stats_series", "Counter and histogram series kept.")
        series.add_metric([], stats.series_count())
        yield series

    def _buckets(self, hist: LatencyHistogram) -> list[tuple[str, float]]:
        cumulative = hist.cumulative()
        last = len(cumulative) - 1
        stride = self.bucket_stride
        return [
            (_le(bound), float(acc))
            for i, (bound, acc) in enumerate(cumulative)
            if i == last or i % stride == 0
        ]

    def _gauges(self) -> Iterator[Metric]:
        grouped: dict[str, list[tuple[dict[str, str], float]]] = {g.kind: [] for g in GAUGES}
        for name, labels, value in self.stats.gauges():
            clean = {_INVALID.sub("_", k): str(v) for k, v in labels.items()}
            grouped.setdefault(name, []).append((clean, value))
        for name, readings in grouped.items():
            spec = _GAUGE_SPECS.get(name)
            prom_name = spec.prom if spec else _metric_name(name)
            help_text = spec.help if spec else f"Gauge {name!r} reported by an observable."
            label_names = sorted({k for labels, _ in readings for k in labels})
            fam = GaugeMetricFamily(prom_name, help_text, labels=label_names)
            for labels, value in readings:
                fam.add_metric([labels.get(k, "") for k in label_names], value)
            yield fam


def register(
    stats: Stats,
    registry: CollectorRegistry = REGISTRY,
    *,
    caller_label: bool = True,
    bucket_stride: int = 2,
) -> BrownoutCollector:
    """Register a `BrownoutCollector` for ``stats`` with ``registry`` and return it."""
    collector = BrownoutCollector(stats, caller_label=caller_label, bucket_stride=bucket_stride)
    registry.register(collector)
    return collector


def register_multiprocess(
    stats: Stats,
    registry: CollectorRegistry = REGISTRY,
    *,
    path: str | None = None,
    period: float = 1.0,
    caller_label: bool = True,
    bucket_stride: int = 2,
) -> WorkersCollector:
    """Register, with ``registry``, brownout's metrics summed over every worker process that
    shares the multiprocess directory ``path`` (default: ``PROMETHEUS_MULTIPROC_DIR``), and
    start publishing this worker's ``stats`` there every ``period`` seconds. Call it once in
    every worker; any worker's scrape shows the sum (`WorkersCollector`)."""
    source = BrownoutCollector(stats, caller_label=caller_label, bucket_stride=bucket_stride)
    collector = WorkersCollector(source, path, period=period)
    registry.register(collector)
    return collector


class MetricsApp:
    """An ASGI app serving a registry: prometheus_client's own (`make_asgi_app`), so the text
    or OpenMetrics format is negotiated from ``Accept``, the output gzip-compressed when the
    scraper accepts it (``Accept-Encoding: gzip``, as Prometheus sends), and ``name[]``
    filters honoured. Adds ``Content-Length`` and answers ``HEAD`` with the head alone.

    A class, not a function, so Starlette's ``Route``/``Mount`` treat it as a raw ASGI app.
    """

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, *, disable_compression: bool = False
    ) -> None:
        self.registry = registry
        self._app: ASGIApp = make_asgi_app(registry, disable_compression=disable_compression)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        head = scope.get("method") == "HEAD"
        started: Message | None = None

        async def framed(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = message  # sent with the body, once its length is known
                return
            body: bytes = message.get("body", b"")
            if started is not None:
                headers = [
                    *started.get("headers", ()),
                    (b"content-length", str(len(body)).encode("ascii")),
                    (b"vary", b"Accept-Encoding"),
                ]
                await send({**started, "headers": headers})
                started = None
            await send({"type": "http.response.body", "body": b"" if head else body})

        await self._app(scope, receive, framed)


def metrics_middleware(
    app: ASGIApp,
    *,
    registry: CollectorRegistry = REGISTRY,
    path: str = "/metrics",
    disable_compression: bool = False,
) -> ASGIApp:
    """Wrap any ASGI app so that ``GET path`` serves the registry; everything else passes.

    Works for Starlette, FastAPI or a bare ASGI callable, and answers before any admission
    middleware the app has inside, so scrapes are never shed.
    """
    metrics = MetricsApp(registry, disable_compression=disable_compression)

    async def with_metrics(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == path:
            await metrics(scope, receive, send)
        else:
            await app(scope, receive, send)

    return with_metrics


def mount_metrics(
    app: Any,
    *,
    registry: CollectorRegistry = REGISTRY,
    path: str = "/metrics",
    disable_compression: bool = False,
) -> None:
    """Add a ``path`` route serving the registry to a Starlette/FastAPI app (exact path, no
    trailing-slash redirect). `BrownoutMiddleware` lets it through unadmitted and uncounted
    when ``path`` is one of the policy's ``metrics_paths`` (default ``("/metrics",)``)."""
    from starlette.routing import Route

    metrics = MetricsApp(registry, disable_compression=disable_compression)
    app.router.routes.insert(0, Route(path, metrics, methods=["GET", "HEAD"]))


def add_aiohttp_metrics(
    app: Any,
    *,
    registry: CollectorRegistry = REGISTRY,
    path: str = "/metrics",
    disable_compression: bool = False,
) -> None:
    """Add ``GET path`` (and ``HEAD``) serving the registry to an ``aiohttp.web.Application``,
    with prometheus_client's own handler (format negotiated, compressed when accepted). The
    brownout middleware lets it through when ``path`` is one of the policy's
    ``metrics_paths``."""
    from prometheus_client.aiohttp import make_aiohttp_handler

    app.router.add_get(path, make_aiohttp_handler(registry, disable_compression))
