"""psycopg 3 (async): a connection pool under brownout's database policy (`DatabasePolicy`).

``BrownoutPsycopgPool(pool, name="orders-db")`` wraps a ``psycopg_pool.AsyncConnectionPool``:

- ``async with db.connection() as conn:`` waits for one of the pool's connections as
  admission (priority order, bounded by the deadline and the queue's age; refusals are
  `Rejected`); like psycopg_pool's own ``connection()``, a transaction left open is committed
  when the block ends and rolled back when it raises;
- every ``await conn.execute(...)`` runs under the statement budget. psycopg has no
  per-call timeout, so the call runs under ``asyncio.timeout(budget)``: psycopg (3.2 and
  later) answers the cancellation with a cancel request to the server and waits for the
  query to stop, so the query ends on the server too (and so it does when the edge's deadline
  cancels the task);
- ``async with db.transaction(idempotency_key=key) as conn:`` writes the key's row in the
  same transaction; a ``COMMIT`` whose answer is lost raises `UnknownOutcome` with the key,
  and ``await db.reconcile(key)`` tells applied from not applied.

The adapter only translates: the decisions are `DatabasePolicy`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg_pool import AsyncConnectionPool, PoolTimeout
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "psycopg", e) from e

from .._admission import Bulkhead, Permit
from .._admission.permit import Untracked
from .._clock import Clock
from .._database import DatabasePolicy, IdempotencyTable
from .._database.watchdog import Watchdog
from .._errors import AlreadyApplied, Rejected
from .._overload import Signal
from .._retry.idempotency import OutcomeLedger, OutcomeRecord, OutcomeState
from ..events import EventHub, hub

__all__ = ["BrownoutPsycopgConnection", "BrownoutPsycopgPool", "budget_cursor_factory"]

T = TypeVar("T")

Query = str | bytes | psycopg.sql.SQL | psycopg.sql.Composed
Params = Sequence[Any] | Mapping[str, Any] | None


def _lost(error: BaseException) -> bool:
    """Whether a driver error means the connection was lost (the server's answer with it).

    A cancelled query is the server's own answer (the transaction did not commit)."""
    if isinstance(error, pg_errors.QueryCanceled):
        return False
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError, OSError))


_CANCELS: set[asyncio.Future[None]] = set()  # cancel requests still on the wire (strong refs)


def _within(
    raw: psycopg.AsyncConnection[Any],
    work: Awaitable[T],
    budget: float | None,
    watchdog: Watchdog | None = None,
) -> Awaitable[T]:
    """``work`` on ``raw`` bounded by ``budget`` seconds: ``work`` itself (no timer, no
    frame) when there is no bound, else `_timed` (kept by ``watchdog``, the policy's)."""
    if budget is None:
        return work
    return _timed(raw, work, budget, _ALONE if watchdog is None else watchdog)


_ALONE = Watchdog()  # for what runs outside any policy (rollbacks, reconcile's probe)


async def _timed(
    raw: psycopg.AsyncConnection[Any], work: Awaitable[T], budget: float, watchdog: Watchdog
) -> T:
    """Await ``work`` on ``raw`` for at most ``budget`` seconds.

    At the budget ``watchdog`` (one timer for all the running statements) sends the server a
    cancel request (``cancel_safe``) from a task of its own, rather than the caller's task
    being cancelled: psycopg closes a connection without cancelling its query when a second
    cancellation (the request's deadline, at the same instant) interrupts its own cancel
    request. The query ends on the server; the caller gets `TimeoutError`."""
    dog = watchdog.watch(work, budget, _cancel_on_server, raw)
    try:
        result = await work
    except pg_errors.QueryCanceled as cancelled:
        if dog.done(work):
            raise  # not at the budget: someone else's cancel request
        raise TimeoutError(f"cancelled on the server at its budget ({budget:.3f} s)") from (
            cancelled
        )
    except BaseException:
        dog.done(work)
        raise
    dog.done(work)
    return result


def _cancel_on_server(raw: psycopg.AsyncConnection[Any]) -> None:
    cancel = asyncio.ensure_future(raw.cancel_safe(timeout=5.0))
    _CANCELS.add(cancel)
    cancel.add_done_callback(_cancel_sent)


