"""The testing kit (`brownout.testing`): a bulkhead forced full refuses as a full one would,
forced modes and bulkheads are restored, recorded events answer what was shed and why, and
deadlines run on virtual time."""

from __future__ import annotations

import asyncio

import pytest

import brownout
from brownout import Bulkhead, DegradedMode, DegradedModes, Priority, Reason, Rejected
from brownout.events import EventHub, RequestAdmitted, RequestShed
from brownout.limits import AIMDLimit, FixedLimit
from brownout.testing import (
    EventRecorder,
    Forcing,
    ManualClock,
    VirtualTime,
    forced_full,
    forced_mode,
)


def bulkhead(hub: EventHub, limit: int = 4, **kw: object) -> Bulkhead:
    return Bulkhead("db", FixedLimit(limit), events=hub, **kw)  # type: ignore[arg-type]


async def test_forced_full_refuses_with_the_real_reason_and_event() -> None:
    hub = EventHub()
    with EventRecorder(hub) as rec:
        b = bulkhead(hub)
        b.force_full()
        assert b.forced_full is Reason.QUEUE_FULL
        with pytest.raises(Rejected) as refused:
            async with b.admit(operation="/search", priority=Priority.SHEDDABLE):
                pytest.fail("admitted while forced full")
        assert refused.value.reason is Reason.QUEUE_FULL
        assert "forced full" in str(refused.value)
        (shed,) = rec.assert_shed(reason=Reason.QUEUE_FULL, operation="/search", count=1)
        assert shed.priority is Priority.SHEDDABLE
        assert shed.false_positive is False  # slots are free, but the refusal is on purpose
        with pytest.raises(Rejected) as tried:
            b.try_admit()
        assert tried.value.reason is Reason.OVERLOADED
        assert b.in_flight == 0 and b.queue_depth == 0
        b.force_full(False)
        async with b.admit():
            assert b.in_flight == 1
    assert rec.shed_counts() == {Reason.QUEUE_FULL: 1, Reason.OVERLOADED: 1}


async def test_the_forced_reason_can_be_a_queue_timeout_or_overload() -> None:
    hub = EventHub()
    b = bulkhead(hub)
    for reason in (Reason.QUEUE_TIMEOUT, Reason.OVERLOADED):
        b.force_full(reason=reason)
        with pytest.raises(Rejected) as refused:
            async with b.admit():
                pass
        assert refused.value.reason is reason
    with pytest.raises(ValueError, match="QUEUE_FULL"):
        b.force_full(reason=Reason.QUOTA)


async def test_checks_before_capacity_still_come_first() -> None:
    clock = ManualClock(10.0)
    b = Bulkhead("db", FixedLimit(4), clock=clock, events=EventHub())
    b.force_full()
    with pytest.raises(Rejected) as refused:
        async with b.admit(deadline=brownout.Deadline(9.0, clock)):
            pass
    assert refused.value.reason is Reason.DEADLINE_EXPIRED


async def test_critical_plus_keeps_the_reserve_while_forced() -> None:
    b = bulkhead(EventHub(), reserve=1)
    b.force_full()
    async with b.admit(priority=Priority.CRITICAL_PLUS):
        with pytest.raises(Rejected):  # the reserve is one slot
            async with b.admit(priority=Priority.CRITICAL_PLUS):
                pass
    async with b.admit(priority=Priority.CRITICAL_PLUS):
        pass


async def test_forced_full_takes_every_path_off_the_fast_one() -> None:
    for b in (bulkhead(EventHub()), Bulkhead("db", AIMDLimit(4), events=EventHub())):
        now = asyncio.get_running_loop().time()
        assert b.admit_uncontended(Priority.CRITICAL, "c", "op", now, 1.0) is not None
        b._in_flight = 0  # (the slot of the permit above, which is not settled)
        b.force_full()
        assert b.admit_uncontended(Priority.CRITICAL, "c", "op", now, 1.0) is None
        with pytest.raises(Rejected):
            async with b.admit():
                pass
        b.force_full(False)
        assert b.admit_uncontended(Priority.CRITICAL, "c", "op", now, 1.0) is not None


async def test_waiters_get_no_slot_while_forced_and_one_when_released() -> None:
    b = bulkhead(EventHub(), limit=1)
    got: list[str] = []

    async def wait() -> None:
        async with b.admit():
            got.append("in")

    permit = b.try_admit()
    waiter = asyncio.create_task(wait())
    await asyncio.sleep(0)
    assert b.queue_depth == 1
    b.force_full()
    permit.success()  # a slot frees, but the bulkhead is held full
    await asyncio.sleep(0)
    assert got == [] and b.queue_depth == 1
    b.force_full(False)
    await asyncio.wait_for(waiter, 5)
    assert got == ["in"]


