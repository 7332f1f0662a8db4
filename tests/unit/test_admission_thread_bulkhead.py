"""ThreadBulkhead: the Bulkhead's decisions from threads, on a ManualClock (A1, A3, S3, D7).

Waiters are real threads blocked in ``with bulkhead.admit()``; time is a `ManualClock`, moved
by the test, and `ThreadBulkhead.sweep` runs the checks a waiter runs when its wait times out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

import brownout
from brownout import Deadline, Priority, Reason, Rejected, ThreadBulkhead
from brownout._admission.protocols import AdmitsWorkBlocking
from brownout._clock import ManualClock
from brownout.events import (
    Event,
    EventHub,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
)
from brownout.limits import FixedLimit, LatencyEstimator
from brownout.queues import FifoQueue

SETTLE = 10.0  # real seconds a blocked thread may take to get where the test expects it


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: type) -> list:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]


class Waiter:
    """A thread in ``with bulkhead.admit(**kw)``: it holds the permit until released."""

    def __init__(self, bulkhead: ThreadBulkhead, order: list[str] | None = None, **kw) -> None:
        self.name = str(kw.get("caller", "w"))
        self.admitted = threading.Event()
        self.leave = threading.Event()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._order = order

        def run() -> None:
            try:
                with bulkhead.admit(**kw):
                    if self._order is not None:
                        self._order.append(self.name)
                    self.admitted.set()
                    assert self.leave.wait(SETTLE)
            except BaseException as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def release(self) -> None:
        self.leave.set()
        assert self.done.wait(SETTLE)

    def refused(self) -> Reason:
        assert self.done.wait(SETTLE), "the waiter still waits"
        assert isinstance(self.error, Rejected), self.error
        return self.error.reason


def until(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + SETTLE
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the threads"
        time.sleep(0.001)


def make(limit: int = 1, **kw) -> tuple[ThreadBulkhead, ManualClock, Recorder]:
    clock = ManualClock(100.0)
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    kw.setdefault("reserve", 0)
    return ThreadBulkhead("db", FixedLimit(limit), clock=clock, events=hub, **kw), clock, rec


def test_is_a_blocking_admission() -> None:
    b, _, _ = make()
    assert isinstance(b, AdmitsWorkBlocking)


def test_try_admit_up_to_the_limit_then_refuses() -> None:
    b, _, rec = make(limit=2)
    one, two = b.try_admit(), b.try_admit()
    assert b.in_flight == 2
    with pytest.raises(Rejected) as e:
        b.try_admit()
    assert e.value.reason is Reason.OVERLOADED
    one.success()
    two.failed("boom")
    assert b.in_flight == 0
    assert len(rec.of(RequestOffered)) == 3
    assert len(rec.of(RequestAdmitted)) == 2
    assert [s.reason for s in rec.of(RequestShed)] == [Reason.OVERLOADED]
    assert len(rec.of(RequestCompleted)) == 1
    assert [f.error for f in rec.of(RequestFailed)] == ["boom"]


def test_with_block_settles_by_the_exception() -> None:
    b, _, rec = make(limit=1)
    with b.admit():
        assert b.in_flight == 1
    with pytest.raises(ValueError), b.admit():
        raise ValueError
    with pytest.raises(TimeoutError), b.admit():
        raise TimeoutError
    with pytest.raises(Rejected), b.admit():
        raise Rejected(Reason.OVERLOADED, "downstream")
    assert b.in_flight == 0
    assert len(rec.of(RequestCompleted)) == 1
    assert [f.error for f in rec.of(RequestFailed)] == ["ValueError", "TimeoutError", "Rejected"]


def test_decorates_a_plain_function() -> None:
    b, _, rec = make(limit=1)

    @b
    def add(x: int, y: int) -> int:
        assert b.in_flight == 1
        return x + y

    assert add(2, 3) == 5
    assert b.in_flight == 0
    assert len(rec.of(RequestCompleted)) == 1


def test_waiters_are_served_by_priority() -> None:
    b, _, rec = make(limit=1, queue=FifoQueue(max_size=8, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)
    order: list[str] = []
    low = Waiter(b, order, caller="low", priority=Priority.SHEDDABLE)
    until(lambda: b.queue_depth == 1)
    high = Waiter(b, order, caller="high", priority=Priority.CRITICAL)
    # the event is emitted after the push, and queue_depth is read without the lock
    until(lambda: len(rec.of(RequestQueued)) == 2)
    assert b.queue_depth == 2
    holder.release()
    assert high.admitted.wait(SETTLE)
    assert not low.admitted.is_set()
    high.release()
    assert low.admitted.wait(SETTLE)
    low.release()
    assert order == ["high", "low"]
    assert b.in_flight == 0
    assert len(rec.of(RequestCompleted)) == 3


def test_a_full_queue_refuses_and_evicts_lower_work() -> None:
    b, _, rec = make(limit=1, queue=FifoQueue(max_size=1, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)
    low = Waiter(b, caller="low", priority=Priority.SHEDDABLE)
    until(lambda: b.queue_depth == 1)
    with pytest.raises(Rejected) as e, b.admit(priority=Priority.SHEDDABLE):
        pass
    assert e.value.reason is Reason.QUEUE_FULL
    high = Waiter(b, caller="high", priority=Priority.CRITICAL)
    assert low.refused() is Reason.QUEUE_FULL  # evicted for the higher priority
    until(lambda: b.queue_depth == 1)
    holder.release()
    assert high.admitted.wait(SETTLE)
    high.release()
    assert [s.reason for s in rec.of(RequestShed)] == [Reason.QUEUE_FULL, Reason.QUEUE_FULL]


def test_the_age_bound_refuses_old_waiters() -> None:
    b, clock, rec = make(limit=1, queue=FifoQueue(max_size=4, max_wait=1.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)
    waiter = Waiter(b, caller="old")
    until(lambda: b.queue_depth == 1)
    clock.advance(0.5)
    b.sweep()
    assert not waiter.done.is_set()
    clock.advance(0.6)
    b.sweep()
    assert waiter.refused() is Reason.QUEUE_TIMEOUT
    assert b.queue_depth == 0
    holder.release()
    (shed,) = rec.of(RequestShed)
    assert shed.reason is Reason.QUEUE_TIMEOUT
    assert shed.queue_wait == pytest.approx(1.1)


def test_a_deadline_passing_in_the_queue_expires_the_waiter() -> None:
    b, clock, rec = make(limit=1, queue=FifoQueue(max_size=4, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)
    waiter = Waiter(b, caller="late", deadline=Deadline.after(0.5, clock=clock))
    until(lambda: b.queue_depth == 1)
    clock.advance(0.5)
    b.sweep()
    assert waiter.refused() is Reason.DEADLINE_EXPIRED
    holder.release()
    (expired,) = rec.of(RequestExpired)
    assert expired.stage == "queue"
    assert b.in_flight == 0


def test_refuses_at_once_when_the_deadline_is_too_short() -> None:
    estimator = LatencyEstimator()
    b, clock, rec = make(limit=1, estimator=estimator)
    for _ in range(20):
        estimator.observe("q", 1.0)
    assert estimator.estimates.get("q") is not None
    with (
        pytest.raises(Rejected) as e,
        b.admit(operation="q", deadline=Deadline.after(0.5, clock=clock)),
    ):
        pass
    assert e.value.reason is Reason.DEADLINE_TOO_SHORT
    with pytest.raises(Rejected) as e, b.admit(deadline=Deadline.after(0.0, clock=clock)):
        pass
    assert e.value.reason is Reason.DEADLINE_EXPIRED
    assert [s.reason for s in rec.of(RequestShed)] == [
        Reason.DEADLINE_TOO_SHORT,
        Reason.DEADLINE_EXPIRED,
    ]


def test_a_priority_at_its_share_keeps_the_rest_for_higher_work() -> None:
    b, _, _ = make(limit=4, shares={Priority.SHEDDABLE: 0.25})
    critical = b.try_admit(priority=Priority.CRITICAL)
    batch = b.try_admit(priority=Priority.SHEDDABLE)
    with pytest.raises(Rejected) as e:
        b.try_admit(priority=Priority.SHEDDABLE)
    assert e.value.reason is Reason.OVERLOADED
    critical.success()
    batch.success()
    assert b.in_flight == 0


def test_forced_full_refuses_but_keeps_the_reserve() -> None:
    b, _, _ = make(limit=4, reserve=1)
    b.force_full()
    with pytest.raises(Rejected) as e, b.admit():
        pass
    assert e.value.reason is Reason.QUEUE_FULL
    with pytest.raises(Rejected):
        b.try_admit()
    with b.admit(priority=Priority.CRITICAL_PLUS):
        assert b.in_flight == 1
    b.force_full(False)
    with b.admit():
        assert b.in_flight == 1


def test_gauges_read_from_another_thread() -> None:
    b, clock, _ = make(limit=1, queue=FifoQueue(max_size=4, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)
    waiter = Waiter(b, caller="w")
    until(lambda: b.queue_depth == 1)
    clock.advance(0.25)
    gauges = {name: value for name, _, value in b.gauges()}
    assert gauges == {"in_flight": 1, "limit": 1, "queue_depth": 1, "queue_oldest_age": 0.25}
    holder.release()
    assert waiter.admitted.wait(SETTLE)
    waiter.release()


def test_async_with_waits_without_blocking_the_loop() -> None:
    b, _, rec = make(limit=1, queue=FifoQueue(max_size=4, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)

    async def main() -> None:
        async def use() -> None:
            async with b.admit(caller="async"):
                assert b.in_flight == 1

        task = asyncio.create_task(use())
        while b.queue_depth == 0:
            await asyncio.sleep(0.001)
        threading.Thread(target=holder.release).start()
        await asyncio.wait_for(task, SETTLE)

    asyncio.run(main())
    assert b.in_flight == 0
    assert [c.caller for c in rec.of(RequestCompleted)] == ["holder", "async"]


def test_a_cancelled_async_waiter_leaves_the_queue() -> None:
    b, _, rec = make(limit=1, queue=FifoQueue(max_size=4, max_wait=60.0))
    holder = Waiter(b, caller="holder")
    assert holder.admitted.wait(SETTLE)

    async def main() -> None:
        async def use() -> None:
            async with b.admit(caller="async"):
                pass

        task = asyncio.create_task(use())
        while b.queue_depth == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert b.queue_depth == 0
    holder.release()
    assert b.in_flight == 0
    assert [a.caller for a in rec.of(RequestAbandoned)] == ["async"]


def test_statement_timeout_ms_rounds_up_and_never_to_zero() -> None:
    clock = ManualClock(100.0)
    with brownout.deadline(Deadline(100.0004, clock)):
        assert brownout.statement_timeout_ms(5.0) == 1  # 0 would mean no timeout at all
    with brownout.deadline(Deadline(101.2501, clock)):
        assert brownout.statement_timeout_ms(5.0) == 1251
        assert brownout.statement_timeout_ms(0.2) == 200
    assert brownout.statement_timeout_ms(0.2) == 200  # no deadline: the normal timeout
    with brownout.deadline(Deadline(100.0, clock)), pytest.raises(Rejected) as e:
        brownout.statement_timeout_ms(5.0)
    assert e.value.reason is Reason.DEADLINE_EXPIRED
