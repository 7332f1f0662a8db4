"""Sizing a bulkhead to a pool of threads (A1, A3): the split of the threads into running,
queued and spare, and `ThreadBulkhead.for_threads` holding to it with real threads on a
`ManualClock`: the limit and the queue together never hold a spare thread, so the request
past them is refused at once, on the caller's thread."""

from __future__ import annotations

import threading

import pytest

from brownout import Reason, Rejected, ThreadBulkhead
from brownout._admission.thread_split import split_threads
from brownout._clock import ManualClock
from brownout.events import EventHub
from brownout.limits import Gradient2Limit
from brownout.queues import FifoQueue

SETTLE = 10.0  # real seconds a blocked thread may take to get where the test expects it


@pytest.mark.parametrize(
    ("threads", "running", "queued", "spare"),
    [(1, 1, 0, 0), (2, 1, 0, 1), (4, 2, 0, 2), (8, 3, 1, 4), (16, 6, 2, 8), (32, 12, 4, 16)],
)
def test_half_the_threads_stay_spare_and_a_quarter_of_the_rest_queue(
    threads: int, running: int, queued: int, spare: int
) -> None:
    split = split_threads(threads)
    assert (split.running, split.queued, split.spare) == (running, queued, spare)
    assert split.running + split.queued + split.spare == threads


def test_explicit_sizes_are_kept() -> None:
    split = split_threads(16, spare=4, queued=3)
    assert (split.running, split.queued, split.spare) == (9, 3, 4)
    assert split_threads(8, spare=0, queued=0).running == 8


@pytest.mark.parametrize(
    ("threads", "spare", "queued"),
    [(0, None, None), (4, 4, None), (4, -1, None), (8, 4, 4), (8, None, -1)],
)
def test_sizes_that_leave_no_thread_to_run_are_refused(
    threads: int, spare: int | None, queued: int | None
) -> None:
    with pytest.raises(ValueError):
        split_threads(threads, spare, queued)


def test_for_threads_caps_the_limit_and_the_queue_at_the_split() -> None:
    b = ThreadBulkhead.for_threads("api", 16, events=EventHub())
    limit = b._limit
    assert isinstance(limit, Gradient2Limit)
    assert (limit.limit, limit.max_limit) == (6, 6)  # starts at what may run
    assert isinstance(b._queue, FifoQueue)
    assert (b._queue.max_size, b._queue.max_wait) == (2, 0.1)
    with pytest.raises(ValueError):
        ThreadBulkhead.for_threads("api", 16, initial=7)


def test_the_request_past_the_limit_and_the_queue_is_refused_at_once() -> None:
    clock = ManualClock()
    b = ThreadBulkhead.for_threads("api", 8, initial=3, clock=clock, events=EventHub())
    held = [b.try_admit() for _ in range(3)]  # the 3 running threads
    queued = threading.Event()
    outcome: list[BaseException | None] = []

    def wait_in_queue() -> None:
        queued.set()
        try:
            with b.admit():
                outcome.append(None)
        except Rejected as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    assert queued.wait(SETTLE)
    for _ in range(int(SETTLE / 0.01)):  # until it stands in the queue
        if b.queue_depth == 1:
            break
        threading.Event().wait(0.01)
    assert b.queue_depth == 1
    with pytest.raises(Rejected) as refused:  # the 4 spare threads are never held
        with b.admit():
            pass
    assert refused.value.reason is Reason.QUEUE_FULL
    clock.advance(0.1)  # the queue's short bound: the waiter gives its thread back
    b.sweep()
    waiter.join(SETTLE)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], Rejected) and outcome[0].reason is Reason.QUEUE_TIMEOUT
    for p in held:
        p.success()
    assert b.in_flight == 0
