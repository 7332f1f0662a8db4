"""The default clock reads the running loop's time, through a cache that must never go stale:
another thread, a stopped loop, a loop whose class changed (looptime), a patched instance."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from brownout import Deadline, LoopClock
from brownout._clock import current_task_of, loop_and_time, now, running_loop
from brownout._deadline import new_deadline


class FixedTimeLoop(asyncio.SelectorEventLoop):
    """A loop on virtual time (as looptime's subclasses are)."""

    offset = 1_000_000.0

    def time(self) -> float:
        return self.offset + super().time()


def read_inside(loop: asyncio.AbstractEventLoop) -> tuple[float, float, float]:
    async def read() -> tuple[float, float, float]:
        return LoopClock().now(), now(), asyncio.get_running_loop().time()

    return loop.run_until_complete(read())


def test_inside_a_stock_loop_it_is_the_loop_time_and_outside_it_is_monotonic() -> None:
    loop = asyncio.new_event_loop()
    try:
        for _ in range(3):  # the second and third reads come from the cache
            clock_now, module_now, loop_now = read_inside(loop)
            assert abs(clock_now - loop_now) < 0.01
            assert abs(module_now - loop_now) < 0.01
    finally:
        loop.close()
    # the cached loop has stopped: outside any loop the clock is time.monotonic()
    assert abs(LoopClock().now() - time.monotonic()) < 0.01


def test_a_loop_with_its_own_time_is_read_through_it() -> None:
    loop = FixedTimeLoop()
    try:
        for _ in range(3):
            clock_now, module_now, loop_now = read_inside(loop)
            assert clock_now > FixedTimeLoop.offset
            assert abs(clock_now - loop_now) < 0.01 and abs(module_now - loop_now) < 0.01
    finally:
        loop.close()


def test_a_class_switched_between_runs_is_noticed() -> None:
    loop = asyncio.SelectorEventLoop()
    try:
        stock, _, _ = read_inside(loop)  # cached as a stock loop
        assert stock < FixedTimeLoop.offset
        loop.__class__ = FixedTimeLoop  # what looptime does to a test's loop
        switched, _, loop_now = read_inside(loop)
        assert switched > FixedTimeLoop.offset
        assert abs(switched - loop_now) < 0.01
    finally:
        loop.close()


def test_a_time_patched_on_the_instance_is_honoured() -> None:
    loop = asyncio.new_event_loop()
    loop.time = lambda: 42.0  # type: ignore[method-assign]
    try:
        clock_now, module_now, _ = read_inside(loop)
        assert clock_now == 42.0 and module_now == 42.0
    finally:
        loop.close()


def test_two_threads_with_their_own_loops_each_read_their_own() -> None:
    results: dict[str, list[bool]] = {"stock": [], "virtual": []}
    start = threading.Barrier(2)

    def run(kind: str) -> None:
        loop = FixedTimeLoop() if kind == "virtual" else asyncio.new_event_loop()

        async def reads() -> None:
            for _ in range(200):
                # in lock step: each read follows one by the other thread, whose loop is then
                # in the cache (and running)
                start.wait()
                virtual = LoopClock().now() > FixedTimeLoop.offset
                results[kind].append(virtual == (kind == "virtual"))
                time.sleep(0.0005)

        try:
            loop.run_until_complete(reads())
        finally:
            loop.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["stock"] and all(results["stock"])
    assert results["virtual"] and all(results["virtual"])


def test_running_loop_is_asyncios_answer_and_raises_outside_a_loop() -> None:
    loop = asyncio.new_event_loop()

    async def both() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return running_loop(), running_loop()  # the second from the cache

    try:
        first, second = loop.run_until_complete(both())
        assert first is loop and second is loop
    finally:
        loop.close()
    with pytest.raises(RuntimeError):
        running_loop()  # the cached loop stopped: no stale answer


def test_loop_and_time_answer_as_the_loop_does_from_the_cache_or_not() -> None:
    for loop in (asyncio.new_event_loop(), FixedTimeLoop()):

        async def read() -> list[tuple[asyncio.AbstractEventLoop, float, float]]:
            running = asyncio.get_running_loop()
            out = []
            for _ in range(3):  # the first may miss the cache, the others hit it
                got, t = loop_and_time()
                out.append((got, t, running.time()))
            return out

        try:
            for got, t, loop_time in loop.run_until_complete(read()):
                assert got is loop
                assert abs(t - loop_time) < 0.01  # the loop's own time, virtual or not
        finally:
            loop.close()
    with pytest.raises(RuntimeError):
        loop_and_time()  # the cached loop stopped: no stale answer


def testnew_deadline_is_an_ordinary_immutable_deadline() -> None:
    d = new_deadline(12.5)
    assert type(d) is Deadline and d.at == 12.5 and d == Deadline(12.5)
    with pytest.raises(AttributeError):
        d.at = 1.0  # type: ignore[misc]


def test_current_task_of_is_asyncio_current_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert current_task_of(loop) is asyncio.current_task() is not None

        async def me() -> object:
            return current_task_of(loop)

        inner = asyncio.create_task(me())
        assert await inner is inner  # each task sees itself
        seen: list[object] = []
        loop.call_soon(lambda: seen.append(current_task_of(loop)))
        await asyncio.sleep(0)
        assert seen == [None]  # a plain callback runs outside any task, as asyncio says

    asyncio.run(main())


def test_uvloop_is_read_directly_and_never_cached() -> None:
    """uvloop's loop records no thread, so the cache cannot validate it: every call asks
    asyncio for the running loop (one frame, no stale answer), and a stock loop cached before
    is not mistaken for it."""
    uvloop = pytest.importorskip("uvloop")

    stock = asyncio.new_event_loop()
    stock.run_until_complete(_read_clocks())  # caches the stock loop
    stock.close()

    loop = uvloop.new_event_loop()
    try:
        for got, t, loop_time, now_t, running, task in loop.run_until_complete(_read_clocks()):
            assert got is loop and running is loop
            assert abs(t - loop_time) < 0.01 and abs(now_t - loop_time) < 0.01
            assert task is not None
    finally:
        loop.close()


async def _read_clocks() -> list[tuple[object, float, float, float, object, object]]:
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(3):
        got, t = loop_and_time()
        out.append((got, t, loop.time(), now(), running_loop(), current_task_of(loop)))
    return out
