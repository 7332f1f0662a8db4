"""`PostgresIdempotencyStore`: the key and the handler's effect in one transaction.

The exactly-once pattern against a database. ``begin`` opens a transaction on a connection
from the pool and takes a transaction-scoped advisory lock on the key
(``pg_try_advisory_xact_lock``, which never waits: a key held by a running request answers
409 at once). With the lock held it reads the stored answer, if any (replay or 422). Otherwise
the handler runs, and writes its effect through that same transaction (`Claim.connection`,
``brownout.idempotency.transaction()`` in a handler); ``complete`` writes the answer in the
same transaction and commits. The effect and the answer become visible together, or neither:

- a handler that raises or is cancelled (deadline, disconnect) rolls back: no effect, no key,
  and the next attempt runs at once (no lease to wait out, unlike Redis and memory);
- a process that dies mid-request drops its connection: PostgreSQL rolls back the same way;
- a commit whose answer is lost on the way back was applied: the retry gets the stored answer.

The pool is an ``asyncpg.Pool`` (imported nowhere in the core: the pool is passed in).
Call `setup` once to create the table. Completed rows expire ``ttl`` after completion (read
as absent from then on; each completion deletes up to 16 expired rows, so the table stays
bounded without a cron job). Every call is bounded by ``timeout``; a failure raises
`IdempotencyStoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from .model import Claim, ClaimState, IdempotencyStoreUnavailable, StoredResponse

__all__ = ["PostgresIdempotencyStore"]

_log = logging.getLogger("brownout.idempotency")

_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class _Open:
    """A running claim's connection and its open transaction."""

    __slots__ = ("connection", "transaction")

    def __init__(self, connection: Any, transaction: Any) -> None:
        self.connection = connection
        self.transaction = transaction


class PostgresIdempotencyStore:
    """An `IdempotencyStore` whose answers commit with the handler's own writes.

    ``pool``: an ``asyncpg.Pool``; ``table``: the table's name (created by `setup`);
    ``timeout`` (seconds) bounds each call; ``in_progress_retry_after``: the ``Retry-After``
    of a 409 (a lock has no lease to count down).
    """

    __slots__ = ("_pool", "_tasks", "in_progress_retry_after", "table", "timeout")

    transactional = True
    """The handler's writes commit with the answer: a failed commit is answered 503."""

    def __init__(
        self,
        pool: Any,
        *,
        table: str = "brownout_idempotency",
        timeout: float = 1.0,
        in_progress_retry_after: float = 1.0,
    ) -> None:
        if not _TABLE_NAME.fullmatch(table):
            raise ValueError(f"table must be a plain SQL identifier: {table!r}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self._pool = pool
        self.table = table
        self.timeout = timeout
        self.in_progress_retry_after = in_progress_retry_after
        self._tasks: set[asyncio.Task[None]] = set()

    async def setup(self) -> None:
        """Create the table if it does not exist."""
        async with asyncio.timeout(self.timeout * 5):
            await self._pool.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} ("
                " key text PRIMARY KEY, fingerprint text NOT NULL, status integer NOT NULL,"
                " headers text NOT NULL, body bytea NOT NULL, expires_at timestamptz NOT NULL)"
            )

    async def begin(self, key: str, fingerprint: str, lease: float) -> Claim:
        try:
            async with asyncio.timeout(self.timeout):
                connection = await self._pool.acquire()
        except Exception as e:
            raise IdempotencyStoreUnavailable(f"postgres: no connection: {e!r}") from e
        held = False
        try:
            async with asyncio.timeout(self.timeout):
                transaction = connection.transaction()
                await transaction.start()
                got = await connection.fetchval(
                    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", key
                )
                if not got:
                    await transaction.rollback()
                    return Claim(
                        ClaimState.IN_PROGRESS,
                        key,
                        fingerprint,
                        retry_after=self.in_progress_retry_after,
                    )
                row = await connection.fetchrow(
                    f"SELECT fingerprint, status, headers, body FROM {self.table}"
                    " WHERE key = $1 AND expires_at > now()",
                    key,
                )
                if row is not None:
                    await transaction.rollback()
                    if row["fingerprint"] != fingerprint:
                        return Claim(ClaimState.MISMATCH, key, fingerprint)
                    response = StoredResponse(
                        int(row["status"]),
                        tuple((str(k), str(v)) for k, v in json.loads(row["headers"])),
                        bytes(row["body"]),
                    )
                    return Claim(ClaimState.REPLAY, key, fingerprint, response=response)
            held = True
            return Claim(
                ClaimState.RUN,
                key,
                fingerprint,
                connection=connection,
                handle=_Open(connection, transaction),
            )
        except Exception as e:
            raise IdempotencyStoreUnavailable(f"postgres failed: {e!r}") from e
        finally:
            if not held:
                await self._release_connection(connection)

    async def _release_connection(self, connection: Any) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self._pool.release(connection)
        except Exception:  # a broken connection: the pool replaces it
            _log.warning("postgres idempotency: could not release a connection", exc_info=True)
            connection.terminate()

    async def complete(self, claim: Claim, response: StoredResponse, ttl: float) -> bool:
        held: _Open = claim.handle
        headers = json.dumps([list(h) for h in response.headers], separators=(",", ":"))
        connection = held.connection
        try:
            async with asyncio.timeout(self.timeout):
                await connection.execute(
                    f"INSERT INTO {self.table} AS t"
                    " (key, fingerprint, status, headers, body, expires_at)"
                    " VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))"
                    " ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,"
                    " status = EXCLUDED.status, headers = EXCLUDED.headers,"
                    " body = EXCLUDED.body, expires_at = EXCLUDED.expires_at",
                    claim.key,
                    claim.fingerprint,
                    response.status,
                    headers,
                    response.body,
                    float(ttl),
                )
                await connection.execute(
                    f"DELETE FROM {self.table} WHERE key IN (SELECT key FROM {self.table}"
                    " WHERE expires_at < now() LIMIT 16)"
                )
                await held.transaction.commit()
        except Exception as e:
            await self._rollback(held)
            raise IdempotencyStoreUnavailable(f"postgres commit failed: {e!r}") from e
        finally:
            claim.connection = claim.handle = None
        await self._release_connection(connection)
        return True

    async def _rollback(self, held: _Open) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await held.transaction.rollback()
        except Exception:  # closing the connection rolls back on the server
            held.connection.terminate()
        await self._release_connection(held.connection)

    async def release(self, claim: Claim) -> None:
        held: _Open | None = claim.handle
        claim.connection = claim.handle = None
        if held is not None:
            await self._rollback(held)

    def abandon(self, claim: Claim) -> None:
        """Roll the effect back (in a task: the caller was cancelled); the key is free."""
        held: _Open | None = claim.handle
        claim.connection = claim.handle = None
        if held is None:
            return
        task = asyncio.get_running_loop().create_task(self._rollback(held))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __repr__(self) -> str:
        return f"PostgresIdempotencyStore(table={self.table!r}, timeout={self.timeout})"
