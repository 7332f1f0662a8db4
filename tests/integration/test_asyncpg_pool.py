"""The asyncpg adapter against the real PostgreSQL (issue 29): a statement stops *on the
server* at the deadline (pg_stat_activity shows no backend still running it), through a
real uvicorn + Starlette edge too; the pool admits in priority order, bounds the wait and
refuses short deadlines before taking a connection; a COMMIT whose answer is lost raises
`UnknownOutcome` and the key table tells applied from not applied.

Margins are generous (a shared, noisy 2-core host): statements would run 10 s; the bounds
checked are about a second."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route as StarletteRoute
from tests import services
from tests.integration.servers import serve

import brownout
from brownout import (
    EdgePolicy,
    OutcomeState,
    Priority,
    Reason,
    Rejected,
    Route,
    Stats,
    UnknownOutcome,
)
from brownout.events import EventHub, RequestShed, StatementCancelled
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.asyncpg import BrownoutPool
from brownout.testing import EventRecorder

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.integration

SLEEP = 10.0  # what a statement would take uncancelled
BOUND = 1.5  # the caller hears back within this
GONE = 1.0  # and no backend runs the statement within this after


def dsn(pg: services.Service) -> str:
    return f"postgresql://postgres@{pg.host}:{pg.port}/test"


@pytest.fixture
async def pool(postgres_server: services.Service) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn(postgres_server), min_size=2, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


async def running(pool: asyncpg.Pool, marker: str) -> int:
    """Backends running a query that carries ``marker`` (from a connection of its own)."""
    conn = await asyncpg.connect(dsn(services.POSTGRES))
    try:
        n = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
            " AND pid <> pg_backend_pid() AND query LIKE $1",
            f"%{marker}%",
        )
    finally:
        await conn.close()
    return int(n)


async def gone_within(pool: asyncpg.Pool, marker: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while await running(pool, marker):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


def sleeper() -> tuple[str, str]:
    marker = f"m{uuid.uuid4().hex}"
    return marker, f"SELECT pg_sleep({SLEEP}) /* {marker} */"


async def test_a_statement_past_its_deadline_is_cancelled_on_the_server(
    pool: asyncpg.Pool,
) -> None:
    hub = EventHub()
    db = BrownoutPool(pool, name="orders-db", reserve=0.05, events=hub)
    marker, query = sleeper()
    start = time.monotonic()
    with EventRecorder(hub) as seen, pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(0.3):
            await db.fetchval(query)
    assert time.monotonic() - start < BOUND
    assert await gone_within(pool, marker, GONE), "the query still runs on the server"
    assert [e.stage for e in seen.of(StatementCancelled)] == ["timeout"]
    assert await db.fetchval("SELECT 1") == 1  # the connection came back usable


@pytest.mark.parametrize("listening", [False, True])
async def test_the_uncontended_shortcut_keeps_to_the_budget(
    pool: asyncpg.Pool, listening: bool
) -> None:
    """An idle connection and room: the pool's own shortcut under the budget (`admit_now`),
    with nobody listening (an untracked admission) or a tallying sink (a timed one)."""
    hub = EventHub()
    stats = Stats()
    if listening:
        hub.subscribe(stats)
    db = BrownoutPool(pool, name="orders-db", reserve=0.05, events=hub)
    marker, query = sleeper()
    start = time.monotonic()
    with pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(0.3):
            probe = db.policy.admit_now()  # what the shortcut will find: room, at once
            assert pool.get_idle_size() and probe is not None
            probe[0].success()
            await db.fetchval(query)
    assert time.monotonic() - start < BOUND
    assert await gone_within(pool, marker, GONE), "the query still runs on the server"
    assert db.policy.bulkhead.in_flight == 0
    assert stats.count("statement_cancelled") == (1 if listening else 0)
    async with brownout.deadline(5.0):
        assert await db.fetchrow("SELECT 1 AS one") == (1,)
        assert await db.fetch("SELECT 2") == [(2,)]
        assert await db.execute("SELECT 3") == "SELECT 1"
    assert db.policy.bulkhead.in_flight == 0


async def test_a_cancelled_task_cancels_its_statement_on_the_server(pool: asyncpg.Pool) -> None:
    """What the edge does at the deadline (or when the client goes away): cancel the task."""
    db = BrownoutPool(pool, name="orders-db")
    marker, query = sleeper()
    task = asyncio.create_task(db.fetchval(query))
    end = time.monotonic() + 5.0
    while not await running(pool, marker):
        assert time.monotonic() < end, "the statement never started"
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gone_within(pool, marker, GONE), "the query still runs on the server"
    assert db.policy.bulkhead.in_flight == 0


async def test_through_the_edge_the_caller_gets_504_and_the_query_stops(
    pool: asyncpg.Pool,
) -> None:
    db = BrownoutPool(pool, name="orders-db", reserve=0.02)
    marker, query = sleeper()

    async def report(request: Request) -> PlainTextResponse:
        async with db.acquire() as conn:
            # The raw connection: no statement budget, so only the edge's cancellation of
            # the handler at the deadline stops it (asyncpg sends the cancel request).
            return PlainTextResponse(str(await conn.raw.fetchval(query)))

    app = Starlette(routes=[StarletteRoute("/report", report)])
    policy = EdgePolicy(routes={"/report": Route(default=0.3)})
    async with serve(BrownoutMiddleware(app, policy=policy)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            start = time.monotonic()
            answer = await client.get("/report")
            took = time.monotonic() - start
    assert answer.status_code == 504
    assert took < BOUND
    assert await gone_within(pool, marker, GONE), "the query still runs on the server"


async def test_waiters_get_connections_in_priority_order(pool: asyncpg.Pool) -> None:
    db = BrownoutPool(pool, name="orders-db", max_wait=5.0, max_queue=16)
    order: list[str] = []
    release = asyncio.Event()

    async def holder() -> None:
        async with db.acquire() as conn:
            await release.wait()
            await conn.execute("SELECT 1")

    async def waiter(name: str, priority: Priority) -> None:
        async with brownout.request(deadline=10.0, priority=priority), db.acquire() as conn:
            order.append(name)
            await conn.execute("SELECT pg_sleep(0.02)")

    holders = [asyncio.create_task(holder()) for _ in range(2)]
    waiters: list[asyncio.Task[None]] = []
    try:
        while db.policy.bulkhead.in_flight < 2:
            await asyncio.sleep(0.01)
        plan = [("s", Priority.SHEDDABLE), ("d", Priority.SHEDDABLE_PLUS), ("c", Priority.CRITICAL)]
        plan = plan * 3 + [("cp", Priority.CRITICAL_PLUS)]
        for name, priority in plan:
            waiters.append(asyncio.create_task(waiter(name, priority)))
            await asyncio.sleep(0.005)
        while db.policy.bulkhead.queue_depth < len(plan):
            assert all(not w.done() for w in waiters), [w.exception() for w in waiters if w.done()]
            await asyncio.sleep(0.01)
        gauges = {name: value for name, _, value in db.gauges()}
        assert gauges["queue_depth"] == len(plan) and gauges["in_flight"] == 2
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(*holders, *waiters, return_exceptions=True), 10)
    assert order == ["cp", "c", "c", "c", "d", "d", "d", "s", "s", "s"]


async def test_a_wait_past_the_queue_bound_is_refused(pool: asyncpg.Pool) -> None:
    hub = EventHub()
    db = BrownoutPool(pool, name="orders-db", max_wait=0.2, events=hub)
    busy = [asyncio.create_task(db.execute("SELECT pg_sleep(1.0)")) for _ in range(2)]
    while db.policy.bulkhead.in_flight < 2:
        await asyncio.sleep(0.01)
    with EventRecorder(hub) as seen:
        start = time.monotonic()
        results = await asyncio.gather(
            *(db.fetchval("SELECT 1") for _ in range(8)), return_exceptions=True
        )
        waited = time.monotonic() - start
    await asyncio.gather(*busy)
    assert all(isinstance(r, Rejected) and r.reason is Reason.QUEUE_TIMEOUT for r in results)
    assert waited < 0.2 + BOUND
    assert len([e for e in seen.of(RequestShed) if e.reason is Reason.QUEUE_TIMEOUT]) == 8


async def test_a_deadline_too_short_is_refused_before_taking_a_connection(
    pool: asyncpg.Pool,
) -> None:
    db = BrownoutPool(pool, name="orders-db", min_useful=0.2)
    idle = pool.get_idle_size()
    async with brownout.deadline(0.1):
        with pytest.raises(Rejected) as refused:
            await db.fetchval("SELECT 1")
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    assert pool.get_idle_size() == idle and db.policy.bulkhead.in_flight == 0


# -- unknown commits --------------------------------------------------------------------------


@pytest.fixture
async def orders(pool: asyncpg.Pool) -> AsyncIterator[str]:
    """A table whose COMMIT takes a second: a deferred constraint trigger sleeps."""
    table = f"orders_{uuid.uuid4().hex[:12]}"
    async with pool.acquire() as conn:
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
        async with pool.acquire() as conn:
            await conn.execute(f"DROP TABLE {table}")
            await conn.execute(f"DROP FUNCTION {table}_slow()")


async def committing(pid: int) -> None:
    """Wait until backend ``pid`` runs COMMIT."""
    end = time.monotonic() + 5.0
    conn = await asyncpg.connect(dsn(services.POSTGRES))
    try:
        while not await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND query = 'COMMIT'"
            " AND state = 'active'",
            pid,
        ):
            assert time.monotonic() < end, "COMMIT never started"
            await asyncio.sleep(0.02)
    finally:
        await conn.close()


async def in_table(pool: asyncpg.Pool, table: str, key: str) -> bool:
    async with pool.acquire() as conn:
        return bool(await conn.fetchval(f"SELECT count(*) FROM {table} WHERE id = $1", key))


async def test_a_backend_killed_during_commit_is_unknown_then_not_applied(
    pool: asyncpg.Pool, orders: str
) -> None:
    ledger = brownout.InMemoryOutcomeLedger()
    db = BrownoutPool(pool, name="orders-db", ledger=ledger)
    key = f"k-{uuid.uuid4().hex}"

    pids: asyncio.Queue[int] = asyncio.Queue()

    async def order() -> None:
        async with db.transaction(idempotency_key=key) as conn:
            pids.put_nowait(conn.raw.get_server_pid())
            await conn.execute(f"INSERT INTO {orders} VALUES ($1)", key)

    task = asyncio.create_task(order())
    pid = await pids.get()
    await committing(pid)
    killer = await asyncpg.connect(dsn(services.POSTGRES))
    try:
        await killer.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await killer.close()
    with pytest.raises(UnknownOutcome) as unknown:
        await task
    assert unknown.value.idempotency_key == key and unknown.value.recorded is True
    assert await db.reconcile(key) is OutcomeState.NOT_APPLIED
    assert not await in_table(pool, orders, key)
    resolved = await brownout.Reconciler(ledger, db.check).run_once()
    assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.NOT_APPLIED)]


async def test_a_connection_dropped_during_commit_is_unknown_then_applied(
    pool: asyncpg.Pool, orders: str
) -> None:
    """The client loses the connection; the server finishes the COMMIT anyway. The probe
    waits for it, then finds the key committed."""
    db = BrownoutPool(pool, name="orders-db")
    key = f"k-{uuid.uuid4().hex}"
    conns: asyncio.Queue[asyncpg.Connection] = asyncio.Queue()

    async def order() -> None:
        async with db.transaction(idempotency_key=key) as conn:
            conns.put_nowait(conn.raw)
            await conn.execute(f"INSERT INTO {orders} VALUES ($1)", key)

    task = asyncio.create_task(order())
    raw = await conns.get()
    await committing(raw.get_server_pid())
    raw.terminate()  # the network drops: the answer to COMMIT never arrives
    with pytest.raises(UnknownOutcome) as unknown:
        await task
    assert unknown.value.idempotency_key == key
    assert await db.reconcile(key) is OutcomeState.APPLIED
    assert await in_table(pool, orders, key)


async def test_a_deadline_during_commit_is_unknown_and_reconciles_to_the_truth(
    pool: asyncpg.Pool, orders: str
) -> None:
    # The reserve lets the COMMIT's own timeout fire well before the request's deadline.
    db = BrownoutPool(pool, name="orders-db", reserve=0.05)
    key = f"k-{uuid.uuid4().hex}"
    with pytest.raises(UnknownOutcome) as unknown:
        async with brownout.deadline(0.5):
            async with db.transaction(idempotency_key=key) as conn:
                await conn.execute(f"INSERT INTO {orders} VALUES ($1)", key)
    assert unknown.value.idempotency_key == key
    state = await db.reconcile(key)
    assert state is not OutcomeState.PENDING
    assert (state is OutcomeState.APPLIED) == await in_table(pool, orders, key)


async def test_a_second_transaction_with_a_committed_key_fails(
    pool: asyncpg.Pool, orders: str
) -> None:
    db = BrownoutPool(pool, name="orders-db")
    key = f"k-{uuid.uuid4().hex}"
    async with db.transaction(idempotency_key=key) as conn:
        await conn.execute(f"INSERT INTO {orders} VALUES ($1)", key)
    with pytest.raises(brownout.AlreadyApplied):
        async with db.transaction(idempotency_key=key) as conn:
            await conn.execute(f"INSERT INTO {orders} VALUES ($1)", key + "-again")
    assert await db.reconcile(key) is OutcomeState.APPLIED
    assert await db.reconcile(f"k-{uuid.uuid4().hex}") is OutcomeState.NOT_APPLIED
    assert not await in_table(pool, orders, key + "-again")


def test_the_example_of_the_databases_page_runs(postgres_server: services.Service) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "databases.md").read_text()
    blocks = re.findall(r"^(<!-- no-run -->\n)?```python\n(.*?)^```", text, re.S | re.M)
    [example] = [code for no_run, code in blocks if not no_run]
    example = example.replace(
        'dsn = "postgresql://postgres@127.0.0.1:5432/test"', f"dsn = {dsn(postgres_server)!r}"
    )
    assert dsn(postgres_server) in example
    scope: dict[str, Any] = {}
    start = time.monotonic()
    exec(compile(example, "docs/databases.md", "exec"), scope)
    assert time.monotonic() - start < 5.0
    assert scope["seen"] == {
        "one": 1,
        "slow": "stopped at the deadline",
        "again": "already applied",
        "reconciled": OutcomeState.APPLIED,
    }
