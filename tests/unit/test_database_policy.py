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
from brownout.events import (
    EventHub,
    LedgerWriteFailed,
    OutcomeUnknown,
    RequestOffered,
    RequestShed,
    StatementCancelled,
)
from brownout.idempotency import MAX_KEY_LENGTH, IdempotencyKeyInvalid
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
            db.check_time_left()
        with pytest.raises(Rejected) as stopped:
            db.statement_budget()  # a statement of an admitted request: its permit reports it
    assert refused.value.reason is stopped.value.reason is Reason.DEADLINE_TOO_SHORT
    [offered] = seen.of(RequestOffered)
    [shed] = seen.of(RequestShed)
    assert shed.source == offered.source == "orders-db"
    assert shed.reason is Reason.DEADLINE_TOO_SHORT


async def test_each_request_is_counted_once_however_it_ends() -> None:
    """offered = admitted + shed, and each admitted request ends once: refused before the
    bulkhead, refused by it, or admitted and then stopped at a statement or its COMMIT."""
    vt = VirtualTime()
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    db = policy(vt, hub, min_useful=0.05, max_queue=1)

    async def never(budget: float | None) -> None:
        pytest.fail("sent with no time left")

    with vt.deadline(0.01), pytest.raises(Rejected):  # refused before the bulkhead
        async with db.admit():
            pass

    async def waiter() -> None:
        with vt.deadline(1.0):
            async with db.admit():
                pass

    with vt.deadline(1.0):
        async with db.admit(), db.admit():  # the pool's two places
            queued = asyncio.create_task(waiter())
            await asyncio.sleep(0)
            with pytest.raises(Rejected):  # the queue holds one: refused by the bulkhead
                async with db.admit():
                    pass
    await queued
    for budgeted in (db.statement, lambda run: db.commit(run, "k", lost=lambda e: False)):
        with vt.deadline(1.0), pytest.raises(Rejected):
            async with db.admit():
                vt.advance(1.0)  # the deadline passes while the connection is held
                await budgeted(never)
    offered, admitted, shed = (stats.count(k) for k in ("offered", "admitted", "shed"))
    assert (offered, admitted, shed) == (7, 5, 2)
    ended = sum(stats.count(k) for k in ("completed", "completed_late", "failed", "expired"))
    assert ended == admitted
    assert db.bulkhead.in_flight == 0


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


def test_a_connect_timed_out_at_the_budget_is_the_deadlines_and_any_other_is_not() -> None:
    vt = VirtualTime()
    hub = EventHub()
    db = policy(vt, hub)
    timed_out = TimeoutError("connect")
    with EventRecorder(hub) as seen:
        exceeded = db.connect_timed_out(timed_out, 0.25)  # the bound the adapter set
        assert db.connect_timed_out(timed_out, None) is timed_out  # the caller's own bound
        assert db.connect_timed_out(exceeded, 0.25) is exceeded  # translated once
    assert isinstance(exceeded, DeadlineExceeded) and exceeded.__cause__ is timed_out
    assert "250 ms" in str(exceeded)
    assert timed_out.__cause__ is None  # left as it is
    assert seen.events == []  # the admission holding the place reports how it ended


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


async def test_a_failed_ledger_write_is_reported_once_and_the_caller_keeps_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vt = VirtualTime()
    hub = EventHub()

    class BrokenLedger(InMemoryOutcomeLedger):
        name = "broken"

        async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
            raise ConnectionError("ledger down")

    db = policy(vt, hub, ledger=BrokenLedger(clock=vt.clock))

    async def dropped(budget: float | None) -> None:
        raise ConnectionResetError("connection lost mid-COMMIT")

    with EventRecorder(hub) as seen, vt.deadline(1.0):
        with pytest.raises(UnknownOutcome) as unknown:
            await db.commit(dropped, "order-8", lost=lambda e: isinstance(e, ConnectionError))
        await asyncio.sleep(0)  # the write's callback
    assert unknown.value.recorded is False
    assert any("order-8" in note for note in unknown.value.__notes__)
    [failed] = seen.of(LedgerWriteFailed)
    assert (failed.source, failed.ledger, failed.key) == ("orders-db", "broken", "order-8")
    assert "unknown commit of idempotency key 'order-8'" in caplog.text


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
        {"max_size": 1, "max_queue": 0},
        {"max_size": 1, "max_queue": -3},
        {"max_size": 1, "max_queue": 2.5},
    ],
)
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError) as refused:
        DatabasePolicy("db", **kw)  # type: ignore[arg-type]
    named = kw.keys() - {"max_size"} or {"max_size"}
    assert any(name in str(refused.value) for name in named)  # the message names the setting


def test_a_reserve_larger_than_the_time_left_refuses_before_sending() -> None:
    vt = VirtualTime()
    db = policy(vt, EventHub(), reserve=0.5, timeout=0.1)
    assert db.statement_budget() == 0.1  # no deadline: the reserve has nothing to keep back
    with vt.deadline(0.3), pytest.raises(Rejected) as refused:
        db.check_time_left()
    assert refused.value.reason in (Reason.DEADLINE_TOO_SHORT, Reason.DEADLINE_EXPIRED)


def test_a_key_is_checked_before_it_reaches_the_table() -> None:
    longest = "k" * MAX_KEY_LENGTH
    assert IdempotencyTable.key(longest) == longest
    assert IdempotencyTable.key("order-7 é") == "order-7 é"
    for bad in ("", "a\x00b", longest + "k", None, b"bytes", 7):
        with pytest.raises(IdempotencyKeyInvalid) as refused:
            IdempotencyTable.key(bad)
        assert isinstance(refused.value, ValueError)
    with pytest.raises(IdempotencyKeyInvalid) as long_one:
        IdempotencyTable.key("x" * 10_000)
    assert len(str(long_one.value)) < 200  # the message quotes only the key's start


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