def _cancel_sent(cancel: asyncio.Future[None]) -> None:
    _CANCELS.discard(cancel)
    if not cancel.cancelled():
        cancel.exception()  # retrieved: a failed cancel request leaves the timeout to psycopg


def budget_cursor_factory(
    policy: DatabasePolicy, base: type[psycopg.AsyncCursor[Any]] | None = None
) -> type[psycopg.AsyncCursor[Any]]:
    """A ``cursor_factory`` (a subclass of ``base``, default ``psycopg.AsyncCursor``) whose
    ``execute`` and ``executemany`` run under ``policy``'s statement budget, cancelled on
    the server at the budget: for connections this module does not hand out (SQLAlchemy's).
    One class per policy and base."""
    cursor = psycopg.AsyncCursor if base is None else base
    made = _FACTORIES.get((policy, cursor))
    if made is not None:
        return made

    class BudgetCursor(cursor):  # type: ignore[valid-type,misc]
        async def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
            # `DatabasePolicy.statement`, inline: SQLAlchemy runs every query through here.
            budget = policy.statement_budget()
            started = policy.started()
            try:
                return await _within(
                    self.connection,
                    cursor.execute(self, query, params, **kw),
                    budget,
                    policy.watchdog,
                )
            except asyncio.CancelledError:
                policy.cancelled(budget, started)
                raise
            except TimeoutError as error:
                raise policy.timed_out(error, budget, started) from error

        async def executemany(self, query: Any, params_seq: Any, **kw: Any) -> None:
            conn = self.connection
            await policy.statement(
                lambda budget: _within(
                    conn, cursor.executemany(self, query, params_seq, **kw), budget, policy.watchdog
                )
            )

    _FACTORIES[(policy, cursor)] = BudgetCursor
    return BudgetCursor


# One class per (policy, base): policies live as long as their pools.
_FACTORIES: dict[tuple[DatabasePolicy, type[Any]], type[psycopg.AsyncCursor[Any]]] = {}


class BrownoutPsycopgConnection:
    """One admitted connection; each statement runs under the statement budget.

    ``raw`` is the psycopg ``AsyncConnection``, for what this wrapper does not cover
    (statements on it get no budget beyond the task's own cancellation)."""

    __slots__ = ("_policy", "raw")

    def __init__(self, raw: psycopg.AsyncConnection[Any], policy: DatabasePolicy) -> None:
        self.raw = raw
        self._policy = policy

    async def execute(
        self, query: Query, params: Params = None, *, prepare: bool | None = None
    ) -> psycopg.AsyncCursor[Any]:
        """``conn.execute`` under the statement budget; the cursor holds the rows."""
        # `DatabasePolicy.statement`, inline (one frame less on every query's path).
        policy = self._policy
        raw = self.raw
        budget = policy.statement_budget()
        started = policy.started()
        try:
            return await _within(
                raw, raw.execute(query, params, prepare=prepare), budget, policy.watchdog
            )
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error

    async def executemany(
        self, query: Query, params_seq: Iterable[Sequence[Any] | Mapping[str, Any]]
    ) -> None:
        """``cursor.executemany`` under one statement budget."""
        raw = self.raw
        watchdog = self._policy.watchdog

        async def run(budget: float | None) -> None:
            async with raw.cursor() as cur:
                await _within(raw, cur.executemany(query, params_seq), budget, watchdog)

        await self._policy.statement(run)

    async def fetchall(self, query: Query, params: Params = None) -> list[Any]:
        """The rows of ``query`` (fetched with the statement: no second round trip)."""
        cur = await self.execute(query, params)
        return await cur.fetchall()

    async def fetchone(self, query: Query, params: Params = None) -> Any:
        """The first row of ``query``, or ``None``."""
        cur = await self.execute(query, params)
        return await cur.fetchone()

    def __repr__(self) -> str:
        return f"BrownoutPsycopgConnection({self._policy.name!r})"


