"""Every database adapter under bad input and outages (issue 29), against the real
PostgreSQL: a malformed idempotency key is refused before anything is admitted, a key already
committed answers `AlreadyApplied` (the block does not run), an unreachable or silent server
ends within the deadline with a typed error, backends terminated mid-statement fail the
caller at once, and each time no permit is left held and the next request is served.

Margins are generous (a shared, noisy 2-core host)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from traceback import format_exception
from typing import Any

import pytest
from tests import services

import brownout
from brownout import AlreadyApplied, OutcomeState, Priority, Reason, Rejected
from brownout.idempotency import IdempotencyKeyInvalid

asyncpg = pytest.importorskip("asyncpg")
psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")
pytest.importorskip("sqlalchemy")

from sqlalchemy import text  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402
from sqlalchemy.ext.asyncio import create_async_engine  # noqa: E402

from brownout.integrations import sqlalchemy as bsa  # noqa: E402
from brownout.integrations.asyncpg import BrownoutPool  # noqa: E402
from brownout.integrations.psycopg import BrownoutPsycopgPool  # noqa: E402

pytestmark = pytest.mark.integration

ADAPTERS = ["asyncpg", "psycopg", "sqlalchemy+asyncpg", "sqlalchemy+psycopg"]
BOUND = 2.0  # a failing call answers within this (its deadline is well under it)
LIMIT = 30.0  # the test's own guard: reaching it means something hung


class Adapter:
    """One adapter behind the same few calls, so each case runs on all of them."""

    def __init__(
        self,
        *,
        one: Callable[[], Awaitable[Any]],
        sleep: Callable[[float], Awaitable[Any]],
        keyed: Callable[[str, list[str]], Awaitable[None]],
        reconcile: Callable[[str], Awaitable[OutcomeState]],
        policy: brownout.DatabasePolicy,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.one = one
        self.sleep = sleep
        self.keyed = keyed
        self.reconcile = reconcile
        self.policy = policy
        self.close = close

    @property
    def in_flight(self) -> int:
        return self.policy.bulkhead.in_flight


def _asyncpg(host: str, port: int, **kw: Any) -> Callable[[], Awaitable[Adapter]]:
    async def make() -> Adapter:
        pool = await asyncpg.create_pool(
            f"postgresql://postgres@{host}:{port}/test", min_size=0, max_size=kw.pop("size", 2)
        )
        db = BrownoutPool(pool, name="outage-db", **kw)

        async def keyed(key: str, ran: list[str]) -> None:
            async with db.transaction(idempotency_key=key):
                ran.append(key)

        return Adapter(
            one=lambda: db.fetchval("SELECT 1"),
            sleep=lambda s: db.fetchval("SELECT pg_sleep($1)", s),
            keyed=keyed,
            reconcile=db.reconcile,
            policy=db.policy,
            close=pool.close,
        )

    return make


def _psycopg(host: str, port: int, **kw: Any) -> Callable[[], Awaitable[Adapter]]:
    async def make() -> Adapter:
        pool = psycopg_pool.AsyncConnectionPool(
            f"dbname=test user=postgres host={host} port={port} connect_timeout=5",
            min_size=0,
            max_size=kw.pop("size", 2),
            open=False,
            # Without a check the pool hands out an idle connection the server terminated.
            check=psycopg_pool.AsyncConnectionPool.check_connection,
        )
        await pool.open()
        db = BrownoutPsycopgPool(pool, name="outage-db", **kw)

        async def one() -> Any:
            async with db.connection() as conn:
                return await conn.fetchone("SELECT 1")

        async def sleep(seconds: float) -> Any:
            async with db.connection() as conn:
                return await conn.fetchone("SELECT pg_sleep(%s)", (seconds,))

        async def keyed(key: str, ran: list[str]) -> None:
            async with db.transaction(idempotency_key=key):
                ran.append(key)

        return Adapter(
            one=one,
            sleep=sleep,
            keyed=keyed,
            reconcile=db.reconcile,
            policy=db.policy,
            close=pool.close,
        )

    return make


def _sqlalchemy(driver: str, host: str, port: int, **kw: Any) -> Callable[[], Awaitable[Adapter]]:
    async def make() -> Adapter:
        engine = create_async_engine(
            f"postgresql+{driver}://postgres@{host}:{port}/test",
            pool_size=kw.pop("size", 2),
            pool_pre_ping=True,  # a terminated idle connection is replaced at checkout
        )
        bsa.protect(engine, name="outage-db", **kw)

        async def one() -> Any:
            async with engine.connect() as conn:
                return (await conn.execute(text("SELECT 1"))).scalar()

        async def sleep(seconds: float) -> Any:
            async with engine.connect() as conn:
                return (await conn.execute(text("SELECT pg_sleep(:s)"), {"s": seconds})).all()

        async def keyed(key: str, ran: list[str]) -> None:
            async with bsa.transaction(engine, idempotency_key=key):
                ran.append(key)

        return Adapter(
            one=one,
            sleep=sleep,
            keyed=keyed,
            reconcile=lambda key: bsa.reconcile(engine, key),
            policy=bsa.policy(engine),
            close=engine.dispose,
        )

    return make


def maker(name: str, host: str, port: int, **kw: Any) -> Callable[[], Awaitable[Adapter]]:
    if name == "asyncpg":
        return _asyncpg(host, port, **kw)
    if name == "psycopg":
        return _psycopg(host, port, **kw)
    return _sqlalchemy(name.split("+")[1], host, port, **kw)


@pytest.fixture(params=ADAPTERS)
async def db(
    request: pytest.FixtureRequest, postgres_server: services.Service
) -> AsyncIterator[Adapter]:
    made = await maker(request.param, postgres_server.host, postgres_server.port)()
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def key_table(postgres_server: services.Service) -> None:
    conn = await asyncpg.connect(
        f"postgresql://postgres@{postgres_server.host}:{postgres_server.port}/test"
    )
    try:
        await conn.execute(brownout.IdempotencyTable().ddl)
    finally:
        await conn.close()


async def timed(work: Awaitable[Any]) -> tuple[BaseException | None, float]:
    """What ``work`` raised (``None`` if it returned) and how long it took."""
    start = time.monotonic()
    try:
        await asyncio.wait_for(work, LIMIT)
    except BaseException as error:
        return error, time.monotonic() - start
    return None, time.monotonic() - start


async def under(seconds: float, work: Callable[[], Awaitable[Any]]) -> Any:
    async with brownout.deadline(seconds):
        return await work()


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("key_table")
@pytest.mark.parametrize("key", ["", "a\x00b", "k" * 256, "é" * 2000])
async def test_a_malformed_key_is_refused_before_admission(db: Adapter, key: str) -> None:
    ran: list[str] = []
    with pytest.raises(IdempotencyKeyInvalid):
        await db.keyed(key, ran)
    with pytest.raises(IdempotencyKeyInvalid):
        await db.reconcile(key)
    assert ran == []
    assert db.in_flight == 0


@pytest.mark.usefixtures("key_table")
async def test_a_committed_key_answers_already_applied_and_the_block_does_not_run(
    db: Adapter,
) -> None:
    key = f"order-{uuid.uuid4()}"
    ran: list[str] = []
    await db.keyed(key, ran)
    with pytest.raises(AlreadyApplied) as applied:
        await db.keyed(key, ran)
    assert applied.value.idempotency_key == key
    assert ran == [key]  # the second block never ran
    assert db.in_flight == 0
    assert await db.reconcile(key) is OutcomeState.APPLIED
    assert await db.one() in (1, (1,))  # the connection was rolled back and reused


@pytest.mark.usefixtures("key_table")
async def test_reconcile_of_a_key_never_used_is_not_applied_and_leaves_no_row(
    db: Adapter,
) -> None:
    key = f"never-{uuid.uuid4()}"
    assert await db.reconcile(key) is OutcomeState.NOT_APPLIED
    ran: list[str] = []
    await db.keyed(key, ran)  # the probe was rolled back: the key is still free
    assert ran == [key]


# -- outages -----------------------------------------------------------------------------------


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("name", ADAPTERS)
async def test_a_closed_port_fails_at_once_with_a_connection_error(name: str) -> None:
    made = await maker(name, "127.0.0.1", closed_port())()
    try:
        error, took = await timed(under(1.0, made.one))
        assert error is not None
        # The driver's own connection error (OSError, asyncpg's, psycopg's or SQLAlchemy's
        # OperationalError), or the deadline: never a hang and never a held permit.
        assert isinstance(
            error,
            (OSError, brownout.DeadlineExceeded, psycopg.OperationalError, DBAPIError),
        ), repr(error)
        assert took < BOUND
        assert made.in_flight == 0
    finally:
        await made.close()


@pytest.mark.parametrize("name", ADAPTERS)
async def test_a_silent_server_ends_at_the_deadline(name: str) -> None:
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    made = await maker(name, "127.0.0.1", port)()
    try:
        error, took = await timed(under(0.5, made.one))
        assert isinstance(error, brownout.DeadlineExceeded), repr(error)
        assert took < BOUND
        assert made.in_flight == 0
    finally:
        for writer in held:
            writer.close()
        server.close()
        await made.close()


async def terminate_all(pg: services.Service) -> int:
    # Only this file's bare sleeps: the lab's database service sleeps in `test` too.
    conn = await asyncpg.connect(f"postgresql://postgres@{pg.host}:{pg.port}/test")
    try:
        return int(
            await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = 'test' AND pid <> pg_backend_pid()"
                " AND query LIKE 'SELECT pg_sleep(%' AND state = 'active'"
            )
        )
    finally:
        await conn.close()


async def test_backends_terminated_mid_statement_fail_at_once_and_the_pool_recovers(
    db: Adapter, postgres_server: services.Service
) -> None:
    sleepers = [asyncio.create_task(timed(under(10.0, lambda: db.sleep(8.0)))) for _ in range(2)]
    end = time.monotonic() + 5.0
    killed = 0
    while killed < 2 and time.monotonic() < end:
        await asyncio.sleep(0.1)
        killed += await terminate_all(postgres_server)
    assert killed == 2
    for error, took in await asyncio.gather(*sleepers):
        assert error is not None and not isinstance(error, asyncio.CancelledError), repr(error)
        assert took < 8.0  # failed when the backend went, not when the sleep would have ended
    assert db.in_flight == 0
    for _ in range(3):  # and the next requests are served, on fresh connections
        assert await under(5.0, db.one) in (1, (1,))
    assert db.in_flight == 0


# -- queue bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ADAPTERS)
async def test_a_full_queue_refuses_and_evicts_at_once(
    name: str, postgres_server: services.Service
) -> None:
    """Pool of 2, queue of 8, 2 holders and 10 waiters: the two refused (queue full, or
    evicted by a more important waiter) hear it at once; the rest are served; none hangs."""
    made = await maker(
        name, postgres_server.host, postgres_server.port, max_wait=5.0, max_queue=8
    )()
    try:

        async def call(priority: Priority, seconds: float) -> tuple[BaseException | None, float]:
            async def work() -> Any:
                async with brownout.request(deadline=10.0, priority=priority):
                    return await made.sleep(seconds)

            return await timed(work())

        holders = [asyncio.create_task(call(Priority.CRITICAL, 1.0)) for _ in range(2)]
        while made.in_flight < 2:
            await asyncio.sleep(0.01)
        waiters = []
        for i in range(10):
            priority = (Priority.SHEDDABLE, Priority.SHEDDABLE_PLUS, Priority.CRITICAL)[i % 3]
            waiters.append(asyncio.create_task(call(priority, 0.01)))
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*holders, *waiters)
        refused = [(e, took) for e, took in results if e is not None]
        assert len(refused) == 2, refused
        for error, took in refused:
            assert isinstance(error, Rejected) and error.reason is Reason.QUEUE_FULL
            assert took < 0.5  # at once, not at the holders' release
        assert made.in_flight == 0
    finally:
        await made.close()


# -- no deadline -------------------------------------------------------------------------------


async def test_a_statement_timeout_bounds_an_acquire_without_a_deadline() -> None:
    """With no deadline, ``timeout=`` is the acquire's bound too (else the driver's own
    connect timeout: asyncpg's 60 s, psycopg_pool's 30 s)."""
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    made = await maker("asyncpg", "127.0.0.1", port, timeout=0.5)()
    try:
        error, took = await timed(made.one())
        assert isinstance(error, brownout.DeadlineExceeded), repr(error)
        assert took < BOUND
        assert made.in_flight == 0
    finally:
        for writer in held:
            writer.close()
        server.close()
        await made.close()


@pytest.mark.parametrize("name", ADAPTERS)
async def test_a_silent_server_ends_within_the_budget_without_cancellation(name: str) -> None:
    """A deadline that only sets the context (``with``, no cancellation) still bounds the
    connect: by the statement budget (psycopg's connect timeout is whole seconds, 2 at least)."""
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    made = await maker(name, "127.0.0.1", port)()

    async def context_only() -> Any:
        with brownout.deadline(0.5):
            return await made.one()

    try:
        error, took = await timed(context_only())
        assert isinstance(error, (brownout.DeadlineExceeded, DBAPIError)), repr(error)
        assert took < 2.0 + BOUND
        assert made.in_flight == 0
    finally:
        for writer in held:
            writer.close()
        server.close()
        await made.close()


# -- accounting under load ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ADAPTERS)
async def test_under_load_every_request_is_counted_once_and_nothing_is_left_running(
    name: str, postgres_server: services.Service
) -> None:
    """8 connections, 100 concurrent requests with deadlines of 10 to 300 ms, each sleeping
    up to 300 ms on the server: offered = admitted + shed + left the queue at its deadline,
    each admitted request ends once, no permit is left held and, a second later, no backend
    still runs a statement."""
    from brownout import Stats
    from brownout.events import EventHub

    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    made = await maker(
        name, postgres_server.host, postgres_server.port, events=hub, max_wait=0.2, size=8
    )()
    rng = random.Random(29)
    try:

        async def one(deadline: float, sleep: float) -> None:
            async with brownout.deadline(deadline):
                await made.sleep(sleep)

        plan = [(rng.uniform(0.01, 0.3), rng.uniform(0.0, 0.3)) for _ in range(100)]
        ended = await asyncio.wait_for(
            asyncio.gather(*(one(d, s) for d, s in plan), return_exceptions=True), LIMIT
        )
        typed = (Rejected, brownout.DeadlineExceeded)
        untyped = [e for e in ended if e is not None and type(e) not in typed]
        assert not untyped, "".join(line for e in untyped for line in format_exception(e))
        await asyncio.sleep(1.0)
        assert await running_sleeps(postgres_server) == 0
    finally:
        await made.close()
    assert made.in_flight == 0

    def count(kind: str, **labels: str) -> int:
        return stats.count(kind, source="outage-db", **labels)

    left_queue = count("expired", reason="queue") + count("abandoned", reason="queue")
    assert count("offered") == 100
    assert count("offered") == count("admitted") + count("shed") + left_queue
    outcomes = ("completed", "completed_late", "failed", "abandoned", "expired")
    assert sum(count(k) for k in outcomes) - left_queue == count("admitted")


async def running_sleeps(pg: services.Service) -> int:
    conn = await asyncpg.connect(f"postgresql://postgres@{pg.host}:{pg.port}/test")
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                " AND pid <> pg_backend_pid() AND query LIKE 'SELECT pg_sleep(%'"
            )
        )
    finally:
        await conn.close()
