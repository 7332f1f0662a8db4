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
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
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

    # Each statement inline (no wrapper coroutine: this is every query's path); what a
    # stopped statement raises is the policy's decision (`DatabasePolicy.timed_out`).

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        policy = self._policy
        budget = policy.statement_budget()
        started = policy.started()
        try:
            rows: list[asyncpg.Record] = await self.raw.fetch(query, *args, timeout=budget)
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error
        return rows

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        policy = self._policy
        budget = policy.statement_budget()
        started = policy.started()
        try:
            row: asyncpg.Record | None = await self.raw.fetchrow(query, *args, timeout=budget)
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error
        return row

    async def fetchval(self, query: str, *args: Any, column: int = 0) -> Any:
        policy = self._policy
        budget = policy.statement_budget()
        started = policy.started()
        try:
            return await self.raw.fetchval(query, *args, column=column, timeout=budget)
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error

    async def execute(self, query: str, *args: Any) -> str:
        policy = self._policy
        budget = policy.statement_budget()
        started = policy.started()
        try:
            status: str = await self.raw.execute(query, *args, timeout=budget)
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error
        return status

    async def executemany(self, query: str, args: Iterable[Sequence[Any]]) -> None:
        raw = self.raw
        await self._policy.statement(lambda budget: raw.executemany(query, args, timeout=budget))

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
    # pool's own shortcut runs under the budget read at admission; otherwise the full path.

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """Acquire (admitted), run ``query`` under the statement budget, release."""
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetch(query, *args)
        permit, budget = admitted
        rows: list[asyncpg.Record] = await _admitted(
            self.policy, permit, budget, pool.fetch(query, *args, timeout=budget)
        )
        return rows

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetchrow(query, *args)
        permit, budget = admitted
        row: asyncpg.Record | None = await _admitted(
            self.policy, permit, budget, pool.fetchrow(query, *args, timeout=budget)
        )
        return row

    async def fetchval(self, query: str, *args: Any, column: int = 0) -> Any:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.fetchval(query, *args, column=column)
        permit, budget = admitted
        return await _admitted(
            self.policy,
            permit,
            budget,
            pool.fetchval(query, *args, column=column, timeout=budget),
        )

    async def execute(self, query: str, *args: Any) -> str:
        pool = self._pool
        admitted = self.policy.admit_now() if pool.get_idle_size() else None
        if admitted is None:
            async with self.acquire() as conn:
                return await conn.execute(query, *args)
        permit, budget = admitted
        status: str = await _admitted(
            self.policy, permit, budget, pool.execute(query, *args, timeout=budget)
        )
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


async def _admitted(
    policy: DatabasePolicy, permit: Permit | Untracked, budget: float | None, work: Awaitable[T]
) -> T:
    """Await ``work``, the pool's own shortcut (acquire, statement under ``budget``,
    release), then settle ``permit`` by how it ended; a stopped statement is reported and
    raised as `DatabasePolicy` decides (as `BrownoutConnection`'s statements are)."""
    started = policy.started()
    try:
        result = await work
    except asyncio.CancelledError:
        permit.settle_raised(asyncio.CancelledError)
        policy.cancelled(budget, started)
        raise
    except TimeoutError as error:
        stopped = policy.timed_out(error, budget, started)
        permit.settle_raised(type(stopped))
        raise stopped from error
    except BaseException as error:
        permit.settle_raised(type(error))
        raise
    permit.success()
    return result


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
