"""`DatabasePolicy` on virtual time: statement budgets from the deadline (D4), refusals before
anything is sent, statements stopped at their budget (D5), and the commit rule (D6)."""

from __future__ import annotations

import asyncio

import pytest

from brownout import (
    DatabasePolicy,
    DeadlineExceeded,
    IdempotencyTable,
    InMemoryOutcomeLedger,
    Priority,
    Reason,
    Rejected,
    Stats,
    UnknownOutcome,
)
from brownout._context import current_deadline
from brownout._retry.outbound import attempt_budget
from brownout.events import EventHub, OutcomeUnknown, RequestShed, StatementCancelled
from brownout.testing import EventRecorder, VirtualTime


def policy(vt: VirtualTime, hub: EventHub, **kw: object) -> DatabasePolicy:
    return DatabasePolicy("orders-db", max_size=2, clock=vt.clock, events=hub, **kw)  # type: ignore[arg-type]


def test_the_statement_budget_is_the_deadline_less_the_reserve_capped_at_the_timeout() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), reserve=0.05, timeout=2.0)
    assert db.statement_budget() == 2.0  # no deadline: the normal timeout
    with vt.deadline(0.3):
        assert db.statement_budget() == pytest.approx(0.25)
        vt.advance(0.1)
        assert db.statement_budget() == pytest.approx(0.15)
    with vt.deadline(10.0):
        assert db.statement_budget() == 2.0


def test_no_timeout_and_no_deadline_is_no_bound() -> None:
    vt = VirtualTime()
    assert policy(vt, EventHub()).statement_budget() is None


def test_too_little_time_refuses_before_sending_and_says_so() -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub, min_useful=0.2)
    with EventRecorder(hub) as seen, vt.deadline(0.1):
        with pytest.raises(Rejected) as refused:
            db.statement_budget()
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    [shed] = seen.of(RequestShed)
    assert shed.source == "orders-db" and shed.reason is Reason.DEADLINE_TOO_SHORT


async def test_admission_refuses_a_short_deadline_before_taking_a_place() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), min_useful=0.2)
    with vt.deadline(0.1), pytest.raises(Rejected) as refused:
        async with db.admit():
            pytest.fail("admitted with too little time")
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    assert db.bulkhead.in_flight == 0


async def test_a_statement_gets_its_budget_and_a_timeout_becomes_deadline_exceeded() -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub, reserve=0.02)
    given: list[float | None] = []

    async def driver(budget: float | None) -> str:
        given.append(budget)
        vt.advance(0.28)
        raise TimeoutError  # the driver's timeout (its cancel request sent)

    with EventRecorder(hub) as seen, vt.deadline(0.3, priority=Priority.SHEDDABLE):
        with pytest.raises(DeadlineExceeded) as stopped:
            await db.statement(driver)
    assert given == [pytest.approx(0.28)]
    assert isinstance(stopped.value.__cause__, TimeoutError)
    [cancelled] = seen.of(StatementCancelled)
    assert (cancelled.stage, cancelled.source, cancelled.priority) == (
        "timeout",
        "orders-db",
        Priority.SHEDDABLE,
    )
    assert cancelled.latency == pytest.approx(0.28)


async def test_a_cancelled_statement_is_reported_by_why() -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub)

    async def cancelled(budget: float | None) -> None:
        vt.advance(0.5)  # past the deadline: the edge cancelled it
        raise asyncio.CancelledError

    async def gone(budget: float | None) -> None:
        raise asyncio.CancelledError  # the client went away, time left

    with EventRecorder(hub) as seen:
        with vt.deadline(0.3), pytest.raises(asyncio.CancelledError):
            await db.statement(cancelled)
        with vt.deadline(5.0), pytest.raises(asyncio.CancelledError):
            await db.statement(gone)
    assert [e.stage for e in seen.of(StatementCancelled)] == ["deadline", "cancelled"]


async def test_a_lost_commit_is_an_unknown_outcome_recorded_in_the_ledger() -> None:
    vt = VirtualTime()
    hub = EventHub()
    ledger = InMemoryOutcomeLedger(clock=vt.clock)
    db = policy(vt, hub, ledger=ledger)

    async def dropped(budget: float | None) -> None:
        raise ConnectionResetError("connection lost mid-COMMIT")

    with EventRecorder(hub) as seen, vt.deadline(1.0):
        with pytest.raises(UnknownOutcome) as unknown:
            await db.commit(dropped, "order-7", lost=lambda e: isinstance(e, ConnectionError))
    assert unknown.value.idempotency_key == "order-7"
    assert unknown.value.recorded is True
    record = await ledger.get("order-7")
    assert record is not None and record.dependency == "orders-db"
    assert [e.idempotency_key for e in seen.of(OutcomeUnknown)] == ["order-7"]


async def test_a_commit_timeout_is_unknown_and_a_server_answer_is_not() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub())

    async def timed_out(budget: float | None) -> None:
        raise TimeoutError

    class SerializationFailure(Exception):
        pass

    async def refused(budget: float | None) -> None:
        raise SerializationFailure  # the server answered: not committed

    with vt.deadline(1.0):
        with pytest.raises(UnknownOutcome):
            await db.commit(timed_out, "k-1", lost=lambda e: False)
        with pytest.raises(SerializationFailure):
            await db.commit(refused, "k-2", lost=lambda e: False)


