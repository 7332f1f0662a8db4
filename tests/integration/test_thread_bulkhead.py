"""ThreadBulkhead under real threads: the limit holds, every permit settles, waits stay bounded.

Margins are generous (a shared, noisy 2-core host): the bounds checked are the bulkhead's, the
slack is the scheduler's.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

import brownout
from brownout import Deadline, Priority, Reason, Rejected, ThreadBulkhead
from brownout.events import (
    EventHub,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestOffered,
    RequestShed,
)
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.testing import EventRecorder

THREADS = 32
ROUNDS = 40
LIMIT = 4
RESERVE = 1
MAX_WAIT = 0.05
SLACK = 2.0  # scheduler slack on top of a bound the bulkhead keeps
JOIN = 120.0


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.peak = 0
        self.ran = 0
        self.refused: dict[Reason, int] = {}
        self.longest_wait = 0.0
        self.errors: list[BaseException] = []

    def enter(self) -> None:
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)

    def leave(self) -> None:
        with self.lock:
            self.inside -= 1
            self.ran += 1

    def waited(self, seconds: float) -> None:
        with self.lock:
            self.longest_wait = max(self.longest_wait, seconds)


def run_threads(target, n: int = THREADS) -> None:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + JOIN
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung in the bulkhead"


def test_many_threads_never_exceed_the_limit_and_settle_every_permit() -> None:
    hub = EventHub()
    recorder = EventRecorder(hub).start()
    b = ThreadBulkhead(
        "db",
        FixedLimit(LIMIT),
        FifoQueue(max_size=8, max_wait=MAX_WAIT),
        reserve=RESERVE,
        events=hub,
    )
    tally = Tally()
    priorities = [
        Priority.SHEDDABLE,
        Priority.SHEDDABLE_PLUS,
        Priority.CRITICAL,
        Priority.CRITICAL_PLUS,
    ]

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(ROUNDS):
            start = time.monotonic()
            try:
                with b.admit(priority=rng.choice(priorities), caller=f"c{i % 4}"):
                    tally.waited(time.monotonic() - start)
                    tally.enter()
                    time.sleep(rng.uniform(0.0, 0.002))
                    tally.leave()
            except Rejected as e:
                tally.waited(time.monotonic() - start)
                with tally.lock:
                    tally.refused[e.reason] = tally.refused.get(e.reason, 0) + 1
            except BaseException as e:  # pragma: no cover - reported below
                tally.errors.append(e)

    run_threads(worker)
    recorder.stop()
    assert tally.errors == []
    assert 1 <= tally.peak <= LIMIT + RESERVE
    assert tally.ran + sum(tally.refused.values()) == THREADS * ROUNDS
    assert tally.ran > 0
    assert set(tally.refused) <= {Reason.QUEUE_FULL, Reason.QUEUE_TIMEOUT}
    assert b.in_flight == 0
    assert b.queue_depth == 0
    # every wait ends by the queue's age bound (the queue's bound, plus the scheduler's slack)
    assert tally.longest_wait < MAX_WAIT + SLACK
    # the events account for every request
    events = recorder.events
    offered = sum(isinstance(e, RequestOffered) for e in events)
    admitted = sum(isinstance(e, RequestAdmitted) for e in events)
    shed = sum(isinstance(e, RequestShed) for e in events)
    completed = sum(isinstance(e, RequestCompleted) for e in events)
    assert offered == THREADS * ROUNDS
    assert admitted == completed == tally.ran
    assert shed == sum(tally.refused.values())


def test_waiters_time_out_on_their_deadline_without_help() -> None:
    b = ThreadBulkhead("db", FixedLimit(1), FifoQueue(max_size=64, max_wait=60.0), reserve=0)
    holder = b.try_admit()
    tally = Tally()

    def worker(i: int) -> None:
        start = time.monotonic()
        try:
            with b.admit(deadline=Deadline.after(0.1 + 0.01 * i, clock=b.clock)):
                tally.enter()
                tally.leave()
        except Rejected as e:
            tally.waited(time.monotonic() - start)
            with tally.lock:
                tally.refused[e.reason] = tally.refused.get(e.reason, 0) + 1

    run_threads(worker, 8)
    holder.success()
    assert tally.refused == {Reason.DEADLINE_EXPIRED: 8}
    assert tally.longest_wait < 0.1 + 0.07 + SLACK
    assert b.queue_depth == 0
    assert b.in_flight == 0


def test_a_request_deadline_crosses_into_the_executor() -> None:
    from concurrent.futures import ThreadPoolExecutor

    hub = EventHub()
    recorder = EventRecorder(hub).start()
    b = ThreadBulkhead("db", FixedLimit(1), FifoQueue(max_size=4, max_wait=60.0), events=hub)
    holder = b.try_admit()
    with ThreadPoolExecutor(2) as pool, brownout.deadline(0.2):
        # the worker thread sees the caller's deadline (bind copies the context)
        fut = pool.submit(brownout.bind(lambda: b.admit().__enter__()))
        with pytest.raises(Rejected) as e:
            fut.result(JOIN)
        assert e.value.reason is Reason.DEADLINE_EXPIRED
    holder.success()
    recorder.stop()
    assert [e.stage for e in recorder.events if isinstance(e, RequestExpired)] == ["queue"]
