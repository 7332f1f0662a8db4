"""The SQLAlchemy asyncio adapter against the real PostgreSQL (issue 29), on the asyncpg and
the psycopg drivers: a statement stops *on the server* at the deadline (pg_stat_activity
shows no backend still running it), from a connection and from a session; checkout admits
in priority order, bounds the wait and refuses short deadlines before taking a connection;
a COMMIT whose answer is lost raises `UnknownOutcome` and the key table tells applied from
not applied.

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
from brownout.events import (
    EventHub,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestShed,
    StatementCancelled,
)
from brownout.testing import EventRecorder

sqlalchemy = pytest.importorskip("sqlalchemy")
psycopg = pytest.importorskip("psycopg")
pytest.importorskip("asyncpg")

from sqlalchemy import text  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine  # noqa: E402

from brownout.integrations import sqlalchemy as bsa  # noqa: E402

pytestmark = pytest.mark.integration

SLEEP = 10.0  # what a statement would take uncancelled
BOUND = 1.5  # the caller hears back within this
GONE = 1.0  # and no backend runs the statement within this after

DRIVERS = ["asyncpg", "psycopg"]


def dsn(pg: services.Service, driver: str = "") -> str:
    scheme = "postgresql" if not driver else f"postgresql+{driver}"
    return f"{scheme}://postgres@{pg.host}:{pg.port}/test"


@pytest.fixture(params=DRIVERS)
async def engine(
    request: pytest.FixtureRequest, postgres_server: services.Service
) -> AsyncIterator[AsyncEngine]:
    made = create_async_engine(dsn(postgres_server, request.param), pool_size=2)
    try:
        yield made
    finally:
        await made.dispose()


def protect(engine: AsyncEngine, **kw: Any) -> AsyncEngine:
    return bsa.protect(engine, name="orders-db", **kw)


async def admin(query: str, *args: Any) -> Any:
    """One value from ``query`` on a connection of its own (autocommit)."""
    conn = await psycopg.AsyncConnection.connect(dsn(services.POSTGRES), autocommit=True)
    try:
        cur = await conn.execute(query, args or None)
        row = await cur.fetchone() if cur.description else None
    finally:
        await conn.close()
    return None if row is None else row[0]


async def running(marker: str) -> int:
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


def sleeper() -> tuple[str, Any]:
    marker = f"m{uuid.uuid4().hex}"
    return marker, text(f"SELECT pg_sleep({SLEEP}) /* {marker} */")


@pytest.mark.parametrize("via", ["connection", "session"])
async def test_a_statement_past_its_deadline_is_cancelled_on_the_server(
    engine: AsyncEngine, via: str
) -> None:
    hub = EventHub()
    protect(engine, events=hub)
    marker, query = sleeper()
    start = time.monotonic()
    with EventRecorder(hub) as seen, pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(0.3):
            if via == "connection":
                async with engine.connect() as conn:
                    await conn.execute(query)
            else:
                async with AsyncSession(engine) as session:
                    await session.execute(query)
    assert time.monotonic() - start < BOUND
    assert await gone_within(marker, GONE), "the query still runs on the server"
    assert len(seen.of(StatementCancelled)) == 1
    async with engine.connect() as conn:  # the engine still serves
        assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    assert bsa.policy(engine).bulkhead.in_flight == 0


async def test_a_cancelled_task_cancels_its_statement_on_the_server(engine: AsyncEngine) -> None:
    """What the edge does when the client goes away: cancel the task."""
    protect(engine)
    marker, query = sleeper()

    async def report() -> None:
        async with engine.connect() as conn:
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
    assert bsa.policy(engine).bulkhead.in_flight == 0


async def test_checkouts_wait_in_priority_order(engine: AsyncEngine) -> None:
    protect(engine, max_wait=5.0, max_queue=16)
    db = bsa.policy(engine)
    order: list[str] = []
    release = asyncio.Event()

    async def holder() -> None:
        async with engine.connect() as conn:
            await release.wait()
            await conn.execute(text("SELECT 1"))

    async def waiter(name: str, priority: Priority) -> None:
        async with brownout.request(deadline=10.0, priority=priority), engine.connect() as conn:
            order.append(name)
            await conn.execute(text("SELECT pg_sleep(0.02)"))

    holders = [asyncio.create_task(holder()) for _ in range(2)]
    while db.bulkhead.in_flight < 2:
        await asyncio.sleep(0.01)
    plan = [("s", Priority.SHEDDABLE), ("p", Priority.SHEDDABLE_PLUS), ("c", Priority.CRITICAL)]
    plan = plan * 3 + [("cp", Priority.CRITICAL_PLUS)]
    waiters = []
    for name, priority in plan:
        waiters.append(asyncio.create_task(waiter(name, priority)))
        await asyncio.sleep(0.005)
    while db.bulkhead.queue_depth < len(plan):
        await asyncio.sleep(0.01)
    gauges = {name: value for name, _, value in bsa.gauges(engine)}
    assert gauges["queue_depth"] == len(plan) and gauges["in_flight"] == 2
    release.set()
    await asyncio.gather(*holders, *waiters)
    assert order == ["cp", "c", "c", "c", "p", "p", "p", "s", "s", "s"]


async def test_a_checkout_past_the_queue_bound_is_refused(engine: AsyncEngine) -> None:
    hub = EventHub()
    protect(engine, max_wait=0.2, events=hub)

    async def one(query: str) -> Any:
        async with engine.connect() as conn:
            return (await conn.execute(text(query))).scalar()

    busy = [asyncio.create_task(one("SELECT pg_sleep(1.0)")) for _ in range(2)]
    while bsa.policy(engine).bulkhead.in_flight < 2:
        await asyncio.sleep(0.01)
    with EventRecorder(hub) as seen:
        start = time.monotonic()
        results = await asyncio.gather(*(one("SELECT 1") for _ in range(8)), return_exceptions=True)
        waited = time.monotonic() - start
    await asyncio.gather(*busy)
    assert all(isinstance(r, Rejected) and r.reason is Reason.QUEUE_TIMEOUT for r in results)
    assert waited < 0.2 + BOUND
    assert len([e for e in seen.of(RequestShed) if e.reason is Reason.QUEUE_TIMEOUT]) == 8
    assert {type(s).__name__ for s in bsa.signals(engine)} == {"InFlight", "QueueAge"}


async def test_a_deadline_too_short_is_refused_before_taking_a_connection(
    engine: AsyncEngine,
) -> None:
    protect(engine, min_useful=0.2)
    async with brownout.deadline(0.1):
        with pytest.raises(Rejected) as refused:
            async with engine.connect():
                pass
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    assert engine.sync_engine.pool.checkedout() == 0
    assert bsa.policy(engine).bulkhead.in_flight == 0


def test_protect_refuses_what_it_cannot_instrument(postgres_server: services.Service) -> None:
    made = create_async_engine(dsn(postgres_server, "asyncpg"), pool_size=2)
    bsa.protect(made, name="orders-db")
    with pytest.raises(TypeError, match="already protected"):
        bsa.protect(made, name="orders-db")
    from sqlalchemy.pool import NullPool

    unpooled = create_async_engine(dsn(postgres_server, "asyncpg"), poolclass=NullPool)
    with pytest.raises(TypeError, match="AsyncAdaptedQueuePool"):
        bsa.protect(unpooled, name="orders-db")


# -- reconnects past the budget ----------------------------------------------------------------


class Relay:
    """A TCP relay to PostgreSQL that can go silent: `silence` drops every relayed connection
    and holds new ones without a word, so a reconnect waits until its connect timeout."""

    def __init__(self, pg: services.Service) -> None:
        self._pg = pg
        self._silent = False
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/test"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.silence()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    def silence(self) -> None:
        self._silent = True
        for writer in self._writers:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self._silent:
            return
        up_reader, up_writer = await asyncio.open_connection(self._pg.host, self._pg.port)
        self._writers.append(up_writer)
        for a, b in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(a, b))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("how", ["invalidated", "pre_ping", "pool_invalidated"])
async def test_a_reconnect_past_the_budget_is_deadline_exceeded(
    postgres_server: services.Service, how: str
) -> None:
    """Wherever SQLAlchemy reconnects a pooled connection (in the checkout: an invalidated
    record, a pool invalidated by a lost connection; after it: a failed pre-ping), a connect
    cut at the statement budget reaches the caller as `DeadlineExceeded`, settles the
    admission by that error, and leaves the record in the pool."""
    hub = EventHub()
    async with Relay(postgres_server) as relay:
        engine = create_async_engine(relay.url, pool_size=2, pool_pre_ping=how == "pre_ping")
        protect(engine, events=hub)
        try:

            async def one() -> Any:
                async with engine.connect() as conn:
                    return (await conn.execute(text("SELECT 1"))).scalar()

            async with engine.connect() as first, engine.connect() as second:
                for conn in (first, second):  # two pooled connections, both used
                    await conn.execute(text("SELECT 1"))
                if how == "invalidated":
                    await first.invalidate()
                    await second.invalidate()
            relay.silence()
            await asyncio.sleep(0.2)  # asyncpg sees its connections closed
            if how == "pool_invalidated":
                with pytest.raises(sqlalchemy.exc.DBAPIError) as lost:
                    async with brownout.deadline(5.0):
                        await one()
                assert lost.value.connection_invalidated
            start = time.monotonic()
            with EventRecorder(hub) as seen, pytest.raises(brownout.DeadlineExceeded):
                async with brownout.deadline(0.5):
                    await one()
            assert time.monotonic() - start < 0.5 + BOUND
            assert not seen.of(RequestCompleted)
            assert len(seen.of(RequestFailed)) + len(seen.of(RequestExpired)) == 1
            assert bsa.policy(engine).bulkhead.in_flight == 0
            assert engine.sync_engine.pool.checkedout() == 0
        finally:
            await engine.dispose()


async def test_a_connect_timeout_of_its_own_stays_the_drivers(
    postgres_server: services.Service,
) -> None:
    """A connect timeout the caller set, shorter than the budget, is not the deadline's: its
    `TimeoutError` reaches the caller as it is."""
    async with Relay(postgres_server) as relay:
        relay.silence()
        engine = create_async_engine(relay.url, pool_size=2, connect_args={"timeout": 0.3})
        protect(engine)
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError) as timed_out:
                async with brownout.deadline(10.0), engine.connect():
                    pass
            assert not isinstance(timed_out.value, brownout.DeadlineExceeded)
            assert time.monotonic() - start < 0.3 + BOUND
            assert bsa.policy(engine).bulkhead.in_flight == 0
            assert engine.sync_engine.pool.checkedout() == 0
        finally:
            await engine.dispose()


# -- unknown commits --------------------------------------------------------------------------


@pytest.fixture
async def orders(postgres_server: services.Service) -> AsyncIterator[str]:
    """A table whose COMMIT takes 1.5 s: a deferred constraint trigger sleeps."""
    table = f"orders_{uuid.uuid4().hex[:12]}"
    await admin(brownout.IdempotencyTable().ddl)
    await admin(f"CREATE TABLE {table} (id text PRIMARY KEY)")
    await admin(
        f"CREATE FUNCTION {table}_slow() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$"
    )
    await admin(
        f"CREATE CONSTRAINT TRIGGER {table}_slow AFTER INSERT ON {table}"
        f" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}_slow()"
    )
    try:
        yield table
    finally:
        await admin(f"DROP TABLE {table}")
        await admin(f"DROP FUNCTION {table}_slow()")


async def in_table(table: str, key: str) -> bool:
    return bool(await admin(f"SELECT count(*) FROM {table} WHERE id = %s", key))


async def committing(pid: int) -> None:
    end = time.monotonic() + 5.0
    while not await admin(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND query LIKE 'COMMIT%%'"
        " AND state = 'active'",
        pid,
    ):
        assert time.monotonic() < end, "COMMIT never started"
        await asyncio.sleep(0.02)


async def test_a_backend_killed_during_commit_is_unknown_then_not_applied(
    engine: AsyncEngine, orders: str
) -> None:
    ledger = brownout.InMemoryOutcomeLedger()
    protect(engine, ledger=ledger)
    key = f"k-{uuid.uuid4().hex}"
    pids: asyncio.Queue[int] = asyncio.Queue()

    async def order() -> None:
        async with bsa.transaction(engine, idempotency_key=key) as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
            pids.put_nowait(int(pid))
            await conn.execute(text(f"INSERT INTO {orders} VALUES (:id)"), {"id": key})

    task = asyncio.create_task(order())
    pid = await pids.get()
    await committing(pid)
    await admin("SELECT pg_terminate_backend(%s)", pid)
    with pytest.raises(UnknownOutcome) as unknown:
        await task
    assert unknown.value.idempotency_key == key and unknown.value.recorded is True
    assert await bsa.reconcile(engine, key) is OutcomeState.NOT_APPLIED
    assert not await in_table(orders, key)


async def test_a_commit_past_its_budget_is_unknown_and_reconciles_to_the_truth(
    engine: AsyncEngine, orders: str
) -> None:
    protect(engine, reserve=0.1)
    key = f"k-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(UnknownOutcome) as unknown:
        async with brownout.deadline(0.5), bsa.transaction(engine, idempotency_key=key) as conn:
            await conn.execute(text(f"INSERT INTO {orders} VALUES (:id)"), {"id": key})
    assert time.monotonic() - start < 0.5 + BOUND
    assert unknown.value.idempotency_key == key
    state = await bsa.reconcile(engine, key)
    assert state is not OutcomeState.PENDING
    assert (state is OutcomeState.APPLIED) == await in_table(orders, key)


async def test_a_second_transaction_with_a_committed_key_fails(
    engine: AsyncEngine, orders: str
) -> None:
    protect(engine)
    key = f"k-{uuid.uuid4().hex}"
    async with bsa.transaction(engine, idempotency_key=key) as conn:
        await conn.execute(text(f"INSERT INTO {orders} VALUES (:id)"), {"id": key})
    with pytest.raises(brownout.AlreadyApplied):
        async with bsa.transaction(engine, idempotency_key=key) as conn:
            await conn.execute(text(f"INSERT INTO {orders} VALUES (:id)"), {"id": key + "-b"})
    assert await bsa.reconcile(engine, key) is OutcomeState.APPLIED
    assert await bsa.reconcile(engine, f"k-{uuid.uuid4().hex}") is OutcomeState.NOT_APPLIED
    assert not await in_table(orders, key + "-b")