async def test_forced_full_context_restores_the_previous_switch() -> None:
    b = bulkhead(EventHub())
    with forced_full(b):
        assert b.forced_full is Reason.QUEUE_FULL
        with forced_full(b, Reason.OVERLOADED):
            assert b.forced_full is Reason.OVERLOADED
        assert b.forced_full is Reason.QUEUE_FULL
    assert b.forced_full is None
    async with b.admit():
        pass


def modes() -> DegradedModes:
    return DegradedModes(
        [DegradedMode("recs", "hide recommendations"), DegradedMode("search", "cached search")],
        clock=ManualClock(),
        events=EventHub(),
    )


def test_forced_mode_turns_modes_on_and_restores_their_control() -> None:
    m = modes()
    m.force("search", False)
    with forced_mode(m, "recs", "search"):
        assert m.active("recs") and m.active("search")
    assert not m.active("recs") and m.forced("recs") is None
    assert m.forced("search") is False
    with pytest.raises(KeyError):
        with forced_mode(m, "nope"):
            pass


def test_forcing_undoes_everything_on_restore() -> None:
    m, b = modes(), bulkhead(EventHub())
    forcing = Forcing()
    forcing.full(b)
    forcing.mode(m, "recs")
    assert b.forced_full is Reason.QUEUE_FULL and m.active("recs")
    forcing.restore()
    assert b.forced_full is None and not m.active("recs")


async def test_recorder_assertions_say_what_was_seen() -> None:
    hub = EventHub()
    rec = EventRecorder(hub).start()
    assert hub.enabled and not hub.tallying  # per-request events, not tallies
    b = bulkhead(hub)
    async with b.admit(operation="/home"):
        pass
    rec.assert_not_shed()
    b.force_full()
    with pytest.raises(Rejected):
        async with b.admit(operation="/search", priority=Priority.SHEDDABLE, caller="bot"):
            pass
    rec.assert_shed()
    rec.assert_shed(operation="/search", priority=Priority.SHEDDABLE, caller="bot", source="db")
    assert rec.shed(operation="/home") == []
    assert len(rec.of(RequestAdmitted)) == 1
    with pytest.raises(AssertionError) as failed:
        rec.assert_shed(reason=Reason.QUEUE_TIMEOUT, operation="/search")
    message = str(failed.value)
    assert "expected at least one shed with reason=QUEUE_TIMEOUT, operation='/search'" in message
    assert "reason=QUEUE_FULL" in message and "operation='/search'" in message
    assert "RequestAdmitted x1" in message
    with pytest.raises(AssertionError, match="expected no shed with operation='/search'"):
        rec.assert_not_shed(operation="/search")
    with pytest.raises(AssertionError, match="exactly 2 shed"):
        rec.assert_shed(count=2)
    rec.stop()
    assert not hub.enabled
    rec.clear()
    assert rec.events == []


def test_recorder_memory_is_bounded() -> None:
    hub = EventHub()
    with EventRecorder(hub, max_events=3) as rec:
        for i in range(5):
            hub.emit(
                RequestShed(float(i), "s", "op", Priority.CRITICAL, "c", Reason.QUOTA, None, 0.0)
            )
    assert [e.at for e in rec.events] == [2.0, 3.0, 4.0]
    assert rec.dropped == 2
    assert "2 older events were dropped" in rec.report()
    with pytest.raises(ValueError):
        EventRecorder(hub, max_events=0)


async def test_virtual_time_deadline_moves_only_when_advanced() -> None:
    vt = VirtualTime()
    b = Bulkhead("db", FixedLimit(2), clock=vt.clock, events=EventHub())
    with vt.deadline(0.2, operation="/search", priority=Priority.SHEDDABLE):
        assert brownout.remaining() == pytest.approx(0.2)
        assert brownout.current().operation == "/search"
        vt.advance(0.15)
        assert brownout.remaining() == pytest.approx(0.05)
        async with b.admit():
            pass
        vt.advance(0.1)
        assert brownout.remaining() == 0.0
        with pytest.raises(Rejected) as refused:
            async with b.admit():
                pass
        assert refused.value.reason is Reason.DEADLINE_EXPIRED
    assert brownout.remaining() is None
    with pytest.raises(ValueError):
        vt.advance(-1)


def test_the_fixtures_are_loaded(
    brownout_time: VirtualTime,
    brownout_clock: ManualClock,
    brownout_events: EventRecorder,
    brownout_force: Forcing,
) -> None:
    assert brownout_clock is brownout_time.clock
    assert brownout_events in brownout.events.hub.sinks
