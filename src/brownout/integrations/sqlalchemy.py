"""SQLAlchemy asyncio: an ``AsyncEngine`` under brownout's database policy (`DatabasePolicy`).

``engine = protect(create_async_engine(url, pool_size=10), name="orders-db")`` instruments
the engine in place (``postgresql+asyncpg://`` or ``postgresql+psycopg://``), so
``engine.connect()``, ``engine.begin()`` and sessions bound to it all keep to it:

- **Checkout is admission**: the engine's pool waits for a connection through the policy's
  bulkhead (priority order, bounded by the deadline and the queue's age; refusals are
  `Rejected`), never in SQLAlchemy's own FIFO queue (its overflow is not used);
- **Each statement runs under the statement budget**, set where the driver takes it: a
  connection class whose prepared statements get asyncpg's ``timeout=`` (asyncpg sends the
  server a cancel request), or a psycopg cursor class whose ``execute`` sends a cancel
  request at the budget. Set through the documented ``do_connect`` event, so connections
  opened before `protect` keep no budget (call it before the first checkout);
- ``async with transaction(engine, idempotency_key=key) as conn:`` writes the key's row
  in the same transaction and raises `UnknownOutcome` with the key when the answer to
  ``COMMIT`` is lost; ``await reconcile(engine, key)`` tells applied from not applied.

The adapter only translates: the decisions are `DatabasePolicy`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

try:
    from sqlalchemy import event, exc, text
    from sqlalchemy.engine import Engine
    from sqlalchemy.engine.interfaces import DBAPIConnection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
    from sqlalchemy.pool import AsyncAdaptedQueuePool, ConnectionPoolEntry
    from sqlalchemy.util import await_
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "sqlalchemy", e) from e

from .._admission import Bulkhead, Permit
from .._admission.permit import Untracked
from .._clock import Clock
from .._database import DatabasePolicy, IdempotencyTable
from .._errors import AlreadyApplied, Rejected
from .._overload import Signal
from .._retry.idempotency import OutcomeLedger, OutcomeState
from ..events import EventHub, hub

__all__ = ["create_table", "gauges", "policy", "protect", "reconcile", "signals", "transaction"]

_ASYNCPG_RESERVE = 0.05  # the cancel request is sent before the deadline cancels the task
_CONNECT_BUDGET = "brownout.connect_budget"  # a record's info: its connect's timeout was ours
_POLICIES: weakref.WeakKeyDictionary[Engine, DatabasePolicy] = weakref.WeakKeyDictionary()


def protect(
    engine: AsyncEngine,
    *,
    name: str,
    max_size: int | None = None,
    reserve: float | None = None,
    timeout: float | None = None,
    min_useful: float = 0.0,
    max_wait: float = 0.5,
    max_queue: int | None = None,
    bulkhead: Bulkhead | None = None,
    ledger: OutcomeLedger | None = None,
    table: IdempotencyTable | None = None,
    clock: Clock | None = None,
    events: EventHub = hub,
) -> AsyncEngine:
    """Put ``engine`` under a `DatabasePolicy` named ``name`` and return it.

    ``max_size`` defaults to the pool's ``pool_size``; the rest is `DatabasePolicy`'s.
    ``reserve`` defaults to 50 ms on asyncpg (SQLAlchemy closes a connection whose statement
    was cancelled; a cancellation at the same instant, the request's deadline, makes that
    close abort asyncpg's cancel request, so the budget must end first) and 0 on psycopg. The
    engine must use SQLAlchemy's default asyncio pool (``AsyncAdaptedQueuePool``) and the
    ``asyncpg`` or ``psycopg`` driver, without ``async_creator`` (its connections would not
    take the budget): anything else raises `TypeError`, as does protecting it twice."""
    sync_engine = engine.sync_engine
    pool = sync_engine.pool
    if sync_engine in _POLICIES:
        raise TypeError(f"{engine!r} is already protected")
    if type(pool) is not AsyncAdaptedQueuePool:
        raise TypeError(
            f"protect() needs the engine's default AsyncAdaptedQueuePool, not {type(pool).__name__}"
        )
    driver = sync_engine.dialect.driver
    if driver not in ("asyncpg", "psycopg"):
        raise TypeError(f"protect() supports the asyncpg and psycopg drivers, not {driver!r}")
    if reserve is None:
        reserve = _ASYNCPG_RESERVE if driver == "asyncpg" else 0.0
    db = DatabasePolicy(
        name,
        max_size=pool.size() if max_size is None else max_size,
        max_wait=max_wait,
        max_queue=max_queue,
        timeout=timeout,
        reserve=reserve,
        min_useful=min_useful,
        bulkhead=bulkhead,
        ledger=ledger,
        table=table,
        clock=clock,
        events=events,
    )
    _POLICIES[sync_engine] = db
    pool.__class__ = _AdmittedPool  # same layout: the subclass only overrides methods
    assert isinstance(pool, _AdmittedPool)
    pool._brownout_setup(db)
    if driver == "asyncpg":
        from ._asyncpg_budget import budget_connection_class

        def on_connect(dialect: Any, rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
            cparams["connection_class"] = budget_connection_class(
                db, cparams.get("connection_class")
            )
            budget = db.statement_budget()  # a connect is bounded like the checkout it serves
            if budget is not None and budget < cparams.get("timeout", math.inf):
                cparams["timeout"] = budget
                if rec is not None:  # for `_AdmittedPool._connect`: this timeout is the deadline's
                    rec.info[_CONNECT_BUDGET] = budget
    else:
        from .psycopg import budget_cursor_factory

        def on_connect(dialect: Any, rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
            cparams["cursor_factory"] = budget_cursor_factory(db, cparams.get("cursor_factory"))
            budget = db.statement_budget()  # libpq's connect_timeout: whole seconds, 2 at least
            if budget is not None:
                seconds = max(2, math.ceil(budget))
                if seconds < float(cparams.get("connect_timeout") or math.inf):
                    cparams["connect_timeout"] = seconds

    event.listen(sync_engine, "do_connect", on_connect)
    return engine


def policy(engine: AsyncEngine) -> DatabasePolicy:
    """The `DatabasePolicy` `protect` put ``engine`` under (`KeyError` if none)."""
    return _POLICIES[engine.sync_engine]


class _AdmittedPool(AsyncAdaptedQueuePool):
    """The engine's pool, its checkouts admitted by the policy's bulkhead first, and every
    connect it makes translated (`DatabasePolicy.connect_timed_out`)."""

    _brownout: DatabasePolicy
    _brownout_permits: dict[ConnectionPoolEntry, Permit | Untracked]
    _brownout_creator: Callable[[ConnectionPoolEntry], DBAPIConnection]

    def _brownout_setup(self, db: DatabasePolicy) -> None:
        self._brownout = db
        self._brownout_permits = {}
        # Every connect goes through here: the checkout's, and those SQLAlchemy makes after
        # `_do_get` (a failed pre-ping's reconnect).
        self._brownout_creator = self._invoke_creator
        self._invoke_creator = self._connect

    def _connect(self, rec: ConnectionPoolEntry) -> DBAPIConnection:
        try:
            return self._brownout_creator(rec)
        except BaseException as error:
            failed = error
            if isinstance(error, TimeoutError):
                failed = self._brownout.connect_timed_out(error, rec.info.get(_CONNECT_BUDGET))
            permit = self._brownout_permits.pop(rec, None)
            if permit is not None:  # checked out already: the checkout fails with this
                permit.settle_raised(type(failed))
            raise failed  # noqa: B904 (chained there)
        finally:
            rec.info.pop(_CONNECT_BUDGET, None)

    def _do_get(self) -> ConnectionPoolEntry:
        db = self._brownout
        permit: Permit | Untracked
        # Room and nobody waiting: admitted without a switch out of SQLAlchemy's greenlet.
        admitted = db.admit_now()
        if admitted is None:
            permit = db.admit()  # refuses too short a deadline before waiting (D4)
            await_(permit.__aenter__())
        else:
            permit = admitted[0]
        try:
            record = super()._do_get()  # a new record connects here
        except BaseException as error:
            permit.settle_raised(type(error))
            raise
        try:
            # What the checkout would reconnect (invalidated, recycled, pool invalidated) is
            # reconnected here, so a failed connect settles this admission by its error.
            record.get_connection()  # type: ignore[attr-defined]  # _ConnectionRecord
        except BaseException as error:
            # back to the pool, as SQLAlchemy's checkout does
            record._checkin_failed(error, _fairy_was_created=False)  # type: ignore[attr-defined]
            permit.settle_raised(type(error))
            raise
        self._brownout_permits[record] = permit
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        permit = self._brownout_permits.pop(record, None)
        super()._do_return_conn(record)
        if permit is not None:
            permit.success()

    def recreate(self) -> _AdmittedPool:
        fresh = super().recreate()
        assert isinstance(fresh, _AdmittedPool)
        fresh._brownout_setup(self._brownout)
        return fresh


# -- unknown commits --------------------------------------------------------------------------


def _lost(error: BaseException) -> bool:
    """Whether an error from ``COMMIT`` means the connection was lost with the answer."""
    if isinstance(error, exc.DBAPIError):
        return bool(error.connection_invalidated)
    return isinstance(error, (ConnectionError, OSError))


async def _within(work: Any, budget: float | None) -> None:
    """Await ``work`` for at most ``budget`` seconds; the driver answers the cancellation
    with a cancel request to the server."""
    if budget is None:
        await work
        return
    async with asyncio.timeout(budget):
        await work


def _named(sql: str) -> str:
    """The key table's SQL with ``$1`` written as SQLAlchemy's ``:key``."""
    return re.sub(r"\$1\b", ":key", sql)


@contextlib.asynccontextmanager
async def transaction(
    engine: AsyncEngine, *, idempotency_key: str | None = None
) -> AsyncIterator[AsyncConnection]:
    """``async with transaction(engine, idempotency_key=key) as conn:`` runs the block in
    one transaction on an admitted connection (D6).

    With a key, its row is written first (`IdempotencyTable.claim`): a second transaction
    with the same key waits for the first and, if it committed, raises `AlreadyApplied`
    before the block runs. A key that is empty, too long or holds NUL raises
    `IdempotencyKeyInvalid` before admission. An error in the block rolls back.
    A ``COMMIT`` whose answer is lost raises `UnknownOutcome` with the key (the connection
    is invalidated, not reused); reconcile with `reconcile`."""
    db = policy(engine)
    if idempotency_key is not None:
        IdempotencyTable.key(idempotency_key)
    async with engine.connect() as conn:
        await conn.begin()
        try:
            if idempotency_key is not None:
                try:
                    await conn.execute(text(_named(db.table.claim)), {"key": idempotency_key})
                except exc.IntegrityError as applied:  # the claim's only constraint: the key
                    raise AlreadyApplied(idempotency_key) from applied
            yield conn
        except BaseException:
            await _rollback(conn)
            raise
        try:
            await db.commit(
                lambda budget: _within(conn.commit(), budget), idempotency_key, lost=_lost
            )
        except Rejected:  # the deadline passed before COMMIT was sent: nothing committed
            await _rollback(conn)
            raise
        except BaseException:
            # The answer is lost: the connection's state is unknown; it is not reused.
            if not conn.invalidated:
                await asyncio.shield(conn.invalidate())
            raise


async def _rollback(conn: AsyncConnection) -> None:
    """Roll back, shielded from a cancellation; a connection that cannot is invalidated."""
    if conn.invalidated:
        return
    try:
        await asyncio.shield(conn.rollback())
    except BaseException:  # the caller re-raises what made it roll back
        with contextlib.suppress(BaseException):
            await asyncio.shield(conn.invalidate())


async def create_table(engine: AsyncEngine) -> None:
    """Create the idempotency-key table if it is missing (`IdempotencyTable.ddl`)."""
    async with engine.begin() as conn:
        await conn.execute(text(policy(engine).table.ddl))


async def reconcile(engine: AsyncEngine, key: str, *, timeout: float = 5.0) -> OutcomeState:  # noqa: ASYNC109
    """Whether the transaction keyed ``key`` committed: ``APPLIED``, ``NOT_APPLIED``, or
    ``PENDING`` when a transaction still holding the key did not finish within ``timeout``
    seconds. On a connection of the engine (a reconciler's own work: no request scope). A
    malformed key raises `IdempotencyKeyInvalid` (no transaction can have used it)."""
    IdempotencyTable.key(key)
    probe = text(_named(policy(engine).table.probe))
    inserted: bool | None
    async with engine.connect() as conn:
        try:
            async with asyncio.timeout(timeout):
                found = (await conn.execute(probe, {"key": key})).first()
            inserted = found is not None
        except TimeoutError:
            inserted = None
        await _rollback(conn)  # the probe writes nothing
    return IdempotencyTable.outcome(inserted)


# -- observability ----------------------------------------------------------------------------


def gauges(engine: AsyncEngine) -> Iterator[tuple[str, Mapping[str, str], float]]:
    """Connections in use, the pool's size, waiters and the oldest wait."""
    return policy(engine).gauges()


def signals(engine: AsyncEngine, *, max_wait: float | None = None) -> list[Signal]:
    """Pool saturation and pool wait, for an `OverloadManager`."""
    return policy(engine).signals(max_wait=max_wait)
