"""The request context and deadline scopes (D1, D5), on virtual time (looptime)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading

import pytest

import brownout
import brownout.testing
from brownout import Deadline, DeadlineExceeded, Priority, RequestContext
from brownout.testing import ManualClock
from brownout.wire import attach


def test_empty_context_outside_requests() -> None:
    ctx = brownout.current()
    assert ctx.deadline is None
    assert brownout.remaining() is None
    assert ctx.priority is Priority.CRITICAL


def test_sync_scope_sets_and_restores() -> None:
    with brownout.request(deadline=1.0, caller="alice", operation="checkout") as ctx:
        assert brownout.current() is ctx
        assert ctx.caller == "alice"
        remaining = brownout.remaining()
        assert remaining is not None and 0.9 < remaining <= 1.0
    assert brownout.current().caller == "unknown"


def test_nested_scopes_only_shorten() -> None:
    with brownout.deadline(1.0):
        outer = brownout.current().deadline
        with brownout.deadline(60.0):
            assert brownout.current().deadline is outer
        with brownout.deadline(0.5):
            inner = brownout.current().deadline
            assert inner is not None and outer is not None and inner.at < outer.at
    ctx = RequestContext(deadline=brownout.Deadline.after(1.0))
    longer = ctx.replace(deadline=brownout.Deadline.after(10.0))
    assert longer.deadline is ctx.deadline


def test_context_is_immutable() -> None:
    with pytest.raises(AttributeError):
        brownout.current().caller = "x"  # type: ignore[misc]


def test_check_deadline_for_sync_code() -> None:
    clock = brownout.testing.ManualClock()
    with brownout.deadline(brownout.Deadline.after(1.0, clock=clock)):
        brownout.check_deadline()
        clock.advance(2.0)
        with pytest.raises(DeadlineExceeded):
            brownout.check_deadline()


@pytest.mark.looptime
async def test_async_scope_cancels_at_expiry_on_virtual_time() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(DeadlineExceeded) as info:
        async with brownout.deadline(1.2):
            await asyncio.sleep(100)
    assert isinstance(info.value, TimeoutError)
    assert loop.time() - start == pytest.approx(1.2)


@pytest.mark.looptime
async def test_inner_longer_scope_is_still_bounded_by_outer() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(DeadlineExceeded):
        async with brownout.deadline(1.0), brownout.deadline(30.0):
            assert brownout.remaining() == pytest.approx(1.0)
            await asyncio.sleep(100)
    assert loop.time() - start == pytest.approx(1.0)


@pytest.mark.looptime
async def test_work_that_finishes_in_time_is_untouched() -> None:
    async with brownout.deadline(1.0):
        await asyncio.sleep(0.9)
    assert brownout.remaining() is None


@pytest.mark.looptime
async def test_taskgroup_children_are_cancelled_with_the_scope() -> None:
    cancelled: list[str] = []

    async def child(name: str) -> None:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    with pytest.raises(DeadlineExceeded):
        async with brownout.deadline(0.5), asyncio.TaskGroup() as tg:
            tg.create_task(child("a"))
            tg.create_task(child("b"))
    assert sorted(cancelled) == ["a", "b"]


@pytest.mark.looptime
async def test_outer_cancellation_is_never_swallowed() -> None:
    async def work() -> None:
        async with brownout.deadline(10.0):
            await asyncio.sleep(100)

    task = asyncio.create_task(work())
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.looptime
async def test_outer_timeout_is_not_reported_as_our_deadline() -> None:
    with pytest.raises(TimeoutError) as info:
        async with asyncio.timeout(0.5):
            async with brownout.deadline(10.0):
                await asyncio.sleep(100)
    assert not isinstance(info.value, DeadlineExceeded)


@pytest.mark.looptime
async def test_expired_deadline_refuses_to_start() -> None:
    ran = False
    with pytest.raises(DeadlineExceeded):
        async with brownout.deadline(0.0):
            ran = True
    assert not ran


@pytest.mark.looptime
async def test_context_follows_tasks() -> None:
    async with brownout.request(deadline=2.0, caller="bob", priority=Priority.SHEDDABLE):
        seen = await asyncio.create_task(asyncio.sleep(0.1, result=brownout.current()))
    assert seen.caller == "bob"
    assert seen.priority is Priority.SHEDDABLE


async def test_context_reaches_to_thread() -> None:
    # asyncio.to_thread copies the context; remaining time keeps counting down there.
    async with brownout.request(deadline=5.0, caller="carol"):
        caller, left = await asyncio.to_thread(
            lambda: (brownout.current().caller, brownout.remaining())
        )
    assert caller == "carol"
    assert left is not None and 4.0 < left <= 5.0


async def test_run_in_executor_needs_bind() -> None:
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        async with brownout.request(deadline=5.0, caller="dave"):
            unbound = await loop.run_in_executor(pool, lambda: brownout.current().caller)
            bound = await loop.run_in_executor(
                pool, brownout.bind(lambda: brownout.current().caller)
            )
    assert unbound == "unknown"  # executors do not copy contextvars by themselves
    assert bound == "dave"


def test_bind_for_raw_threads() -> None:
    out: list[str] = []
    with brownout.request(caller="erin"):
        t = threading.Thread(target=brownout.bind(lambda: out.append(brownout.current().caller)))
    t.start()
    t.join()
    assert out == ["erin"]


def test_a_copied_context_carries_the_request_and_is_independent_of_it() -> None:
    # What bind and asyncio.to_thread rely on: a copy holds the request as it was copied, and
    # whatever is attached inside the copy stays there.
    with brownout.request(caller="erin", deadline=5.0) as ctx:
        copied = contextvars.copy_context()
    assert brownout.current().caller == "unknown"  # the scope ended; the copy keeps it
    assert copied.run(brownout.current) is ctx
    copied.run(attach, RequestContext(caller="frank"))
    assert copied.run(brownout.current).caller == "frank"
    assert brownout.current().caller == "unknown"  # the original never saw frank
    again = contextvars.copy_context()
    assert again.run(brownout.current).caller == "unknown"


@pytest.mark.looptime
async def test_nan_and_foreign_clock_deadlines() -> None:
    with pytest.raises(ValueError, match="NaN"):
        async with brownout.deadline(float("nan")):
            pass
    # A deadline on another clock is translated onto the loop's timers by its remaining time.
    manual = brownout.testing.ManualClock(1000.0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(DeadlineExceeded):
        async with brownout.deadline(brownout.Deadline.after(2.0, clock=manual)):
            await asyncio.sleep(100)
    assert loop.time() - start == pytest.approx(2.0)


@pytest.mark.looptime
async def test_request_scope_sets_fields_and_enforces_deadline() -> None:
    with pytest.raises(DeadlineExceeded):
        async with brownout.request(deadline=0.5, caller="x", operation="op") as ctx:
            assert ctx.caller == "x" and ctx.operation == "op"
            await asyncio.sleep(1)
    assert brownout.current().caller == "unknown"


def test_replace_validates_fields_and_only_shortens() -> None:
    base = RequestContext(caller="a", deadline=brownout.Deadline.after(1.0))
    changed = base.replace(caller="b", attempt=3)
    assert (changed.caller, changed.attempt, changed.deadline) == ("b", 3, base.deadline)
    assert base.caller == "a"
    with pytest.raises(TypeError, match="no field"):
        base.replace(colour="red")
    with pytest.raises(AttributeError):
        changed.caller = "c"  # type: ignore[misc]


def test_attach_and_detach() -> None:
    from brownout.wire import attach, detach

    token = attach(RequestContext(caller="low-level"))
    assert brownout.current().caller == "low-level"
    detach(token)
    assert brownout.current().caller == "unknown"


# -- bind: one snapshot, entered afresh by every call -----------------------------------------


def test_bound_callable_runs_in_several_workers_at_once() -> None:
    barrier = threading.Barrier(2, timeout=5)

    def lookup() -> str:
        barrier.wait()  # both calls are inside the bound context at the same time
        return brownout.current().caller

    with brownout.request(caller="reports"):
        bound = brownout.bind(lookup)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(bound) for _ in range(2)]
        assert [f.result() for f in futures] == ["reports", "reports"]


def test_bound_callable_may_reenter_itself() -> None:
    def walk(depth: int) -> int:
        return depth if depth == 0 else bound(depth - 1)

    bound = brownout.bind(walk)
    assert bound(2) == 0


def test_bound_callable_does_not_leak_context_between_calls() -> None:
    def job() -> str:
        seen = brownout.current().caller
        attach(brownout.current().replace(caller="leaked"))  # a careless job, never detached
        return seen

    with brownout.request(caller="alice"):
        bound = brownout.bind(job)
    assert bound() == "alice"
    assert bound() == "alice"


# -- a scope never extends a deadline, whatever the clocks --------------------------------------


def test_scope_with_a_foreign_clock_deadline_does_not_extend_the_outer_one() -> None:
    manual = ManualClock(0.0)  # its instants are tiny next to the loop/monotonic clock's
    with brownout.deadline(1.0):
        with brownout.deadline(Deadline.after(100.0, clock=manual)):
            left = brownout.remaining()
            assert left is not None and left <= 1.0


def test_numeric_scope_shortens_a_foreign_clock_deadline() -> None:
    manual = ManualClock(0.0)
    with brownout.deadline(Deadline.after(100.0, clock=manual)):
        with brownout.deadline(5.0):
            left = brownout.remaining()
            assert left is not None and left <= 5.0
    # and one far in a foreign clock's future, but with little left, is kept
    late = ManualClock(1e12)
    with brownout.deadline(Deadline.after(0.5, clock=late)):
        with brownout.deadline(5.0):
            left = brownout.remaining()
            assert left is not None and left <= 0.5


def test_replace_keeps_the_earlier_deadline_across_clocks() -> None:
    manual = ManualClock(0.0)
    ctx = brownout.RequestContext(deadline=Deadline.after(1.0))
    longer = ctx.replace(deadline=Deadline.after(100.0, clock=manual))
    assert longer.deadline is ctx.deadline


@pytest.mark.looptime
@pytest.mark.parametrize(
    ("origin", "foreign", "expected"),
    [(-1000.0, 100.0, 2.0), (1e6, 0.5, 0.5)],  # foreign instants below / above the loop's
)
async def test_async_scope_keeps_the_earlier_of_loop_and_foreign_deadlines(
    origin: float, foreign: float, expected: float
) -> None:
    manual = ManualClock(origin)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(Deadline.after(foreign, clock=manual)):
            async with brownout.deadline(2.0):
                assert brownout.remaining() == pytest.approx(expected)
                await asyncio.sleep(50)
    assert loop.time() - start == pytest.approx(expected)
