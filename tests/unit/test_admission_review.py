"""Review of admission and quota edge cases: each test pins a defect that was found and fixed
(A3, A4, A5, D7, S3, S8), or a race that was checked and holds."""

from __future__ import annotations

import asyncio

import pytest

from brownout import (
    Bulkhead,
    Deadline,
    EventHub,
    FifoQueue,
    FixedLimit,
    Gradient2Limit,
    LatencyEstimator,
    Priority,
    Reason,
    Rejected,
    VegasLimit,
)
from brownout.admission.queues import PriorityCoDelQueue
from brownout.events import RequestAbandoned

pytestmark = pytest.mark.looptime


# -- A5: latency-based limits on zero-rtt samples ---------------------------------------------
@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
@pytest.mark.parametrize("warm_rtt", [0.0, 0.01])
def test_probing_limits_take_zero_rtt_samples(make: type, warm_rtt: float) -> None:
    # A coarse clock (or virtual time, or work that never awaits) measures rtt 0.0: a limit
    # must stay a number within its bounds, not raise ZeroDivisionError.
    lim = make(4, min_limit=2, max_limit=50)
    for i in range(40):
        lim.on_sample(i * 0.01, warm_rtt, 4, False)
    for i in range(200):
        n = lim.on_sample(1.0 + i * 0.01, 0.0, lim.limit, False)
        assert 2 <= n <= 50


async def test_zero_rtt_release_still_hands_the_slot_to_a_waiter() -> None:
    # Through a bulkhead: on virtual time a block that does not await has rtt 0.0; its
    # release must not raise, and the freed slot must reach the waiter.
    b = Bulkhead("g", Gradient2Limit(1, max_limit=1), FifoQueue(4, 5.0), events=EventHub())
    got: list[int] = []

    async def waiter() -> None:
        async with b.admit():
            got.append(1)

    async with b.admit():
        t = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        assert b.queue_depth == 1
    await asyncio.wait_for(t, 10)
    assert got == [1] and b.in_flight == 0


# -- D7 / S3: the entry estimate counts only the work that will be served first ---------------
async def test_deadline_estimate_ignores_lower_priority_waiters() -> None:
    # 10 SHEDDABLE waiters stand in a FIFO queue behind one 100 ms request. A CRITICAL request
    # with 450 ms left is served next (at ~100 ms, done at ~200 ms): refusing it as
    # DEADLINE_TOO_SHORT because of the batch backlog it overtakes inverts priority.
    est = LatencyEstimator(min_samples=1)
    est.observe("op", 0.1)
    b = Bulkhead("d", FixedLimit(1), FifoQueue(16, 10.0), estimator=est, events=EventHub())

    async def run(priority: Priority, deadline: Deadline | None) -> None:
        async with b.admit(priority=priority, operation="op", deadline=deadline):
            await asyncio.sleep(0.1)

    holder = asyncio.create_task(run(Priority.CRITICAL, None))
    await asyncio.sleep(0)
    batch = [asyncio.create_task(run(Priority.SHEDDABLE, None)) for _ in range(10)]
    await asyncio.sleep(0)
    assert b.queue_depth == 10
    start = asyncio.get_running_loop().time()
    await run(Priority.CRITICAL, Deadline.after(0.45))
    assert asyncio.get_running_loop().time() - start == pytest.approx(0.2)
    await holder
    for t in batch:
        t.cancel()
    await asyncio.gather(*batch, return_exceptions=True)


async def test_deadline_estimate_still_counts_work_ahead() -> None:
    # The same check keeps refusing what cannot fit behind equal-or-higher work.
    est = LatencyEstimator(min_samples=1)
    est.observe("op", 0.1)
    b = Bulkhead("d", FixedLimit(1), FifoQueue(16, 10.0), estimator=est, events=EventHub())
    hold = b.try_admit(operation="op")
    waiters = [
        asyncio.create_task(b.admit(priority=Priority.CRITICAL, operation="op").__aenter__())
        for _ in range(5)
    ]
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as info:
        await b.admit(
            priority=Priority.CRITICAL, operation="op", deadline=Deadline.after(0.45)
        ).__aenter__()
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    hold.success()


