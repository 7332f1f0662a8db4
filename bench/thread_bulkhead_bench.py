"""ThreadBulkhead admit + release vs ``threading.BoundedSemaphore`` acquire + release.

Prints, in one run, ns per admission for both, uncontended (1 thread) and contended (8 threads
sharing a limit of 4), and the ratio (target <= 2x). Each figure is the best of several
interleaved repetitions, so a noisy shared machine inflates both sides alike. Run under the
lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/thread_bulkhead_bench.py
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from brownout import ThreadBulkhead
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

REPS = 5
N = 50_000
LIMIT = 4


def semaphore_body() -> Callable[[int], None]:
    sem = threading.BoundedSemaphore(LIMIT)

    def run(n: int) -> None:
        for _ in range(n):
            with sem:
                pass

    return run


def bulkhead_body() -> Callable[[int], None]:
    # a queue as deep as the threads and a generous age bound: contention waits, never refuses
    b = ThreadBulkhead("bench", FixedLimit(LIMIT), FifoQueue(64, 10.0))

    def run(n: int) -> None:
        admit = b.admit
        for _ in range(n):
            with admit():
                pass

    return run


def timed(make: Callable[[], Callable[[int], None]], threads: int, n: int) -> float:
    """ns per admission with ``threads`` threads each doing ``n / threads``."""
    body = make()
    each = n // threads
    start = threading.Barrier(threads + 1)

    def worker() -> None:
        start.wait()
        body(each)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return (time.perf_counter() - t0) / (each * threads) * 1e9


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else N
    print(f"python {sys.version.split()[0]}, {n} admissions per repetition, best of {REPS}")
    for threads in (1, 8):
        sem = bulk = float("inf")
        for _ in range(REPS):
            sem = min(sem, timed(semaphore_body, threads, n))
            bulk = min(bulk, timed(bulkhead_body, threads, n))
        label = "uncontended (1 thread)" if threads == 1 else f"contended ({threads} threads)"
        print(
            f"{label:26s} BoundedSemaphore {sem:7.0f} ns  ThreadBulkhead {bulk:7.0f} ns"
            f"  ratio {bulk / sem:.2f}x"
        )


if __name__ == "__main__":
    main()
