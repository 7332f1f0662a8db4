"""`IdempotencyTable`: the table that tells an applied transaction from one never applied.

A transaction run with an idempotency key writes the key's row first, in the same
transaction: the row exists exactly when the transaction committed. When the answer to its
``COMMIT`` is lost, a probe tells the two apart: insert the key again in a transaction that
is rolled back. The insert waits for a transaction still holding the key (its commit may
still be under way), then conflicts (applied) or goes in (not applied; rolled back, so a
retry may still use the key). A probe that cannot wait long enough leaves it pending.
"""

from __future__ import annotations

import re

from .._idempotency.model import MAX_KEY_LENGTH, IdempotencyKeyInvalid
from .._retry.idempotency import OutcomeState

__all__ = ["IdempotencyTable"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")


class IdempotencyTable:
    """The key table's name and the SQL a driver adapter runs against it (PostgreSQL).

    ``name`` is a plain or schema-qualified identifier (it is written into SQL, so anything
    else raises `ValueError`). Parameters are written as ``$1`` (asyncpg); `param_style`
    gives the text with ``%s`` for drivers that use it (psycopg).
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "brownout_idempotency") -> None:
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise ValueError(f"not a plain SQL identifier: {name!r}")
        self.name = name

    @property
    def ddl(self) -> str:
        """The table, created if missing (run once, at deploy or startup)."""
        return (
            f"CREATE TABLE IF NOT EXISTS {self.name} ("
            "key text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )

    @property
    def claim(self) -> str:
        """Written first in the keyed transaction: a second transaction with the same key
        waits for the first, then fails on the primary key if the first committed."""
        return f"INSERT INTO {self.name} (key) VALUES ($1)"

    @property
    def probe(self) -> str:
        """Run inside a transaction that is then rolled back: a row back means the key was
        never committed; no row, that it was."""
        return (
            f"INSERT INTO {self.name} (key) VALUES ($1) ON CONFLICT (key) DO NOTHING RETURNING key"
        )

    @staticmethod
    def key(key: object) -> str:
        """``key`` if it can be a row's key: a `str` of 1 to `MAX_KEY_LENGTH` characters
        without NUL (PostgreSQL's ``text`` cannot hold one); `IdempotencyKeyInvalid`
        otherwise, before any statement is sent (a driver would fail on it mid-transaction)."""
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH or "\x00" in key:
            shown = key[:40] + "..." if isinstance(key, str) and len(key) > 40 else key
            raise IdempotencyKeyInvalid(
                f"an idempotency key is a str of 1 to {MAX_KEY_LENGTH} characters without NUL,"
                f" not {shown!r}"
            )
        return key

    @staticmethod
    def outcome(inserted: bool | None) -> OutcomeState:
        """What a probe says: it inserted the key (not applied), hit the committed row
        (applied), or could not finish in time (``None``: still pending)."""
        if inserted is None:
            return OutcomeState.PENDING
        return OutcomeState.NOT_APPLIED if inserted else OutcomeState.APPLIED

    @staticmethod
    def param_style(sql: str) -> str:
        """``sql`` with ``$n`` parameters written as ``%s``."""
        return re.sub(r"\$\d+", "%s", sql)

    def __repr__(self) -> str:
        return f"IdempotencyTable({self.name!r})"