async def test_a_commit_cancelled_on_the_wire_is_recorded_then_reraised() -> None:
    vt = VirtualTime()
    ledger = InMemoryOutcomeLedger(clock=vt.clock)
    db = policy(vt, EventHub(), ledger=ledger)

    async def cancelled(budget: float | None) -> None:
        raise asyncio.CancelledError

    with vt.deadline(1.0), pytest.raises(asyncio.CancelledError):
        await db.commit(cancelled, "k-9", lost=lambda e: False)
    assert await ledger.get("k-9") is not None


async def test_a_commit_after_the_deadline_is_refused_unsent() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), min_useful=0.5)
    sent: list[float | None] = []

    async def driver(budget: float | None) -> None:
        sent.append(budget)

    with vt.deadline(0.1):
        await db.commit(driver, "k", lost=lambda e: False)  # min_useful does not apply
        vt.advance(0.2)
        with pytest.raises(Rejected) as refused:
            await db.commit(driver, "k", lost=lambda e: False)
    assert refused.value.reason is Reason.DEADLINE_EXPIRED
    assert len(sent) == 1


async def test_pool_gauges_and_signals_read_the_admission() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), max_wait=0.4)
    saturation, wait = db.signals()
    async with db.admit():
        assert saturation.read() == 0.5
        assert wait.read() == 0.0
        gauges = {name: value for name, _, value in db.gauges()}
    assert gauges["in_flight"] == 1.0 and gauges["limit"] == 2.0
    assert saturation.read() == 0.0


def test_stats_count_cancelled_statements_by_stage() -> None:
    stats = Stats()
    hub = EventHub()
    hub.subscribe(stats)
    hub.emit(StatementCancelled(0.0, "orders-db", "q", Priority.CRITICAL, "c", "timeout", 0.2, 0.2))
    assert stats.count("statement_cancelled") == 1


def test_the_key_table_accepts_only_identifiers() -> None:
    assert "CREATE TABLE IF NOT EXISTS app.keys" in IdempotencyTable("app.keys").ddl
    assert IdempotencyTable.param_style(IdempotencyTable().claim).endswith("VALUES (%s)")
    for bad in ("keys; DROP TABLE x", "", "1keys", "a.b.c"):
        with pytest.raises(ValueError):
            IdempotencyTable(bad)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_size": 0},
        {"max_size": 2, "max_wait": float("nan")},
        {"max_size": 2, "reserve": -1.0},
        {"max_size": 2, "timeout": 0.1, "min_useful": 0.2},
    ],
)
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DatabasePolicy("db", **kw)  # type: ignore[arg-type]


async def test_admit_now_admits_an_uncontended_request_with_its_budget() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), reserve=0.05, timeout=2.0)
    with vt.deadline(0.3):
        admitted = db.admit_now()
        assert admitted is not None
        permit, budget = admitted
        assert budget == pytest.approx(0.25) == db.statement_budget()
        assert db.bulkhead.in_flight == 1
        permit.success()
    assert db.bulkhead.in_flight == 0
    admitted = db.admit_now()  # no deadline: the normal timeout
    assert admitted is not None and admitted[1] == 2.0
    admitted[0].settle_raised(TimeoutError)
    assert db.bulkhead.in_flight == 0


async def test_admit_now_leaves_a_full_pool_to_admit_and_counts_nothing() -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub)
    held = [db.admit_now(), db.admit_now()]
    assert all(a is not None for a in held) and db.bulkhead.in_flight == 2
    with EventRecorder(hub) as seen, vt.deadline(1.0):
        assert db.admit_now() is None
    assert db.bulkhead.in_flight == 2 and not seen.events


@pytest.mark.parametrize(
    ("left", "reason"), [(0.1, Reason.DEADLINE_TOO_SHORT), (0.0, Reason.DEADLINE_EXPIRED)]
)
async def test_admit_now_refuses_too_little_time_before_taking_a_place(
    left: float, reason: Reason
) -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub, min_useful=0.2)
    with EventRecorder(hub) as seen, vt.deadline(1.0):
        vt.advance(1.0 - left)
        with pytest.raises(Rejected) as refused:
            db.admit_now()
    assert refused.value.reason is reason
    assert [shed.reason for shed in seen.of(RequestShed)] == [reason]
    assert db.bulkhead.in_flight == 0


@pytest.mark.parametrize("timeout", [None, 0.2, 1.0])
@pytest.mark.parametrize("reserve", [0.0, 0.0005, 0.05])
@pytest.mark.parametrize("min_useful", [0.0, 0.1])
@pytest.mark.parametrize("left", [0.0, 0.0009, 0.05, 0.1505, 0.3, 5.0])
def test_the_inline_budgets_are_attempt_budgets_answers(
    timeout: float | None, reserve: float, min_useful: float, left: float
) -> None:
    if timeout is not None and timeout < min_useful:
        return  # refused by the constructor
    vt = VirtualTime()
    db = policy(vt, EventHub(), timeout=timeout, reserve=reserve, min_useful=min_useful)
    with vt.deadline(left):
        for ours, floor in ((db.statement_budget, min_useful), (db.commit_budget, 0.0)):
            try:
                expected: float | Reason | None = attempt_budget(
                    timeout, reserve=reserve, min_useful=floor, deadline=current_deadline()
                )
            except Rejected as refused:
                expected = refused.reason
            try:
                got: float | Reason | None = ours()
            except Rejected as refused:
                got = refused.reason
            assert got == expected
