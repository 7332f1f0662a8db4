"""Hot-path cost of observability: Bulkhead admit+release with sinks attached vs none.

    flock /tmp/brownout-bench.lock .venv/bin/python bench/observability_bench.py

Configurations (each a fresh Bulkhead on its own EventHub, FixedLimit far above the load):

- ``none``: no sink; the bulkhead builds no events (``hub.enabled`` is false): the baseline;
- ``null sink``: a sink that does nothing: the cost of building the events (the bulkhead's);
- ``stats``: `Stats` subscribed (counters, histograms);
- ``stats+prometheus``: plus a registered `BrownoutCollector` (it costs nothing until a scrape);
- ``stats+prom+otel+shedlog``: plus the OTel histogram sink (no-op API meter) and `ShedLog`.

Also the refusal path (``try_admit`` at the limit: a shed) and the cost of one scrape of a
Stats with many series. Prints ns per operation (best of several rounds, configurations
interleaved so machine noise hits all alike) and ratios against ``none``. Target (issue 7):
``stats+prometheus`` <= 1.2x ``none`` on admit+release.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest

from brownout import Bulkhead, Priority, Reason, Rejected, Stats
from brownout.events import Event, EventHub, RequestShed
from brownout.export.logging import ShedLog
from brownout.export.otel import OtelHistogramSink
from brownout.export.prometheus import register
from brownout.limits import FixedLimit

N = 50_000
ROUNDS = 7


class NullSink:
    def emit(self, event: Event) -> None:
        pass


def configurations() -> dict[str, Callable[[EventHub], None]]:
    def none(hub: EventHub) -> None:
        pass

    def null(hub: EventHub) -> None:
        hub.subscribe(NullSink())

    def stats(hub: EventHub) -> None:
        hub.subscribe(Stats())

    def stats_prom(hub: EventHub) -> None:
        s = Stats()
        hub.subscribe(s)
        register(s, CollectorRegistry())

    def everything(hub: EventHub) -> None:
        stats_prom(hub)
        hub.subscribe(OtelHistogramSink())
        logging.getLogger("brownout.shed").setLevel(logging.ERROR)
        hub.subscribe(ShedLog())

    return {
        "none": none,
        "null sink": null,
        "stats": stats,
        "stats+prometheus": stats_prom,
        "stats+prom+otel+shedlog": everything,
    }


async def admit_release(bulkhead: Bulkhead, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        async with bulkhead.admit(
            priority=Priority.CRITICAL, caller="tenant-7", operation="/search"
        ):
            pass
    return (time.perf_counter() - t0) / n * 1e9


async def refuse(bulkhead: Bulkhead, n: int) -> float:
    held = bulkhead.try_admit(priority=Priority.CRITICAL, caller="a", operation="/x")
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            bulkhead.try_admit(priority=Priority.SHEDDABLE, caller="b", operation="/x")
        except Rejected:
            pass
    elapsed = (time.perf_counter() - t0) / n * 1e9
    held.success()
    return elapsed


async def bench_paths() -> dict[str, dict[str, list[float]]]:
    configs = configurations()
    results: dict[str, dict[str, list[float]]] = {"admit+release": {}, "refusal": {}}
    for _ in range(ROUNDS):
        for name, attach in configs.items():
            hub = EventHub()
            attach(hub)
            wide = Bulkhead("api", FixedLimit(1_000_000), events=hub)
            await admit_release(wide, 2_000)  # warm up
            results["admit+release"].setdefault(name, []).append(await admit_release(wide, N))
            narrow = Bulkhead("api", FixedLimit(1), events=hub, reserve=0)
            results["refusal"].setdefault(name, []).append(await refuse(narrow, N))
    return results


def bench_scrape() -> tuple[int, float]:
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    ops = [f"/op{i}" for i in range(20)]
    for i in range(20_000):
        stats.emit(
            RequestShed(
                0.0, "api", ops[i % 20], Priority(i % 4), f"c{i % 97}", Reason.QUEUE_FULL, 1.0, 0.0
            )
        )
    generate_latest(registry)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - t0)
    return stats.series_count(), min(times) * 1e3


def main() -> None:
    results = asyncio.run(bench_paths())
    for path, by_config in results.items():
        base = min(by_config["none"])
        print(f"\n{path} (ns per operation, best of {ROUNDS} x {N}; median in brackets)")
        for name, samples in by_config.items():
            best = min(samples)
            print(
                f"  {name:26s} {best:8.0f}  [{statistics.median(samples):8.0f}]"
                f"  x{best / base:5.2f}"
            )
    series, ms = bench_scrape()
    print(f"\nscrape of {series} series (generate_latest): {ms:.1f} ms")


if __name__ == "__main__":
    main()
