"""The virtual loop, and brownout's policy objects running unchanged on it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

import brownout
from brownout import (
    Bulkhead,
    CircuitBreaker,
    ClientThrottle,
    Dependency,
    ExponentialBackoff,
    Rejected,
    RetryBudget,
    RetryPolicy,
    TransientError,
)
from brownout.limits import AIMDLimit, FixedLimit
from brownout.queues import FifoQueue
from brownout.sim import Deadlock, VirtualLoop, run


def test_time_jumps_to_the_next_timer_without_sleeping() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        first = loop.time()
        await asyncio.gather(*(asyncio.sleep(i / 1000) for i in range(1000)))
        return first, loop.time()

    started = time.perf_counter()
    first, then = run(main())
    assert first == 3600.0
    assert then == pytest.approx(3600.999)
    assert time.perf_counter() - started < 5.0


def test_brownout_reads_the_virtual_clock() -> None:
    async def main() -> float:
        await asyncio.sleep(12.5)
        return brownout.LoopClock().now()

    assert run(main(), start=100.0) == 112.5


def test_a_wait_for_nothing_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(Deadlock):
        run(main())


def test_the_same_program_gives_the_same_trace() -> None:
    async def main() -> list[tuple[float, int]]:
        rng = random.Random(4)
        trace: list[tuple[float, int]] = []

        async def worker(i: int) -> None:
            for _ in range(20):
                await asyncio.sleep(rng.expovariate(10.0))
                trace.append((asyncio.get_running_loop().time(), i))

        await asyncio.gather(*(worker(i) for i in range(10)))
        return trace

    assert run(main()) == run(main())


def test_advance_refuses_to_go_backwards() -> None:
    loop = VirtualLoop()
    try:
        loop.advance(2.0)
        assert loop.time() == 2.0
        with pytest.raises(ValueError):
            loop.advance(-1.0)
    finally:
        loop.close()


def test_deadline_cancels_on_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(brownout.DeadlineExceeded):
            async with brownout.deadline(0.25):
                await asyncio.sleep(10.0)
        return loop.time()

    assert run(main()) == pytest.approx(0.25)


def test_bulkhead_queues_and_times_out_on_virtual_time() -> None:
    async def main() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        bulkhead = Bulkhead(
            "b", FixedLimit(2), FifoQueue(max_size=10, max_wait=1.5), reserve=0, loop_lag=None
        )
        done: list[float] = []
        refused = 0

        async def job() -> None:
            nonlocal refused
            try:
                async with bulkhead.admit():
                    await asyncio.sleep(1.0)
                done.append(loop.time())
            except Rejected:
                refused += 1

        await asyncio.gather(*(job() for _ in range(6)))
        return done, refused

    done, refused = run(main())
    assert done == [1.0, 1.0, 2.0, 2.0]  # two at a time; the last two waited past 1.5 s
    assert refused == 2


def test_an_adaptive_limit_learns_on_virtual_time() -> None:
    async def main() -> int:
        limit = AIMDLimit(initial=4, max_limit=64, timeout=0.5)
        bulkhead = Bulkhead("b", limit, loop_lag=None)

        async def job() -> None:
            async with bulkhead.admit():
                await asyncio.sleep(0.01)

        for _ in range(300):
            await asyncio.gather(*(job() for _ in range(bulkhead.limit)))
        return bulkhead.limit

    assert run(main()) > 4


def test_retry_policy_and_budget_on_virtual_time() -> None:
    async def main() -> tuple[int, float, int]:
        loop = asyncio.get_running_loop()
        calls = 0

        async def flaky() -> str:
            nonlocal calls
            calls += 1
            if calls < 3:
                raise TransientError("down", sent=False)
            return "ok"

        policy = RetryPolicy(
            3,
            budget=RetryBudget(0.1, min_per_second=1.0),
            backoff=ExponentialBackoff(1.0, jitter=False),
        )
        assert await policy.call(flaky, idempotent=True) == "ok"
        after = loop.time()
        # The budget's reserve is 10 retries per 10 s window: the 11th retry is refused.
        always = RetryPolicy(
            2,
            budget=RetryBudget(0.0, min_per_second=1.0),
            backoff=ExponentialBackoff(0.0, jitter=False),
        )
        refused = 0

        async def down() -> None:
            raise TransientError("down", sent=False)

        for _ in range(15):
            try:
                await always.call(down, idempotent=True)
            except brownout.RetriesExhausted as e:
                refused += e.stopped_by is brownout.StopReason.BUDGET
        return calls, after, refused

    calls, after, refused = run(main())
    assert (calls, after) == (3, 3.0)  # waited 1 s, then 2 s, of virtual time
    assert refused == 5


def test_breaker_opens_and_probes_on_virtual_time() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        breaker = CircuitBreaker(
            "d", window=4, minimum_calls=4, open_for=5.0, open_jitter=0.0, half_open_probes=1
        )
        dep = Dependency("d", breaker=breaker)
        healthy = False
        seen: list[str] = []

        async def call() -> None:
            if not healthy:
                raise TransientError("down", sent=False)

        for _ in range(6):
            try:
                await dep.call(call, idempotent=True)
            except Rejected as e:
                seen.append(f"{loop.time():g}:{e.reason.value}")
            except TransientError:
                seen.append(f"{loop.time():g}:failed")
            await asyncio.sleep(1.0)
        healthy = True
        await asyncio.sleep(max(0.0, 5.0 - loop.time() + 4.0))
        await dep.call(call, idempotent=True)
        seen.append(f"{loop.time():g}:{breaker.state.value}")
        return seen

    seen = run(main())
    assert seen[:4] == ["0:failed", "1:failed", "2:failed", "3:failed"]
    assert seen[4:6] == ["4:breaker_open", "5:breaker_open"]
    assert seen[-1].endswith(":closed")


def test_throttle_refuses_in_proportion_on_virtual_time() -> None:
    async def main() -> int:
        throttle = ClientThrottle(2.0, window=10.0, rng=random.Random(1))
        dep = Dependency("d", throttle=throttle)
        refused = 0

        async def overloaded() -> None:
            raise brownout.ResponseError(503)

        for _ in range(200):
            try:
                await dep.call(overloaded, idempotent=True)
            except Rejected:
                refused += 1
            except brownout.ResponseError:
                pass
            await asyncio.sleep(0.01)
        return refused

    assert run(main()) > 100


def test_dependency_timeout_and_reserve_on_virtual_time() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        dep = Dependency("d", timeout=0.3, reserve=0.05)
        seen: list[float] = []

        async def slow() -> None:
            seen.append(brownout.remaining() or 0.0)
            await asyncio.sleep(10.0)

        async with brownout.request(deadline=0.2):
            with pytest.raises(brownout.DeadlineExceeded):
                await dep.call(slow, idempotent=True)
        return seen[0], loop.time()

    budget, ended = run(main())
    assert budget == pytest.approx(0.15)  # min(timeout, remaining - reserve)
    assert ended == pytest.approx(0.15)
