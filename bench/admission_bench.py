"""Admission hot-path benchmark: Bulkhead vs asyncio.Semaphore and hyx's bulkhead.

Prints, in one run: uncontended admit+release against ``asyncio.Semaphore`` (target <= 1.5x)
and against ``hyx.bulkhead``; the cost of a refusal (target < 2 us); throughput with 1,000
waiters queued. Each figure is the best of several interleaved repetitions, so a noisy shared
machine inflates all sides alike. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/admission_bench.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import brownout
from brownout import Bulkhead, Rejected
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue, PriorityCoDelQueue, QueueItem, WaitQueue

REPS = 7
N = 100_000


async def timed(body: Callable[[int], Awaitable[None]], n: int) -> float:
    t = time.perf_counter()
    await body(n)
    return (time.perf_counter() - t) / n


async def semaphore_loop(n: int) -> None:
    sem = asyncio.Semaphore(8)
    for _ in range(n):
        async with sem:
            pass


def bulkhead_loop(**kw: object) -> Callable[[int], Awaitable[None]]:
    async def run(n: int) -> None:
        b = Bulkhead("bench", FixedLimit(8), FifoQueue(32, 0.5), **kw)  # type: ignore[arg-type]
        for _ in range(n):
            async with b.admit():
                pass

    return run


async def bulkhead_deadline_loop(n: int) -> None:
    b = Bulkhead("bench", FixedLimit(8), FifoQueue(32, 0.5))
    with brownout.deadline(3600.0):  # as at an edge: every request carries a deadline
        for _ in range(n):
            async with b.admit():
                pass


async def hyx_loop(n: int) -> None:
    from hyx.bulkhead import bulkhead

    bh = bulkhead(max_concurrency=8, max_capacity=40)
    for _ in range(n):
        async with bh:
            pass


async def refusal_loop(n: int) -> None:
    b = Bulkhead("bench", FixedLimit(1), FifoQueue(32, 0.5))
    b.try_admit()
    for _ in range(n):
        try:
            b.try_admit()
        except Rejected:
            pass


async def semaphore_try_loop(n: int) -> None:
    # the nearest Semaphore analogue of a refusal: a locked() check
    sem = asyncio.Semaphore(1)
    await sem.acquire()
    for _ in range(n):
        if sem.locked():
            continue


async def waiters_throughput(waiters: int = 1000, limit: int = 8) -> float:
    """Completions per second with ``waiters`` tasks queued behind ``limit`` slots."""
    b = Bulkhead("bench", FixedLimit(limit), FifoQueue(max_size=waiters, max_wait=60.0))
    rounds = 5

    async def worker() -> None:
        for _ in range(rounds):
            async with b.admit():
                await asyncio.sleep(0)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(waiters)))
    return waiters * rounds / (time.perf_counter() - t)


async def semaphore_waiters_throughput(waiters: int = 1000, limit: int = 8) -> float:
    sem = asyncio.Semaphore(limit)
    rounds = 5

    async def worker() -> None:
        for _ in range(rounds):
            async with sem:
                await asyncio.sleep(0)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(waiters)))
    return waiters * rounds / (time.perf_counter() - t)


def queue_handoff(queue: WaitQueue, n: int = 200_000) -> float:
    """Seconds per push+pop of one item through ``queue`` (the waiter path's queue part), with
    a few items of two priority classes waiting, as under overload."""
    from brownout import Priority

    for i in range(4):
        queue.push(QueueItem(Priority.SHEDDABLE if i % 2 else Priority.CRITICAL), 0.0)
    items = [QueueItem() for _ in range(64)]
    now = 0.0
    t = time.perf_counter()
    for i in range(n):
        queue.push(items[i & 63], now)
        queue.pop(now)
        now += 1e-6
    return (time.perf_counter() - t) / n


async def main() -> None:
    cases: dict[str, Callable[[int], Awaitable[None]]] = {
        "semaphore": semaphore_loop,
        "bulkhead": bulkhead_loop(),
        "bulkhead_no_estimator": bulkhead_loop(deadline_aware=False),
        "bulkhead_deadline": bulkhead_deadline_loop,
        "hyx": hyx_loop,
        "refusal": refusal_loop,
    }
    best = dict.fromkeys(cases, float("inf"))
    rounds: list[dict[str, float]] = []
    for _ in range(REPS):
        this = {name: await timed(body, N) for name, body in cases.items()}
        rounds.append(this)
        for name, t in this.items():
            best[name] = min(best[name], t)

    def median_ratio(name: str, base: str = "semaphore") -> float:
        return statistics.median(r[name] / r[base] for r in rounds)

    fifo_q = min(queue_handoff(FifoQueue(64, 60.0)) for _ in range(REPS))
    codel_q = min(queue_handoff(PriorityCoDelQueue(64, 60.0)) for _ in range(REPS))
    thr_b = max([await waiters_throughput() for _ in range(3)])
    thr_s = max([await semaphore_waiters_throughput() for _ in range(3)])
    sem = best["semaphore"]
    print(f"python {sys.version.split()[0]}, best of {REPS} x {N:,} iterations")
    print(f"asyncio.Semaphore async-with        {sem * 1e9:8.0f} ns")
    print(
        f"Bulkhead admit+release (default)    {best['bulkhead'] * 1e9:8.0f} ns"
        f"  {best['bulkhead'] / sem:5.2f}x semaphore (median round {median_ratio('bulkhead'):.2f}x;"
        " target <= 1.5x)"
    )
    print(
        f"Bulkhead admit+release (no estim.)  {best['bulkhead_no_estimator'] * 1e9:8.0f} ns"
        f"  {best['bulkhead_no_estimator'] / sem:5.2f}x semaphore"
        f" (median round {median_ratio('bulkhead_no_estimator'):.2f}x)"
    )
    print(
        f"Bulkhead admit+release, deadline    {best['bulkhead_deadline'] * 1e9:8.0f} ns"
        f"  {best['bulkhead_deadline'] / sem:5.2f}x semaphore"
        f" (median round {median_ratio('bulkhead_deadline'):.2f}x; one clock read + estimate)"
    )
    print(
        f"hyx bulkhead async-with             {best['hyx'] * 1e9:8.0f} ns"
        f"  {best['hyx'] / sem:5.2f}x semaphore; bulkhead is"
        f" {1 / median_ratio('bulkhead', 'hyx'):.2f}x faster than hyx (median round)"
    )
    print(f"Bulkhead refusal (try_admit raise)  {best['refusal'] * 1e6:8.2f} us  (target < 2 us)")
    print(
        f"queue push+pop: FifoQueue {fifo_q * 1e9:6.0f} ns, PriorityCoDelQueue (the default)"
        f" {codel_q * 1e9:6.0f} ns"
    )
    print(
        f"1,000 waiters, limit 8: {thr_b:,.0f} completions/s "
        f"(asyncio.Semaphore: {thr_s:,.0f}/s, {thr_b / thr_s:.2f}x)"
    )


if __name__ == "__main__":
    asyncio.run(main())
