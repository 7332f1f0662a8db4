"""The psycopg 3 async adapter against the real PostgreSQL (issue 29): a statement stops *on
the server* at the deadline (pg_stat_activity shows no backend still running it); the pool
admits in priority order, bounds the wait and refuses short deadlines before taking a
connection; a COMMIT whose answer is lost raises `UnknownOutcome` and the key table tells
applied from not applied.

Margins are generous (a shared, noisy 2-core host): statements would run 10 s; the bounds
checked are about a second."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tests import services

import brownout
from brownout import OutcomeState, Priority, Reason, Rejected, UnknownOutcome
from brownout.events import EventHub, RequestShed, StatementCancelled
from brownout.testing import EventRecorder

psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")

from brownout.integrations.psycopg import BrownoutPsycopgPool  # noqa: E402

pytestmark = pytest.mark.integration

SLEEP = 10.0  # what a statement would take uncancelled
BOUND = 1.5  # the caller hears back within this
GONE = 1.0  # and no backend runs the statement within this after


def dsn(pg: services.Service) -> str:
    return f"postgresql://postgres@{pg.host}:{pg.port}/test"


@pytest.fixture
async def pool(postgres_server: services.Service) -> AsyncIterator[Any]:
    pool = psycopg_pool.AsyncConnectionPool(
        dsn(postgres_server), min_size=2, max_size=2, open=False
    )
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


async def admin(query: str, *args: Any) -> Any:
    """One value from ``query`` on a connection of its own (autocommit)."""
    conn = await psycopg.AsyncConnection.connect(dsn(services.POSTGRES), autocommit=True)
    try:
        cur = await conn.execute(query, args or None)
        row = await cur.fetchone()
    finally:
        await conn.close()
    return None if row is None else row[0]


async def running(marker: str) -> int:
    """Backends running a query that carries ``marker``."""
    return int(
        await admin(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
            " AND pid <> pg_backend_pid() AND query LIKE %s",
            f"%{marker}%",
        )
    )


async def gone_within(marker: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while await running(marker):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


def sleeper() -> tuple[str, str]:
    marker = f"m{uuid.uuid4().hex}"
    return marker, f"SELECT pg_sleep({SLEEP}) /* {marker} */"


async def test_a_statement_past_its_deadline_is_cancelled_on_the_server(pool: Any) -> None:
    hub = EventHub()
    db = BrownoutPsycopgPool(pool, name="orders-db", events=hub)
    marker, query = sleeper()
    start = time.monotonic()
    with EventRecorder(hub) as seen, pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(0.3), db.connection() as conn:
            await conn.execute(query)
    assert time.monotonic() - start < BOUND
    assert await gone_within(marker, GONE), "the query still runs on the server"
    assert len(seen.of(StatementCancelled)) == 1
    async with db.connection() as conn:  # the pool still serves
        assert await conn.fetchone("SELECT 1") == (1,)


async def test_a_statement_past_its_timeout_is_cancelled_on_the_server(pool: Any) -> None:
    hub = EventHub()
    db = BrownoutPsycopgPool(pool, name="orders-db", timeout=0.3, events=hub)
    marker, query = sleeper()
    start = time.monotonic()
    with EventRecorder(hub) as seen, pytest.raises(brownout.DeadlineExceeded):
        async with db.connection() as conn:
            await conn.execute(query)
    assert time.monotonic() - start < BOUND
    assert await gone_within(marker, GONE), "the query still runs on the server"
    assert [e.stage for e in seen.of(StatementCancelled)] == ["timeout"]


async def test_a_cancelled_task_cancels_its_statement_on_the_server(pool: Any) -> None:
    """What the edge does at the deadline (or when the client goes away): cancel the task."""
    db = BrownoutPsycopgPool(pool, name="orders-db")
    marker, query = sleeper()

    async def report() -> None:
        async with db.connection() as conn:
            await conn.execute(query)

    task = asyncio.create_task(report())
    end = time.monotonic() + 5.0
    while not await running(marker):
        assert time.monotonic() < end, "the statement never started"
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gone_within(marker, GONE), "the query still runs on the server"
    assert db.policy.bulkhead.in_flight == 0


async def test_waiters_get_connections_in_priority_order(pool: Any) -> None:
    db = BrownoutPsycopgPool(pool, name="orders-db", max_wait=5.0, max_queue=16)
    order: list[str] = []
    release = asyncio.Event()

    async def holder() -> None:
        async with db.connection() as conn:
            await release.wait()
            await conn.execute("SELECT 1")

    async def waiter(name: str, priority: Priority) -> None:
        async with brownout.request(deadline=10.0, priority=priority), db.connection() as conn:
            order.append(name)
            await conn.execute("SELECT pg_sleep(0.02)")

    holders = [asyncio.create_task(holder()) for _ in range(2)]
    while db.policy.bulkhead.in_flight < 2:
        await asyncio.sleep(0.01)
    plan = [("s", Priority.SHEDDABLE), ("d", Priority.SHEDDABLE_PLUS), ("c", Priority.CRITICAL)] * 3
    plan.append(("cp", Priority.CRITICAL_PLUS))
    waiters = []
    for name, priority in plan:
        waiters.append(asyncio.create_task(waiter(name, priority)))
        await asyncio.sleep(0.005)
    while db.policy.bulkhead.queue_depth < len(plan):
        await asyncio.sleep(0.01)
    gauges = {name: value for name, _, value in db.gauges()}
    assert gauges["queue_depth"] == len(plan) and gauges["in_flight"] == 2
    release.set()
    await asyncio.gather(*holders, *waiters)
    assert order == ["cp", "c", "c", "c", "d", "d", "d", "s", "s", "s"]


async def test_a_wait_past_the_queue_bound_is_refused(pool: Any) -> None:
    hub = EventHub()
    db = BrownoutPsycopgPool(pool, name="orders-db", max_wait=0.2, events=hub)

    async def one(query: str) -> Any:
        async with db.connection() as conn:
            return await conn.fetchone(query)

    busy = [asyncio.create_task(one("SELECT pg_sleep(1.0)")) for _ in range(2)]
    while db.policy.bulkhead.in_flight < 2:
        await asyncio.sleep(0.01)
    with EventRecorder(hub) as seen:
        start = time.monotonic()
        results = await asyncio.gather(*(one("SELECT 1") for _ in range(8)), return_exceptions=True)
        waited = time.monotonic() - start
    await asyncio.gather(*busy)
    assert all(isinstance(r, Rejected) and r.reason is Reason.QUEUE_TIMEOUT for r in results)
    assert waited < 0.2 + BOUND
    assert len([e for e in seen.of(RequestShed) if e.reason is Reason.QUEUE_TIMEOUT]) == 8
    signals = {type(s).__name__: s for s in db.signals()}
    assert set(signals) == {"InFlight", "QueueAge"}


async def test_a_deadline_too_short_is_refused_before_taking_a_connection(pool: Any) -> None:
    db = BrownoutPsycopgPool(pool, name="orders-db", min_useful=0.2)
    before = pool.get_stats().get("requests_num", 0)
    async with brownout.deadline(0.1):
        with pytest.raises(Rejected) as refused:
            async with db.connection():
                pass
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    assert pool.get_stats().get("requests_num", 0) == before
    assert db.policy.bulkhead.in_flight == 0


# -- unknown commits --------------------------------------------------------------------------


@pytest.fixture
async def orders(pool: Any) -> AsyncIterator[str]:
    """A table whose COMMIT takes 1.5 s: a deferred constraint trigger sleeps."""
    table = f"orders_{uuid.uuid4().hex[:12]}"
    async with pool.connection() as conn:
        await conn.execute(brownout.IdempotencyTable().ddl)
        await conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY)")
        await conn.execute(
            f"CREATE FUNCTION {table}_slow() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$"
        )
        await conn.execute(
            f"CREATE CONSTRAINT TRIGGER {table}_slow AFTER INSERT ON {table}"
            f" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}_slow()"
        )
    try:
        yield table
    finally:
        async with pool.connection() as conn:
            await conn.execute(f"DROP TABLE {table}")
            await conn.execute(f"DROP FUNCTION {table}_slow()")


async def committing(pid: int) -> None:
    """Wait until backend ``pid`` runs COMMIT."""
    end = time.monotonic() + 5.0
    while not await admin(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND query = 'COMMIT'"
        " AND state = 'active'",
        pid,
    ):
        assert time.monotonic() < end, "COMMIT never started"
        await asyncio.sleep(0.02)


async def in_table(table: str, key: str) -> bool:
    return bool(await admin(f"SELECT count(*) FROM {table} WHERE id = %s", key))


async def test_a_backend_killed_during_commit_is_unknown_then_not_applied(
    pool: Any, orders: str
) -> None:
    ledger = brownout.InMemoryOutcomeLedger()
    db = BrownoutPsycopgPool(pool, name="orders-db", ledger=ledger)
    key = f"k-{uuid.uuid4().hex}"
    pids: asyncio.Queue[int] = asyncio.Queue()

    async def order() -> None:
        async with db.transaction(idempotency_key=key) as conn:
            pids.put_nowait(conn.raw.info.backend_pid)
            await conn.execute(f"INSERT INTO {orders} VALUES (%s)", (key,))

    task = asyncio.create_task(order())
    pid = await pids.get()
    await committing(pid)
    await admin("SELECT pg_terminate_backend(%s)", pid)
    with pytest.raises(UnknownOutcome) as unknown:
        await task
    assert unknown.value.idempotency_key == key and unknown.value.recorded is True
    assert await db.reconcile(key) is OutcomeState.NOT_APPLIED
    assert not await in_table(orders, key)
    resolved = await brownout.Reconciler(ledger, db.check).run_once()
    assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.NOT_APPLIED)]


async def test_a_commit_past_its_budget_is_unknown_and_reconciles_to_the_truth(
    pool: Any, orders: str
) -> None:
    """The budget (the deadline less the reserve) ends during COMMIT: the caller hears
    `UnknownOutcome` before the deadline."""
    db = BrownoutPsycopgPool(pool, name="orders-db", reserve=0.1)
    key = f"k-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(UnknownOutcome) as unknown:
        async with brownout.deadline(0.5), db.transaction(idempotency_key=key) as conn:
            await conn.execute(f"INSERT INTO {orders} VALUES (%s)", (key,))
    assert time.monotonic() - start < 0.5 + BOUND
    assert unknown.value.idempotency_key == key
    state = await db.reconcile(key)
    assert state is not OutcomeState.PENDING
    assert (state is OutcomeState.APPLIED) == await in_table(orders, key)


async def test_a_deadline_during_commit_is_recorded_as_unknown(pool: Any, orders: str) -> None:
    """No reserve: the request's deadline cancels the task during COMMIT. The caller hears
    the deadline; the ledger holds the key, and the reconciler settles it."""
    ledger = brownout.InMemoryOutcomeLedger()
    db = BrownoutPsycopgPool(pool, name="orders-db", ledger=ledger)
    key = f"k-{uuid.uuid4().hex}"
    with pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(0.5), db.transaction(idempotency_key=key) as conn:
            await conn.execute(f"INSERT INTO {orders} VALUES (%s)", (key,))
    resolved = await brownout.Reconciler(ledger, db.check).run_once()
    assert [r.key for r in resolved] == [key]
    assert (resolved[0].state is OutcomeState.APPLIED) == await in_table(orders, key)


async def test_a_second_transaction_with_a_committed_key_fails(pool: Any, orders: str) -> None:
    db = BrownoutPsycopgPool(pool, name="orders-db")
    key = f"k-{uuid.uuid4().hex}"
    async with db.transaction(idempotency_key=key) as conn:
        await conn.execute(f"INSERT INTO {orders} VALUES (%s)", (key,))
    with pytest.raises(brownout.AlreadyApplied):
        async with db.transaction(idempotency_key=key) as conn:
            await conn.execute(f"INSERT INTO {orders} VALUES (%s)", (key + "-again",))
    assert await db.reconcile(key) is OutcomeState.APPLIED
    assert await db.reconcile(f"k-{uuid.uuid4().hex}") is OutcomeState.NOT_APPLIED
    assert not await in_table(orders, key + "-again")
