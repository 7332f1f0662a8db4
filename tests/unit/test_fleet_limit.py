"""`FleetLimit`'s decisions on virtual time, with the in-process lease store (B3).

The same decisions against a real Redis, outages and the multi-process crash test are in
tests/integration/test_fleet_limit_redis.py and test_fleet_limit_crash.py.
"""

from __future__ import annotations

import math

import pytest

import brownout
from brownout import (
    BlockingInMemoryLeaseStore,
    FleetLimit,
    InMemoryLeaseStore,
    LeaseExpired,
    Priority,
    Reason,
    Rejected,
    ThreadFleetLimit,
)
from brownout._admission.protocols import AdmitsWork
from brownout.events import (
    Event,
    EventHub,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestShed,
)
from brownout.testing import ManualClock

START = 1000.0


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


def build(limit: int = 2, **kw: object) -> tuple[FleetLimit, ManualClock, ListSink]:
    clock = ManualClock(START)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    fleet = FleetLimit(
        "db",
        limit,
        store=InMemoryLeaseStore(clock=clock),
        lease=5.0,
        clock=clock,
        events=events,
        **kw,  # type: ignore[arg-type]
    )
    return fleet, clock, sink


async def test_admits_up_to_the_limit_then_refuses_overloaded() -> None:
    fleet, _, sink = build(limit=2)
    a = await fleet.acquire().__aenter__()
    b = await fleet.acquire().__aenter__()
    with pytest.raises(Rejected) as refused:
        async with fleet.acquire():
            pytest.fail("a third lease was granted")
    assert refused.value.reason is Reason.OVERLOADED
    assert fleet.holders == 2
    await a.release()
    async with fleet.acquire() as c:
        assert c.token == 3  # the refused acquire took no token
    await b.release()
    assert fleet.holders == 0
    sheds = [e for e in sink.events if isinstance(e, RequestShed)]
    assert [e.reason for e in sheds] == [Reason.OVERLOADED]
    assert sum(isinstance(e, RequestAdmitted) for e in sink.events) == 3


async def test_an_expired_lease_gives_its_slot_back_and_is_fenced() -> None:
    fleet, clock, _ = build(limit=1)
    crashed = await fleet.acquire().__aenter__()  # never released: its holder "crashed"
    with pytest.raises(Rejected):
        async with fleet.acquire():
            pass
    clock.advance(5.0)
    with pytest.raises(LeaseExpired, match="expired"):
        crashed.check()
    assert not crashed.valid and crashed.remaining == 0.0
    async with fleet.acquire() as next_holder:
        next_holder.check()
        assert crashed.token is not None and next_holder.token is not None
        assert next_holder.token > crashed.token


async def test_check_is_conservative_and_renew_extends_only_unexpired_leases() -> None:
    fleet, clock, _ = build(limit=1)
    async with fleet.acquire() as lease:
        assert lease.expires_at == START + 5.0
        clock.advance(4.0)
        await lease.renew()
        assert lease.expires_at == START + 9.0
        clock.advance(4.9)
        lease.check()
        clock.advance(0.1)
        with pytest.raises(LeaseExpired):
            lease.check()
        with pytest.raises(LeaseExpired):
            await lease.renew()


async def test_renewal_refused_by_the_store_when_the_lease_is_gone() -> None:
    fleet, _, _ = build(limit=1)
    async with fleet.acquire() as lease:
        # The store purged it (its own clock ran ahead): the renewal says so.
        store = fleet.store
        assert isinstance(store, InMemoryLeaseStore)
        assert lease.token is not None
        await store.release("db", lease.token)
        with pytest.raises(LeaseExpired, match="not renewed"):
            await lease.renew()
        with pytest.raises(LeaseExpired):
            lease.check()


async def test_reserved_slots_are_kept_for_higher_priorities() -> None:
    fleet, _, sink = build(limit=3, reserved=1, reserve_from=Priority.CRITICAL)
    assert fleet.ceiling(Priority.SHEDDABLE) == 2 and fleet.ceiling(Priority.CRITICAL_PLUS) == 3
    held = []
    with brownout.request(priority=Priority.SHEDDABLE):
        held.append(await fleet.acquire().__aenter__())
        held.append(await fleet.acquire().__aenter__())
        with pytest.raises(Rejected):
            await fleet.acquire().__aenter__()
    with brownout.request(priority=Priority.CRITICAL):
        held.append(await fleet.acquire().__aenter__())
        with pytest.raises(Rejected):
            await fleet.acquire().__aenter__()
    shed = [e for e in sink.events if isinstance(e, RequestShed)]
    assert [e.priority for e in shed] == [Priority.SHEDDABLE, Priority.CRITICAL]
    for lease in held:
        await lease.release()


async def test_no_time_left_is_refused_before_asking() -> None:
    fleet, _, sink = build(limit=1)
    with brownout.request(deadline=brownout.Deadline.after(-1.0)):
        with pytest.raises(Rejected) as refused:
            await fleet.acquire().__aenter__()
    assert refused.value.reason is Reason.DEADLINE_EXPIRED
    assert fleet.holders == 0
    assert isinstance(sink.events[-1], RequestShed)


