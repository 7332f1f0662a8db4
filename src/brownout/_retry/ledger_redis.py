"""`RedisOutcomeLedger`: the unknown-outcome ledger (D6) shared across processes on Redis.

Pass a ``redis.asyncio.Redis`` client; this module never imports redis itself, so the core
import path stays standard-library only. Layout (``prefix`` defaults to ``brownout``):

* ``{prefix}:outcome:{key}``: a hash (dependency, state, recorded_at, detail, checks and,
  once recorded again after a resolution, previous) that expires ``ttl`` seconds after it
  was (last) recorded, so the ledger is bounded in time;
* ``{prefix}:outcomes:pending``: a sorted set of pending keys by record time (oldest first);
  entries whose hash expired are dropped from it when `pending` meets them, and each write
  drops a few more from its head, so the set stays bounded without a reconciler.

Keys are stored as UTF-8 with ``surrogatepass``: any idempotency key (even one decoded from
invalid UTF-8 with ``surrogateescape``) round-trips exactly. Every call is bounded by
``timeout`` seconds and raises `TimeoutError` past it: a wedged Redis never hangs a caller.

Each write is one Lua script, so concurrent reconcilers and writers never see half a record.
``recorded_at`` is Unix time (a timestamp for humans; no duration is computed from it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .idempotency import OutcomeRecord, OutcomeState

__all__ = ["RedisOutcomeLedger"]

_RECORD = """
local earlier = redis.call('HGET', KEYS[1], 'state')
if earlier == 'pending' then return 0 end
-- a new key, or a resolved one that a later attempt made unknown again: pending (again)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'dependency', ARGV[1], 'state', 'pending', 'recorded_at', ARGV[2],
           'detail', ARGV[3], 'checks', 0)
if earlier then redis.call('HSET', KEYS[1], 'previous', earlier) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[4])
-- drop up to two expired records from the head of the index (bounded without a reconciler)
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, 1)) do
  if redis.call('EXISTS', ARGV[6] .. member) == 1 then break end
  redis.call('ZREM', KEYS[2], member)
end
return 1
"""

_RESOLVE = """
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
return 1
"""

_NOTE_CHECK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], 'checks', 1)
"""


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else str(value)


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class RedisOutcomeLedger:
    """An `OutcomeLedger` on Redis; entries expire ``ttl`` seconds after being recorded.

    Each call raises `TimeoutError` when Redis has not answered within ``timeout`` seconds.
    """

    __slots__ = ("_client", "_pending", "_prefix", "_wall", "timeout", "ttl")

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "brownout",
        ttl: float = 7 * 24 * 3600,
        wall: Callable[[], float] = time.time,
        timeout: float = 1.0,
    ) -> None:
        if ttl < 1:
            raise ValueError("ttl must be >= 1 second")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self._client = client
        self._prefix = prefix
        self._pending = f"{prefix}:outcomes:pending"
        self.ttl = int(ttl)
        self._wall = wall
        self.timeout = timeout

    def _key(self, key: str) -> bytes:
        return _bytes(f"{self._prefix}:outcome:{key}")

    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        async with asyncio.timeout(self.timeout):
            await self._client.eval(
                _RECORD,
                2,
                self._key(key),
                self._pending,
                dependency,
                repr(self._wall()),
                detail[:500],
                str(self.ttl),
                _bytes(key),
                _bytes(f"{self._prefix}:outcome:"),
            )

    async def resolve(self, key: str, state: OutcomeState) -> None:
        async with asyncio.timeout(self.timeout):
            await self._client.eval(
                _RESOLVE, 2, self._key(key), self._pending, state.value, _bytes(key)
            )

    async def note_check(self, key: str) -> None:
        async with asyncio.timeout(self.timeout):
            await self._client.eval(_NOTE_CHECK, 1, self._key(key))

    async def get(self, key: str) -> OutcomeRecord | None:
        async with asyncio.timeout(self.timeout):
            raw = await self._client.hgetall(self._key(key))
        return self._decode(key, raw)

    async def pending(self, limit: int = 100) -> list[OutcomeRecord]:
        if limit <= 0:
            return []
        async with asyncio.timeout(self.timeout):
            keys = await self._client.zrange(self._pending, 0, limit - 1)
        out: list[OutcomeRecord] = []
        gone: list[str] = []
        for raw_key in keys:
            key = _text(raw_key)
            record = await self.get(key)
            if record is None:
                gone.append(key)  # its hash expired
            elif record.state is OutcomeState.PENDING:
                out.append(record)
        if gone:
            async with asyncio.timeout(self.timeout):
                await self._client.zrem(self._pending, *map(_bytes, gone))
        return out

    def _decode(self, key: str, raw: dict[Any, Any]) -> OutcomeRecord | None:
        if not raw:
            return None
        fields = {_text(k): _text(v) for k, v in raw.items()}
        return OutcomeRecord(
            key=key,
            dependency=fields.get("dependency", ""),
            state=OutcomeState(fields.get("state", "pending")),
            recorded_at=float(fields.get("recorded_at", "0")),
            detail=fields.get("detail", ""),
            checks=int(fields.get("checks", "0")),
            previous=OutcomeState(fields["previous"]) if "previous" in fields else None,
        )

    def __repr__(self) -> str:
        return (
            f"RedisOutcomeLedger(prefix={self._prefix!r}, ttl={self.ttl}, timeout={self.timeout})"
        )