# -- A3 / A4: a standing class's short age bound holds for work that arrives later -------------
async def test_sweep_rearms_for_a_waiter_due_before_it() -> None:
    # PriorityCoDelQueue: the CRITICAL class stands (busy for a whole interval), its last
    # waiter ages out at the 5 ms target and the class refills 2 ms later: the newcomer
    # continues the standing period, so it may wait 5 ms. The one sweep timer was armed for
    # the SHEDDABLE waiter's 100 ms bound; the newcomer must not wait until then.
    loop = asyncio.get_running_loop()
    b = Bulkhead("s", FixedLimit(1), PriorityCoDelQueue(8), events=EventHub())
    hold = b.try_admit()
    t0 = loop.time()

    async def wait(priority: Priority) -> float:
        with pytest.raises(Rejected) as info:
            await b.admit(priority=priority).__aenter__()
        assert info.value.reason is Reason.QUEUE_TIMEOUT
        return loop.time() - t0

    c1 = asyncio.create_task(wait(Priority.CRITICAL))
    await asyncio.sleep(0.06)
    b1 = asyncio.create_task(wait(Priority.SHEDDABLE))
    await asyncio.sleep(0.038)
    c2 = asyncio.create_task(wait(Priority.CRITICAL))
    await asyncio.sleep(0.007)  # t = 105 ms: c1 aged out at 100 ms, c2 at 103 ms
    assert c1.done() and c2.done() and b.queue_depth == 1
    c3 = asyncio.create_task(wait(Priority.CRITICAL))
    assert await c1 == pytest.approx(0.1, abs=1e-4)
    assert await c2 == pytest.approx(0.103, abs=1e-4)
    assert await c3 == pytest.approx(0.110, abs=1e-4)  # its 5 ms bound, not the 160 ms sweep
    assert await b1 == pytest.approx(0.16, abs=1e-4)
    hold.success()


# -- O1: a waiter cancelled just before its turn is counted as abandoned -----------------------
async def test_waiter_cancelled_in_the_tick_its_slot_frees_is_abandoned() -> None:
    # w1 is cancelled and, before its task runs again, the holder releases: the slot skips
    # the dead waiter and goes to w2 (no leak), and w1 is still reported as abandoned, as it
    # is when the release comes a tick later. Otherwise it was offered and then vanished.
    events = EventHub()
    seen: list[object] = []
    events.subscribe(type("Sink", (), {"emit": staticmethod(seen.append)})())
    b = Bulkhead("c", FixedLimit(1), FifoQueue(8, 5.0), events=events)
    p = b.try_admit()
    w1 = asyncio.create_task(b.admit().__aenter__())
    w2 = asyncio.create_task(b.admit().__aenter__())
    await asyncio.sleep(0.01)
    w1.cancel()
    p.success()
    r1, r2 = await asyncio.gather(w1, w2, return_exceptions=True)
    assert isinstance(r1, asyncio.CancelledError)
    assert b.in_flight == 1 and b.queue_depth == 0
    r2.success()  # type: ignore[union-attr]
    assert b.in_flight == 0
    abandoned = [e for e in seen if isinstance(e, RequestAbandoned)]
    assert len(abandoned) == 1 and abandoned[0].latency == pytest.approx(0.01)
    assert b.queue.served == 1 and b.queue.removed == 1


async def test_waiter_cancelled_in_the_tick_it_is_evicted_is_abandoned() -> None:
    # The same race on the refusal side: the pusher's step runs before the cancelled
    # waiter's, evicts it from the full queue, and the waiter must still be reported.
    events = EventHub()
    seen: list[object] = []
    events.subscribe(type("Sink", (), {"emit": staticmethod(seen.append)})())
    b = Bulkhead("c", FixedLimit(1), FifoQueue(1, 5.0), events=events)
    p = b.try_admit()
    w = asyncio.create_task(b.admit(priority=Priority.SHEDDABLE).__aenter__())
    await asyncio.sleep(0.01)
    pusher = asyncio.create_task(b.admit(priority=Priority.CRITICAL).__aenter__())
    w.cancel()
    await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await w
    assert len([e for e in seen if isinstance(e, RequestAbandoned)]) == 1
    p.success()
    (await pusher).success()
    assert b.in_flight == 0 and b.queue_depth == 0
