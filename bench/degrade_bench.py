"""Request-path costs of graceful degradation (issue #8).

Prints costs and ratios against baselines measured in the same run:
- ``modes.active(name)`` vs a plain dict lookup (idle, and with a max_duration armed)
- a ``@modes.fallback`` async function vs the bare function (mode off / on)
- ``StaleCache.get`` fresh hit vs awaiting a coroutine that reads a dict
- ``FailClosedGuard.call`` vs awaiting the source directly (success path)
- ``dependency_call`` outside a drill

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/degrade_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from brownout import DegradedMode, DegradedModes, FailClosedGuard, StaleCache
from brownout.events import EventHub
from brownout.wire import dependency_call

N = 100_000


def per_op_sync(fn: Callable[[], object], n: int = N) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


async def per_op_async(fn: Callable[[], Awaitable[object]], n: int = N) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {}

    def record(name: str, base: float, ours: float) -> None:
        rows.setdefault(name, []).append((base, ours))

    async def round_() -> None:
        hub = EventHub()
        idle = DegradedModes([DegradedMode("recs", "hide recs", enter_at_level=1)], events=hub)
        armed = DegradedModes(
            [DegradedMode("recs", "hide recs", enter_at_level=1, max_duration=3600)], events=hub
        )
        armed.set_level(1)
        table = {"recs": False}
        record(
            "modes.active (idle)",
            per_op_sync(lambda: table["recs"]),
            per_op_sync(lambda: idle.active("recs")),
        )
        record(
            "modes.active (active, timer armed)",
            per_op_sync(lambda: table["recs"]),
            per_op_sync(lambda: armed.active("recs")),
        )

        async def personalised() -> list[str]:
            return ["x"]

        wrapped = idle.fallback("recs", lambda: [])(personalised)
        record(
            "@fallback, mode off",
            await per_op_async(personalised),
            await per_op_async(wrapped),
        )
        idle.force("recs", True)
        record(
            "@fallback, mode on",
            await per_op_async(personalised),
            await per_op_async(wrapped),
        )

        cache: StaleCache[str, str] = StaleCache(
            max_entries=1000, fresh_for=3600, max_staleness=7200, events=hub
        )
        store = {"home": "page"}

        async def load() -> str:
            return "page"

        async def dict_read() -> str:
            return store["home"]

        await cache.get("home", load)
        record(
            "StaleCache.get fresh hit",
            await per_op_async(dict_read),
            await per_op_async(lambda: cache.get("home", load)),
        )

        guard = FailClosedGuard("authorization", events=hub)

        async def authz() -> bool:
            return True

        record(
            "FailClosedGuard.call (success)",
            await per_op_async(authz),
            await per_op_async(lambda: guard.call(authz)),
        )
        record(
            "dependency_call (no drill)",
            per_op_sync(lambda: None),
            per_op_sync(lambda: dependency_call("recs-service")),
        )

    loop = asyncio.new_event_loop()
    try:
        for _ in range(args.rounds):
            loop.run_until_complete(round_())
    finally:
        loop.close()
    print(f"{'path':38} {'baseline':>10} {'brownout':>10} {'ratio':>8}")
    for name, pairs in rows.items():
        base = min(b for b, _ in pairs)
        ours = min(o for _, o in pairs)
        ratio = statistics.median(o / b for b, o in pairs)
        print(f"{name:38} {base * 1e9:8.0f}ns {ours * 1e9:8.0f}ns {ratio:7.2f}x")


if __name__ == "__main__":
    main()