async def test_settles_like_a_bulkhead_permit() -> None:
    fleet, clock, sink = build(limit=1)
    with pytest.raises(ZeroDivisionError):
        async with fleet.admit():
            clock.advance(0.25)
            _ = 1 / 0
    failed = [e for e in sink.events if isinstance(e, RequestFailed)]
    assert [(e.error, e.latency) for e in failed] == [("ZeroDivisionError", 0.25)]
    async with fleet.admit() as lease:
        lease.success()
    assert any(isinstance(e, RequestCompleted) and e.useful for e in sink.events)
    assert fleet.holders == 0


def test_it_is_an_admission_whose_try_admit_refuses() -> None:
    fleet, _, _ = build()
    assert isinstance(fleet, AdmitsWork)
    with pytest.raises(Rejected) as refused:
        fleet.try_admit()
    assert refused.value.reason is Reason.OVERLOADED
    names = {(n, v) for n, _, v in fleet.gauges()}
    assert ("limit", 2.0) in names and ("in_flight", 0.0) in names


async def test_a_dependency_takes_it_as_its_bulkhead() -> None:
    fleet, _, _ = build(limit=1)
    dep = brownout.Dependency("db", bulkhead=fleet)

    async def query() -> str:
        assert fleet.holders == 1
        return "row"

    assert await dep.call(query) == "row"
    assert fleet.holders == 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 2, "reserved": 2}, "reserved"),
        ({"limit": 2, "lease": 0}, "lease"),
        ({"limit": 2, "lease": math.nan}, "lease"),
        ({"limit": 2, "on_store_failure": "maybe"}, "on_store_failure"),
        ({"limit": 2, "expected_instances": 0}, "expected_instances"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, object], match: str) -> None:
    store = InMemoryLeaseStore()
    with pytest.raises(ValueError, match=match):
        FleetLimit("db", store=store, **kw)  # type: ignore[arg-type]


def test_needs_exactly_one_store() -> None:
    with pytest.raises(TypeError, match="exactly one"):
        FleetLimit("db", 2)


def build_threaded(limit: int = 2, **kw: object) -> tuple[ThreadFleetLimit, ManualClock, ListSink]:
    clock = ManualClock(START)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    fleet = ThreadFleetLimit(
        "db",
        limit,
        store=BlockingInMemoryLeaseStore(clock=clock),
        lease=5.0,
        clock=clock,
        events=events,
        **kw,  # type: ignore[arg-type]
    )
    return fleet, clock, sink


def summary(sink: ListSink) -> list[tuple[str, object]]:
    return [(type(e).__name__, getattr(e, "reason", None)) for e in sink.events]


async def test_the_thread_limit_decides_as_the_asyncio_limit_does() -> None:
    """The same script of acquires, expiry, renewals and priorities: the same answers."""
    async_fleet, async_clock, async_sink = build(limit=2, reserved=1)
    thread_fleet, thread_clock, thread_sink = build_threaded(limit=2, reserved=1)
    answers: dict[str, list[object]] = {"async": [], "thread": []}

    async def run_async() -> None:
        out = answers["async"]
        with brownout.request(priority=Priority.SHEDDABLE):
            a = await async_fleet.acquire().__aenter__()
            try:
                await async_fleet.acquire().__aenter__()
            except Rejected as e:
                out.append(e.reason)
        with brownout.request(priority=Priority.CRITICAL):
            b = await async_fleet.acquire().__aenter__()
        async_clock.advance(4.0)
        await b.renew()
        async_clock.advance(2.0)
        out.append((a.valid, b.valid, a.token, b.token))
        async with async_fleet.acquire() as c:
            out.append(c.token)
        await b.release()

    def run_thread() -> None:
        out = answers["thread"]
        with brownout.request(priority=Priority.SHEDDABLE):
            a = thread_fleet.acquire().__enter__()
            try:
                thread_fleet.acquire().__enter__()
            except Rejected as e:
                out.append(e.reason)
        with brownout.request(priority=Priority.CRITICAL):
            b = thread_fleet.acquire().__enter__()
        thread_clock.advance(4.0)
        b.renew()
        thread_clock.advance(2.0)
        out.append((a.valid, b.valid, a.token, b.token))
        with thread_fleet.acquire() as c:
            out.append(c.token)
        b.release()

    await run_async()
    run_thread()
    assert answers["async"] == answers["thread"] == [Reason.OVERLOADED, (False, True, 1, 2), 3]
    assert summary(async_sink) == summary(thread_sink)
    assert async_fleet.holders == thread_fleet.holders == 1  # the expired lease is still held here
    assert list(async_fleet.gauges()) == list(thread_fleet.gauges())


def test_each_limit_refuses_the_other_kind_of_store() -> None:
    with pytest.raises(TypeError, match="ThreadFleetLimit"):
        FleetLimit("db", 2, store=BlockingInMemoryLeaseStore())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FleetLimit"):
        ThreadFleetLimit("db", 2, store=InMemoryLeaseStore())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"blocking redis\.Redis"):
        ThreadFleetLimit("db", 2)


def test_a_lease_may_not_act_once_released() -> None:
    fleet, _, _ = build_threaded(limit=1)
    with fleet.acquire() as lease:
        lease.check(fenced=True)  # a stored lease has its token
    with pytest.raises(LeaseExpired, match="not held"):
        lease.check()
    with pytest.raises(RuntimeError, match="entered once"):
        lease.__enter__()
