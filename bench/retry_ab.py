"""Two checkouts' outbound success path, side by side: which is cheaper per call?

Each round starts one process per checkout (``PYTHONPATH=<checkout>/src``), alternating which
goes first, and each process measures every case against a bare ``await fn()`` of its own
round, as ``bench/retry_bench.py`` does. Figures are medians over rounds of the overhead
(time per call minus the bare await); the ratio is the median of the per-round ratios, so a
noisy round hits both sides alike. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/retry_ab.py BEFORE/src AFTER/src \
        [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

Runner = Callable[[int], Awaitable[None]]
CASES = (
    "Dependency.call (retry only)",
    "Dependency.call (+breaker)",
    "Dependency.call (timeout=1s)",
    "CircuitBreaker.call",
    "RetryPolicy.call (idempotent)",
)


async def ok() -> int:
    return 1


def runners() -> dict[str, Runner]:
    from brownout import CircuitBreaker, Dependency, RetryBudget, RetryPolicy

    async def bare(n: int) -> None:
        for _ in range(n):
            await ok()

    def dependency(**kw: object) -> Runner:
        dep = Dependency("bench", retry=RetryPolicy(3), **kw)  # type: ignore[arg-type]

        async def run(n: int) -> None:
            call = dep.call
            for _ in range(n):
                await call(ok, idempotent=True)

        return run

    breaker = CircuitBreaker()

    async def breaker_call(n: int) -> None:
        call = breaker.call
        for _ in range(n):
            await call(ok)

    policy = RetryPolicy(3, budget=RetryBudget(ratio=0.1, min_per_second=10))

    async def policy_call(n: int) -> None:
        call = policy.call
        for _ in range(n):
            await call(ok, idempotent=True)

    return {
        "bare": bare,
        CASES[0]: dependency(),
        CASES[1]: dependency(breaker=CircuitBreaker()),
        CASES[2]: dependency(timeout=1.0),
        CASES[3]: breaker_call,
        CASES[4]: policy_call,
    }


async def child(calls: int) -> dict[str, float]:
    cases = runners()

    async def per_call(runner: Runner) -> float:
        t = time.perf_counter()
        await runner(calls)
        return (time.perf_counter() - t) / calls

    for runner in cases.values():  # warm up
        await runner(min(calls, 2000))
    base = await per_call(cases["bare"])
    return {name: max(0.0, await per_call(cases[name]) - base) for name in CASES}


def run_child(src: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--calls", str(calls)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    figures: dict[str, float] = json.loads(out)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkouts", nargs="*", help="BEFORE/src AFTER/src")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.calls))))
        return
    if len(args.checkouts) != 2:
        parser.error("give two src directories: BEFORE AFTER")
    before, after = args.checkouts
    samples: dict[str, dict[str, list[float]]] = {before: {}, after: {}}
    ratios: dict[str, list[float]] = {name: [] for name in CASES}
    for r in range(args.rounds):
        order = (before, after) if r % 2 == 0 else (after, before)
        got = {src: run_child(src, args.calls) for src in order}
        for src, figures in got.items():
            for name, value in figures.items():
                samples[src].setdefault(name, []).append(value)
        for name in CASES:
            if got[before][name] > 0:
                ratios[name].append(got[after][name] / got[before][name])
    print(f"overhead per call, {args.calls} calls x {args.rounds} alternating rounds (median)")
    print(f"  before: {before}\n  after:  {after}")
    print(f"  {'path':34s} {'before':>9s} {'after':>9s} {'after/before':>13s}")
    for name in CASES:
        b = statistics.median(samples[before][name]) * 1e6
        a = statistics.median(samples[after][name]) * 1e6
        ratio = statistics.median(ratios[name]) if ratios[name] else float("nan")
        print(f"  {name:34s} {b:7.2f}us {a:7.2f}us {ratio:12.3f}x")


if __name__ == "__main__":
    main()