class BrownoutPsycopgPool:
    """A psycopg ``AsyncConnectionPool`` whose connections are admitted, whose statements
    keep to the request's deadline, and whose keyed transactions report lost commits (D4,
    D5, D6).

    ``max_size`` defaults to the pool's own; the rest is `DatabasePolicy`'s: ``reserve`` kept
    back from the deadline, ``timeout`` a statement's normal bound, ``min_useful`` the least
    time worth sending a statement with, ``max_wait``/``max_queue`` the waiters' bounds,
    ``ledger`` where unknown commits are recorded, ``table`` the idempotency-key table. Open
    the pool yourself (``await pool.open()`` or ``async with pool``).
    """

    __slots__ = ("_pool", "policy")

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        name: str,
        max_size: int | None = None,
        reserve: float = 0.0,
        timeout: float | None = None,
        min_useful: float = 0.0,
        max_wait: float = 0.5,
        max_queue: int | None = None,
        bulkhead: Bulkhead | None = None,
        ledger: OutcomeLedger | None = None,
        table: IdempotencyTable | None = None,
        clock: Clock | None = None,
        events: EventHub = hub,
    ) -> None:
        self._pool = pool
        self.policy = DatabasePolicy(
            name,
            max_size=pool.max_size if max_size is None else max_size,
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

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        """The wrapped psycopg pool."""
        return self._pool

    async def _checkout(self) -> tuple[psycopg.AsyncConnection[Any], Permit | Untracked]:
        """Admitted (the policy's bulkhead), then a connection from the pool within the
        statement budget; ``Rejected`` or `DeadlineExceeded` otherwise."""
        policy = self.policy
        permit: Permit | Untracked
        # Room and nobody waiting: admitted at once, with the budget read once for both.
        admitted = policy.admit_now()
        if admitted is None:
            permit = await policy.admit().__aenter__()  # refuses too short a deadline (D4)
            budget = None
        else:
            permit, budget = admitted
        try:
            if admitted is None:
                budget = policy.statement_budget()  # what is left after the wait
            try:
                raw = await self._pool.getconn(timeout=budget)
            except PoolTimeout as timed_out:
                raise policy.connect_timed_out(timed_out, budget)  # noqa: B904 (chained there)
        except BaseException as error:
            permit.settle_raised(type(error))
            raise
        return raw, permit

    async def _checkin(
        self,
        raw: psycopg.AsyncConnection[Any],
        permit: Permit | Untracked,
        error: type[BaseException] | None,
    ) -> None:
        try:
            await self._pool.putconn(raw)
        finally:
            if error is None:
                permit.success()
            else:
                permit.settle_raised(error)

    def connection(self) -> _Connection:
        """``async with db.connection() as conn:``: admitted, then a connection from the
        pool (taking at most the statement budget). Raises `Rejected` when refused,
        `DeadlineExceeded` when no connection came within the budget. A transaction left
        open commits at the end of the block (an unkeyed commit: a lost answer raises
        `UnknownOutcome` with no key) and rolls back if the block raises."""
        return _Connection(self)

    @contextlib.asynccontextmanager
    async def transaction(
        self, *, idempotency_key: str | None = None
    ) -> AsyncIterator[BrownoutPsycopgConnection]:
        """``async with db.transaction(idempotency_key=key) as conn:`` runs the block in one
        transaction on an admitted connection.

        With a key, its row is written first (`IdempotencyTable.claim`): a second transaction
        with the same key waits for the first and, if it committed, raises `AlreadyApplied`
        before the block runs. A key that is empty, too long or holds NUL raises
        `IdempotencyKeyInvalid` before admission. An error in the block rolls back. A
        ``COMMIT`` whose answer is lost raises `UnknownOutcome` with the key (the connection
        is closed, not reused); reconcile with `reconcile`."""
        policy = self.policy
        if idempotency_key is not None:
            IdempotencyTable.key(idempotency_key)
        raw, permit = await self._checkout()
        conn = BrownoutPsycopgConnection(raw, policy)
        try:
            try:
                if raw.autocommit:
                    await conn.execute("BEGIN")
                if idempotency_key is not None:
                    claim = IdempotencyTable.param_style(policy.table.claim)
                    try:
                        await conn.execute(claim, (idempotency_key,))
                    except pg_errors.UniqueViolation as applied:
                        raise AlreadyApplied(idempotency_key) from applied
                yield conn
            except BaseException:
                await _rollback(raw)
                raise
            await self._commit(raw, idempotency_key)
        except BaseException as error:
            await self._checkin(raw, permit, type(error))
            raise
        await self._checkin(raw, permit, None)

    async def _commit(self, raw: psycopg.AsyncConnection[Any], key: str | None) -> None:
        try:
            await self.policy.commit(
                lambda budget: _within(raw, raw.commit(), budget, self.policy.watchdog),
                key,
                lost=_lost,
            )
        except Rejected:  # the deadline passed before COMMIT was sent: nothing committed
            await _rollback(raw)
            raise
        except BaseException:
            # The answer is lost or the task cancelled mid-COMMIT: the connection's state is
            # unknown, so it is closed (the pool replaces it) rather than handed on.
            await raw.close()
            raise

    # -- unknown commits ----------------------------------------------------------------------

    async def create_table(self) -> None:
        """Create the idempotency-key table if it is missing (`IdempotencyTable.ddl`)."""
        async with self._pool.connection() as raw:
            await raw.execute(self.policy.table.ddl)

    async def reconcile(self, key: str, *, timeout: float = 5.0) -> OutcomeState:  # noqa: ASYNC109
        """Whether the transaction keyed ``key`` committed: ``APPLIED``, ``NOT_APPLIED``, or
        ``PENDING`` when a transaction still holding the key did not finish within
        ``timeout`` seconds. Outside any request's admission (a reconciler's own work). A
        malformed key raises `IdempotencyKeyInvalid` (no transaction can have used it)."""
        IdempotencyTable.key(key)
        probe = IdempotencyTable.param_style(self.policy.table.probe)
        inserted: bool | None
        async with self._pool.connection() as raw:
            try:
                cur = await _within(raw, raw.execute(probe, (key,)), timeout, self.policy.watchdog)
                inserted = await cur.fetchone() is not None
            except TimeoutError:
                inserted = None
            await _rollback(raw)  # the probe writes nothing
        return IdempotencyTable.outcome(inserted)

    async def check(self, record: OutcomeRecord) -> OutcomeState:
        """`reconcile` as a `brownout.Reconciler` check: ``Reconciler(ledger, db.check)``."""
        return await self.reconcile(record.key)

    # -- observability ------------------------------------------------------------------------

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Connections in use, the pool's size, waiters and the oldest wait."""
        return self.policy.gauges()

    def signals(self, *, max_wait: float | None = None) -> list[Signal]:
        """Pool saturation and pool wait, for an `OverloadManager`."""
        return self.policy.signals(max_wait=max_wait)

    def __repr__(self) -> str:
        return f"BrownoutPsycopgPool({self.policy!r})"


class _Connection:
    """`BrownoutPsycopgPool.connection`'s block (a class rather than a generator: it is on
    every query's path)."""

    __slots__ = ("_db", "_permit", "_raw")

    def __init__(self, db: BrownoutPsycopgPool) -> None:
        self._db = db
        self._raw: psycopg.AsyncConnection[Any] | None = None
        self._permit: Permit | Untracked | None = None

    async def __aenter__(self) -> BrownoutPsycopgConnection:
        db = self._db
        raw, self._permit = await db._checkout()
        self._raw = raw
        return BrownoutPsycopgConnection(raw, db.policy)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        db, raw, permit = self._db, self._raw, self._permit
        self._raw = self._permit = None
        assert raw is not None
        assert permit is not None
        if exc_type is not None:
            try:
                await _rollback(raw)
            finally:
                await db._checkin(raw, permit, exc_type)
            return
        try:
            if raw.info.transaction_status != _IDLE:
                await db._commit(raw, None)
        except BaseException as error:
            await db._checkin(raw, permit, type(error))
            raise
        await db._checkin(raw, permit, None)


_IDLE = psycopg.pq.TransactionStatus.IDLE


async def _rollback(raw: psycopg.AsyncConnection[Any]) -> None:
    """Roll back, shielded from a cancellation; a connection that cannot is closed (the
    pool discards a closed connection rather than handing it on)."""
    if raw.closed:
        return
    try:
        await asyncio.shield(_within(raw, raw.rollback(), 5.0))
    except BaseException:  # the caller re-raises what made it roll back
        await raw.close()
