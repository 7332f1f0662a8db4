"""The statements' watchdog: one timer for all running budgets, on virtual time (looptime)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from brownout._database.watchdog import Watchdog


def scheduled(loop: asyncio.AbstractEventLoop) -> int:
    """Live timers on ``loop`` (asyncio's heap, cancelled ones left out)."""
    return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]


@pytest.mark.looptime
async def test_an_overdue_statement_expires_at_its_budget_and_others_do_not() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog().for_loop(loop)
    fired: list[tuple[str, float]] = []

    def expire(name: str) -> None:
        fired.append((name, loop.time()))

    start = loop.time()
    dog.watch("short", 1.0, expire, "short")
    dog.watch("long", 3.0, expire, "long")
    dog.watch("done", 0.5, expire, "done")
    assert dog.done("done")  # ended before its budget: never expires
    await asyncio.sleep(5.0)
    assert [(name, round(at - start, 6)) for name, at in fired] == [("short", 1.0), ("long", 3.0)]
    assert not dog.done("short")  # expired already
    assert len(dog) == 0


@pytest.mark.looptime
async def test_statements_share_one_timer() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog().for_loop(loop)
    before = scheduled(loop)
    for i in range(100):
        dog.watch(i, 10.0 + i, print, i)  # later budgets: the armed timer already comes first
    assert scheduled(loop) == before + 1
    for i in range(100):
        assert dog.done(i)
    assert scheduled(loop) == before + 1  # left armed: a later wake-up finds nothing
    await asyncio.sleep(11.0)
    assert scheduled(loop) == before  # nothing running: not re-armed


@pytest.mark.looptime
async def test_an_earlier_budget_re_arms_the_timer() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog().for_loop(loop)
    fired: list[float] = []
    start = loop.time()
    dog.watch("late", 10.0, lambda _: fired.append(loop.time() - start), None)
    dog.watch("early", 2.0, lambda _: fired.append(loop.time() - start), None)
    await asyncio.sleep(12.0)
    assert [round(at, 6) for at in fired] == [2.0, 10.0]


@pytest.mark.looptime
async def test_a_finished_statements_wake_up_re_arms_for_the_next_running_one() -> None:
    loop = asyncio.get_running_loop()
    dog = Watchdog().for_loop(loop)
    fired: list[float] = []
    start = loop.time()
    dog.watch("first", 1.0, print, None)
    dog.watch("second", 4.0, lambda _: fired.append(loop.time() - start), None)
    assert dog.done("first")
    await asyncio.sleep(2.0)  # the timer woke at 1.0 for nothing, and re-armed at 4.0
    assert fired == []
    await asyncio.sleep(3.0)
    assert [round(at, 6) for at in fired] == [4.0]


async def test_each_loop_has_its_own_registrations() -> None:
    watchdog = Watchdog()
    here = watchdog.for_loop(asyncio.get_running_loop())
    assert watchdog.for_loop(asyncio.get_running_loop()) is here
    fired = threading.Event()

    def other_thread() -> None:
        async def run() -> None:
            dog = watchdog.watch("there", 0.01, lambda _: fired.set(), None)
            assert dog is not here
            assert dog is watchdog.for_loop(asyncio.get_running_loop())
            await asyncio.sleep(0.05)

        asyncio.run(run())

    here.watch("here", 60.0, print, None)
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert fired.is_set()
    assert len(watchdog) == 1  # this loop's statement still runs
    assert here.done("here")
    extra = asyncio.new_event_loop()
    try:
        watchdog.for_loop(extra)  # a new loop drops the closed loop's dog
        assert len(watchdog._dogs) == 2
    finally:
        extra.close()
