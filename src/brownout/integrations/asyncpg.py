"""asyncpg: a connection pool under brownout's database policy (`brownout.DatabasePolicy`).

``BrownoutPool(pool, name="orders-db")`` wraps an ``asyncpg.Pool``:

- ``async with db.acquire() as conn:`` waits for one of the pool's connections as admission
  (priority order, bounded by the deadline and the queue's age; refusals are `Rejected`);
- every statement on ``conn`` (``fetch``, ``fetchrow``, ``fetchval``, ``execute``,
  ``executemany``) gets asyncpg's own ``timeout=`` from the statement budget. asyncpg sends
  the server a cancel request when that timeout fires and when the task running the
  statement is cancelled (the edge's deadline), so the query stops on the server too;
- ``async with db.transaction(idempotency_key=key) as conn:`` writes the key's row in the
  same transaction; a ``COMMIT`` whose answer is lost raises `UnknownOutcome` with the key,
  and ``await db.reconcile(key)`` tells applied from not applied.

The adapter only translates: the decisions are `DatabasePolicy`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

try:
    import asyncpg
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "postgres", e) from e

from .._admission import Bulkhead, Permit
from .._admission.permit import Untracked
from .._clock import Clock
from .._database import DatabasePolicy, IdempotencyTable
from .._database.watchdog import LoopWatchdog
from .._errors import AlreadyApplied, Rejected
from .._overload import Signal
from .._retry.idempotency import OutcomeLedger, OutcomeRecord, OutcomeState
from ..events import EventHub, hub

__all__ = ["BrownoutConnection", "BrownoutPool"]

T = TypeVar("T")

_LOST = (
    asyncpg.PostgresConnectionError,  # the connection is gone (08xxx, or closed under us)
    asyncpg.InterfaceError,  # "connection is closed", "another operation is in progress"
    asyncpg.exceptions.AdminShutdownError,  # terminated by the server: maybe after it committed
    asyncpg.exceptions.CrashShutdownError,
    ConnectionError,
    OSError,
)


def _lost(error: BaseException) -> bool:
    """Whether a driver error means the connection was lost (the server's answer with it)."""
    return isinstance(error, _LOST)


class BrownoutConnection:
    """One admitted connection; each statement runs under the statement budget.

    ``raw`` is the asyncpg connection, for what this wrapper does not cover (statements on it
    get no budget and no cancellation at the deadline beyond the task's own)."""

    __slots__ = ("_policy", "raw")

    def __init__(self, raw: asyncpg.Connection, policy: DatabasePolicy) -> None:
        self.raw = raw
        self._policy = policy

    # Each statement reads its budget and runs in `_run` (the policy's watchdog keeps the
    # budget: asyncpg is given no timeout, which would arm a loop timer per statement).

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        policy = self._policy
        budget = policy.statement_budget()
        rows: list[asyncpg.Record] = await _run(policy, None, budget, self.raw.fetch(query, *args))
        return rows

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        policy = self._policy
        budget = policy.statement_budget()
        row: asyncpg.Record | None = await _run(
            policy, None, budget, self.raw.fetchrow(query, *args)
        )
        return row

    async def fetchval(self, query: str, *args: Any, column: int = 0) -> Any:
        policy = self._policy
        budget = policy.statement_budget()
        return await _run(policy, None, budget, self.raw.fetchval(query, *args, column=column))

    async def execute(self, query: str, *args: Any) -> str:
        policy = self._policy
        budget = policy.statement_budget()
        status: str = await _run(policy, None, budget, self.raw.execute(query, *args))
        return status

    async def executemany(self, query: str, args: Iterable[Sequence[Any]]) -> None:
        policy = self._policy
        budget = policy.statement_budget()
        await _run(policy, None, budget, self.raw.executemany(query, args))

    def __repr__(self) -> str:
        return f"BrownoutConnection({self._policy.name!r})"


class BrownoutPool:
    """An ``asyncpg.Pool`` whose connections are admitted, whose statements keep to the
    request's deadline, and whose keyed transactions report lost commits (D4, D5, D6).

    ``max_size`` defaults to the pool's own; the rest is `DatabasePolicy`'s: ``reserve`` kept
    back from the deadline, ``timeout`` a statement's normal bound, ``min_useful`` the least
    time worth sending a statement with, ``max_wait``/``max_queue`` the waiters' bounds,
    ``ledger`` where unknown commits are recorded, ``table`` the idempotency-key table.
    """

    __slots__ = ("_pool", "policy")

    def __init__(
        self,
        pool: asyncpg.Pool,
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
            max_size=pool.get_max_size() if max_size is None else max_size,
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
    def pool(self) -> asyncpg.Pool:
        """The wrapped asyncpg pool."""
        return self._pool

    def acquire(self) -> _Acquire:
        """``async with db.acquire() as conn:``: admitted, then a connection from the pool
        (taking at most the statement budget, as opening one may). Raises `Rejected` when
        refused, `DeadlineExceeded` when no connection came within the budget."""
        return _Acquire(self._pool, self.policy)

    @contextlib.asynccontextmanager
    async def transaction(
        self, *, idempotency_key: str | None = None, isolation: str | None = None
    ) -> AsyncIterator[BrownoutConnection]:
        """``async with db.transaction(idempotency_key=key) as conn:`` runs the block in one
        transaction on an admitted connection.

        With a key, its row is written first (`IdempotencyTable.claim`): a second transaction
        with the same key waits for the first and, if it committed, raises `AlreadyApplied`
        before the block runs. A key that is empty, too long or holds NUL raises
        `IdempotencyKeyInvalid` before admission. An error in the block rolls back.
        A ``COMMIT`` whose answer is lost raises `UnknownOutcome` with the key (the
        connection is closed, not reused); reconcile with `reconcile`."""
        policy = self.policy
        if idempotency_key is not None:
            IdempotencyTable.key(idempotency_key)
        begin = "BEGIN" if isolation is None else f"BEGIN ISOLATION LEVEL {_isolation(isolation)}"
        async with self.acquire() as conn:
            raw = conn.raw
            await conn.execute(begin)
            try:
                if idempotency_key is not None:
                    try:
                        await conn.execute(policy.table.claim, idempotency_key)
                    except asyncpg.UniqueViolationError as applied:
                        raise AlreadyApplied(idempotency_key) from applied
                yield conn
            except BaseException:
                await _rollback(raw)
                raise
            try:
                await policy.commit(
                    lambda budget: raw.execute("COMMIT", timeout=budget),
                    idempotency_key,
                    lost=_lost,
                )
            except Rejected:  # the deadline passed before COMMIT was sent: nothing committed
                await _rollback(raw)
                raise
            except BaseException:
                # The answer is lost or the task cancelled mid-COMMIT: the connection's
                # state is unknown, so it is closed rather than handed to the next caller.
                _close(raw)
                raise

    # The shortcuts: with an idle connection and room in the bulkhead (`admit_now`), the
    # pool's own shortcut runs under the budget read at admission (kept by the watchdog, as
    # the pool's release waits for a cancelled query to stop); otherwise the full path.

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """Acquire (admitted), run ``query`` under the statement budget, release."""
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetch(query, *args)
        permit, budget = admitted
        rows: list[asyncpg.Record] = await _run(
            self.policy, permit, budget, pool.fetch(query, *args)
        )
        return rows

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetchrow(query, *args)
        permit, budget = admitted
        row: asyncpg.Record | None = await _run(
            self.policy, permit, budget, pool.fetchrow(query, *args)
        )
        return row

    async def fetchval(self, query: str, *args: Any, column: int = 0) -> Any:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetchval(query, *args, column=column)
        permit, budget = admitted
        return await _run(
            self.policy,
            permit,
            budget,
            pool.fetchval(query, *args, column=column),
        )

    async def execute(self, query: str, *args: Any) -> str:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.execute(query, *args)
        permit, budget = admitted
        status: str = await _run(self.policy, permit, budget, pool.execute(query, *args))
        return status

    # -- unknown commits ----------------------------------------------------------------------

    async def create_table(self) -> None:
        """Create the idempotency-key table if it is missing (`IdempotencyTable.ddl`)."""
        async with self._pool.acquire() as raw:
            await raw.execute(self.policy.table.ddl)

    async def reconcile(self, key: str, *, wait: float = 5.0) -> OutcomeState:
        """Whether the transaction keyed ``key`` committed: ``APPLIED``, ``NOT_APPLIED``, or
        ``PENDING`` when a transaction still holding the key did not finish within ``wait``
        seconds. Outside any request's admission (a reconciler's own work). A malformed key
        raises `IdempotencyKeyInvalid` (no transaction can have used it)."""
        IdempotencyTable.key(key)
        async with self._pool.acquire() as raw:
            inserted: bool | None
            try:
                async with raw.transaction():
                    found = await raw.fetchval(self.policy.table.probe, key, timeout=wait)
                    inserted = found is not None
                    raise _ProbeDone
            except _ProbeDone:
                pass
            except TimeoutError:
                inserted = None
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
        return f"BrownoutPool({self.policy!r})"


class _Acquire:
    """The admission, then a connection; released in the reverse order (a class rather than
    a generator: it is on every query's path)."""

    __slots__ = ("_conn", "_permit", "_policy", "_pool")

    def __init__(self, pool: asyncpg.Pool, policy: DatabasePolicy) -> None:
        self._pool = pool
        self._policy = policy
        self._conn: asyncpg.Connection | None = None
        self._permit: Permit | Untracked | None = None

    async def __aenter__(self) -> BrownoutConnection:
        policy = self._policy
        permit: Permit | Untracked
        admitted = policy.admit_now()
        if admitted is None:
            permit = await policy.admit().__aenter__()
            waited = True
        else:
            permit, budget = admitted
            waited = False
        try:
            pool = self._pool
            # asyncpg bounds an acquire with a task of its own: only worth it when a new
            # connection may have to be opened (an idle one is handed over at once).
            if pool.get_idle_size():
                budget = None
            elif waited:
                budget = policy.statement_budget()
            try:
                raw = await pool.acquire(timeout=budget)
            except TimeoutError as timed_out:
                raise policy.connect_timed_out(timed_out, budget)  # noqa: B904 (chained there)
        except BaseException as error:
            permit.settle_raised(type(error))
            raise
        self._permit = permit
        self._conn = raw
        return BrownoutConnection(raw, policy)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        permit, raw = self._permit, self._conn
        self._permit = self._conn = None
        assert permit is not None
        assert raw is not None
        try:
            await self._pool.release(raw)
        finally:
            if exc_type is None:
                permit.success()
            else:
                permit.settle_raised(exc_type)


async def _run(
    policy: DatabasePolicy,
    permit: Permit | Untracked | None,
    budget: float | None,
    work: Coroutine[Any, Any, T],
) -> T:
    """Await ``work`` (a statement, or the pool's shortcut: acquire, statement, release)
    within ``budget``, then settle ``permit`` (if any) by how it ended.

    At the budget the policy's watchdog cancels the task: asyncpg answers a cancellation with
    a cancel request to the server, and the pool's release waits for the query to stop. That
    cancellation (and asyncpg's own timeout, ``command_timeout``) is reported and raised as
    `DatabasePolicy` decides; anyone else's passes through, reported as cancelled."""
    started = policy.started()
    dog: LoopWatchdog | None = None
    task: asyncio.Task[Any] | None = None
    if budget is not None:
        task = asyncio.current_task()
        if task is not None:  # always, in a coroutine run by asyncio
            dog = policy.watchdog.watch(work, budget, _cancel_task, task)
    try:
        result = await work
    except asyncio.CancelledError:
        if dog is not None and task is not None and not dog.done(work) and task.uncancel() == 0:
            # The watchdog's cancellation and nobody else's: the statement hit its budget.
            stopped = policy.timed_out(TimeoutError(), budget, started)
            if permit is not None:
                permit.settle_raised(type(stopped))
            raise stopped from None
        if permit is not None:
            permit.settle_raised(asyncio.CancelledError)
        policy.cancelled(budget, started)
        raise
    except TimeoutError as error:
        if dog is not None:
            dog.done(work)
        stopped = policy.timed_out(error, budget, started)
        if permit is not None:
            permit.settle_raised(type(stopped))
        raise stopped from error
    except BaseException as error:
        if dog is not None:
            dog.done(work)
        if permit is not None:
            permit.settle_raised(type(error))
        raise
    if dog is not None and task is not None and not dog.done(work):
        task.uncancel()  # the watchdog's cancellation, absorbed on the way: taken back
    if permit is not None:
        permit.success()
    return result


def _cancel_task(task: asyncio.Task[Any]) -> None:
    task.cancel()


class _ProbeDone(Exception):
    """Leaves the probe's transaction by rolling it back (the probe writes nothing)."""


_ISOLATION = {
    "serializable": "SERIALIZABLE",
    "repeatable_read": "REPEATABLE READ",
    "read_committed": "READ COMMITTED",
}


def _isolation(level: str) -> str:
    try:
        return _ISOLATION[level]
    except KeyError:
        raise ValueError(f"isolation must be one of {sorted(_ISOLATION)}, not {level!r}") from None


async def _rollback(raw: asyncpg.Connection) -> None:
    """Roll back, shielded from a cancellation; a connection that cannot is closed (the
    pool's reset would otherwise meet a transaction in an unknown state)."""
    if raw.is_closed():
        return
    try:
        await asyncio.shield(raw.execute("ROLLBACK", timeout=5.0))
    except BaseException:  # the caller re-raises what made it roll back
        _close(raw)


def _close(raw: asyncpg.Connection) -> None:
    """Close ``raw`` at once (a connection lost under us is already detached from its pool)."""
    with contextlib.suppress(asyncpg.InterfaceError):
        if not raw.is_closed():
            raw.terminate()
