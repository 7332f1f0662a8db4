"""The loop-lag probe and what the bulkhead does with it (on virtual time)."""

from __future__ import annotations

import asyncio
import math

import pytest
from tests.limits import SpyLimit

import brownout
import brownout.testing
from brownout import Bulkhead, Reason, Rejected
from brownout._admission.loop_lag import loop_lag
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.signals import LoopLag


def test_the_mean_follows_the_lateness_with_its_time_constant() -> None:
    lag = LoopLag(interval=0.01, smoothing=0.1)
    for _ in range(10):  # 0.2 s of ticks each 10 ms late: two time constants
        lag.observe(0.010, 0.02)
    assert lag.mean == pytest.approx(0.010 * (1 - math.exp(-2.0)), rel=1e-9)
    assert lag.peak == pytest.approx(0.010)
    for _ in range(50):  # on time again for 0.5 s: the mean fades, the peak halves 5 times
        lag.observe(0.0, 0.01)
    assert lag.mean == pytest.approx(0.010 * (1 - math.exp(-2.0)) * math.exp(-5.0), rel=1e-9)
    assert lag.peak == pytest.approx(0.010 / 32, rel=1e-9)
    lag.observe(-0.001, 0.01)  # early (a coarse clock) is on time, not negative lag
    assert lag.lag == 0.0 and lag.ticks == 61


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_settings_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        LoopLag(interval=bad)
    with pytest.raises(ValueError, match="positive"):
        LoopLag(smoothing=bad)
    if not bad > 0:  # inf is "never"
        with pytest.raises(ValueError, match="shed_lag"):
            Bulkhead("x", FixedLimit(1), shed_lag=bad)


async def test_the_adaptive_limit_learns_the_work_latency_less_the_loop_lag() -> None:
    clock = brownout.testing.ManualClock(100.0)
    lag = LoopLag()
    limit = SpyLimit()
    b = Bulkhead("x", limit, clock=clock, loop_lag=lag)
    p = b.try_admit()
    clock.advance(0.050)
    p.success()
    lag.mean = 0.008  # the loop now runs due callbacks 8 ms late
    p = b.try_admit()
    clock.advance(0.050)
    p.success()
    lag.mean = 0.040  # more than half the sample: only half of it is discounted
    p = b.try_admit()
    clock.advance(0.050)
    p.success()
    assert limit.samples == pytest.approx([0.050, 0.042, 0.025])


async def test_a_lagging_loop_refuses_instead_of_queueing() -> None:
    clock = brownout.testing.ManualClock(100.0)
    lag = LoopLag()
    b = Bulkhead("x", FixedLimit(1), FifoQueue(4, 5.0), clock=clock, loop_lag=lag)
    held = b.try_admit()
    lag.mean = 0.019  # below shed_lag (20 ms): it queues
    waiter = asyncio.create_task(b.admit().__aenter__())
    await asyncio.sleep(0)
    assert b.queue_depth == 1
    lag.mean = 0.025
    with pytest.raises(Rejected) as info:
        await b.admit().__aenter__()
    assert info.value.reason is Reason.OVERLOADED
    assert "25 ms late" in info.value.detail
    assert b.queue_depth == 1  # nothing queued, the waiter keeps its place
    held.success()
    (await waiter).success()
    assert b.in_flight == 0


async def test_without_a_probe_or_with_shed_lag_inf_lag_never_refuses() -> None:
    clock = brownout.testing.ManualClock(100.0)
    for kw in ({"loop_lag": None}, {"loop_lag": LoopLag(), "shed_lag": math.inf}):
        b = Bulkhead("x", FixedLimit(1), FifoQueue(4, 5.0), clock=clock, **kw)  # type: ignore[arg-type]
        probe = kw["loop_lag"]
        if isinstance(probe, LoopLag):
            probe.mean = 10.0
        held = b.try_admit()
        waiter = asyncio.create_task(b.admit().__aenter__())
        await asyncio.sleep(0)
        assert b.queue_depth == 1
        held.success()
        (await waiter).success()


async def test_the_shared_probe_ticks_on_the_running_loop() -> None:
    probe = loop_lag()
    assert probe is loop_lag() and probe.running
    await asyncio.sleep(0.05)
    assert probe.ticks >= 2
    # A bulkhead on the loop's own clock uses it by default, and only then.
    b = Bulkhead("x", FixedLimit(1), FifoQueue(4, 5.0))
    held = b.try_admit()
    probe.mean = 1.0
    with pytest.raises(Rejected):
        await b.admit().__aenter__()
    probe.mean = 0.0
    held.success()
    probe.stop()
    assert not probe.running and loop_lag() is not probe
