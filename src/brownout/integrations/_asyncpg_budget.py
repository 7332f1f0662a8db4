"""An asyncpg connection class whose statements run under a `DatabasePolicy`'s budget: for
connections that SQLAlchemy's asyncpg dialect opens (it prepares every statement, then
fetches from the prepared statement, so the budget goes on the prepared statement's calls).
asyncpg sends the server a cancel request when a statement's ``timeout`` runs out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg

from .._database import DatabasePolicy

__all__ = ["budget_connection_class"]

# One class per (policy, base): policies live as long as their engines.
_CLASSES: dict[tuple[DatabasePolicy, type[Any]], type[asyncpg.Connection]] = {}


class _BudgetStatement:
    """A prepared statement whose ``fetch``, ``fetchrow``, ``fetchval`` and
    ``executemany`` take the policy's statement budget as their ``timeout``."""

    __slots__ = ("_policy", "_stmt")

    def __init__(self, stmt: Any, policy: DatabasePolicy) -> None:
        self._stmt = stmt
        self._policy = policy

    async def fetch(self, *args: Any, timeout: float | None = None) -> Any:  # noqa: ASYNC109 (asyncpg's signature)
        # `DatabasePolicy.statement`, inline: SQLAlchemy runs every query through here.
        policy = self._policy
        budget = policy.statement_budget()
        started = policy.started()
        try:
            return await self._stmt.fetch(*args, timeout=budget)
        except asyncio.CancelledError:
            policy.cancelled(budget, started)
            raise
        except TimeoutError as error:
            raise policy.timed_out(error, budget, started) from error

    async def fetchrow(self, *args: Any, timeout: float | None = None) -> Any:  # noqa: ASYNC109 (asyncpg's signature)
        stmt = self._stmt
        return await self._policy.statement(lambda budget: stmt.fetchrow(*args, timeout=budget))

    async def fetchval(self, *args: Any, column: int = 0, timeout: float | None = None) -> Any:  # noqa: ASYNC109 (asyncpg's signature)
        stmt = self._stmt
        return await self._policy.statement(
            lambda budget: stmt.fetchval(*args, column=column, timeout=budget)
        )

    async def executemany(
        self,
        args: Iterable[Sequence[Any]],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (asyncpg's signature)
    ) -> Any:
        stmt = self._stmt
        return await self._policy.statement(lambda budget: stmt.executemany(args, timeout=budget))

    def get_statusmsg(self) -> str:  # after every statement: no __getattr__ on the hot path
        return str(self._stmt.get_statusmsg())

    def get_attributes(self) -> Any:
        return self._stmt.get_attributes()

    def __getattr__(self, name: str) -> Any:  # the rest: attributes, status, cursors
        return getattr(self._stmt, name)


def budget_connection_class(
    policy: DatabasePolicy, base: type[asyncpg.Connection] | None = None
) -> type[asyncpg.Connection]:
    """A subclass of ``base`` (default ``asyncpg.Connection``) for ``connection_class=``."""
    connection = asyncpg.Connection if base is None else base
    made = _CLASSES.get((policy, connection))
    if made is not None:
        return made

    class BudgetConnection(connection):  # type: ignore[valid-type,misc]
        async def prepare(self, query: str, **kw: Any) -> Any:
            return _BudgetStatement(await connection.prepare(self, query, **kw), policy)

        async def executemany(
            self,
            command: str,
            args: Any,
            *,
            timeout: float | None = None,  # noqa: ASYNC109 (asyncpg's signature)
        ) -> Any:
            return await policy.statement(
                lambda budget: connection.executemany(self, command, args, timeout=budget)
            )

    _CLASSES[(policy, connection)] = BudgetConnection
    return BudgetConnection
