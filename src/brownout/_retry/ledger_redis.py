"""`RedisOutcomeLedger`: the unknown-outcome ledger (D6) shared across processes on Redis.

Pass a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster`` client; this module never
imports redis itself, so the core import path stays standard-library only. Every key starts
with the prefix as a Redis Cluster hash tag (``{brownout}`` by default; a prefix that already
has a hash tag, such as ``app:{ledger}``, is used as given), so every key of one ledger lives
in one slot and each script may touch all of them. Layout (``{prefix}`` below is that tag):

* ``{prefix}:outcome:{key}``: a hash (dependency, state, recorded_at, detail, checks and,
  once recorded again after a resolution, previous) that expires ``ttl`` seconds after it
  was (last) recorded, so the ledger is bounded in time;
* ``{prefix}:outcomes:pending`` and ``{prefix}:outcomes:resolved``: sorted sets of the
  pending and the resolved keys by record time (oldest first); entries whose hash expired
  are dropped from them when `pending` meets them, and each write drops a few more from
  their heads, so they stay bounded without a reconciler.

At most ``max_entries`` records: a new key at the bound evicts the oldest resolved record;
pending records are never evicted, and a new key they leave no room for is refused with
`OutcomeLedgerFull`. Scripts touch the record, both indexes and evicted records: the hash
tag is what lets them run on Redis Cluster.

Keys are stored as UTF-8 with ``surrogatepass``: any idempotency key (even one decoded from
invalid UTF-8 with ``surrogateescape``) round-trips exactly. Every call is bounded by
``timeout`` seconds and raises `TimeoutError` past it: a wedged Redis never hangs a caller.

Each write is one Lua script, so concurrent reconcilers and writers never see half a record.
``recorded_at`` is Unix time (a timestamp for humans; no duration is computed from it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from .._redis_keys import tagged
from .idempotency import OutcomeLedgerFull, OutcomeRecord, OutcomeState

__all__ = ["RedisOutcomeLedger"]

_RECORD = """
local earlier = redis.call('HGET', KEYS[1], 'state')
if earlier == 'pending' then
  -- the first record stands, but the new attempt is unchecked: its checks start again
  redis.call('HSET', KEYS[1], 'checks', 0)
  return {0, 0}
end
-- drop up to two expired records from the head of each index (bounded without a reconciler)
for _, index in ipairs({KEYS[2], KEYS[3]}) do
  for _, member in ipairs(redis.call('ZRANGE', index, 0, 1)) do
    if redis.call('EXISTS', ARGV[6] .. member) == 1 then break end
    redis.call('ZREM', index, member)
  end
end
local evicted = 0
if earlier then
  redis.call('ZREM', KEYS[3], ARGV[5])  -- resolved, recorded again: pending, no new entry
else
  redis.call('ZREM', KEYS[2], ARGV[5])  -- rows left by an expired record of this key
  redis.call('ZREM', KEYS[3], ARGV[5])
  local room = tonumber(ARGV[7]) - redis.call('ZCARD', KEYS[2]) - redis.call('ZCARD', KEYS[3])
  -- at the bound the oldest resolved records go (at most 16 a write, so a lowered bound
  -- shrinks the ledger over a few writes without stalling Redis)
  while room < 1 and evicted < 16 do
    local oldest = redis.call('ZPOPMIN', KEYS[3])
    if #oldest == 0 then break end
    redis.call('DEL', ARGV[6] .. oldest[1])
    evicted = evicted + 1
    room = room + 1
  end
  if room < 1 and redis.call('ZCARD', KEYS[3]) == 0 then
    -- pending records alone fill it: expired ones near the head make room, else refuse
    for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, 15)) do
      if redis.call('EXISTS', ARGV[6] .. member) == 0 then
        redis.call('ZREM', KEYS[2], member)
        room = room + 1
      end
    end
    if room < 1 then return {-1, redis.call('ZCARD', KEYS[2])} end
  end
end
-- a new key, or a resolved one that a later attempt made unknown again: pending (again)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'dependency', ARGV[1], 'state', 'pending', 'recorded_at', ARGV[2],
           'detail', ARGV[3], 'checks', 0)
if earlier then redis.call('HSET', KEYS[1], 'previous', earlier) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
-- (never shortened: a ledger with a shorter ttl on the same prefix must not expire the
-- index under longer-lived records)
if redis.call('TTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return {1, evicted}
"""

_RESOLVE = """
local at = redis.call('HGET', KEYS[1], 'recorded_at')
if not at then
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
-- each record is in the index of its state, by the time it was recorded
local into, out = KEYS[3], KEYS[2]
if ARGV[1] == 'pending' then into, out = KEYS[2], KEYS[3] end
redis.call('ZREM', out, ARGV[2])
redis.call('ZADD', into, at, ARGV[2])
if redis.call('TTL', into) < tonumber(ARGV[3]) then redis.call('EXPIRE', into, ARGV[3]) end
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

    At most ``max_entries`` records (shared by every process on the same ``prefix``): a new
    key at the bound evicts the oldest resolved record; when pending records alone fill it,
    the new one is refused with `OutcomeLedgerFull` (counted in ``refused``), never dropped.
    Each call raises `TimeoutError` when Redis has not answered within ``timeout`` seconds.
    """

    __slots__ = (
        "_client",
        "_pending",
        "_prefix",
        "_resolved",
        "_wall",
        "evicted",
        "max_entries",
        "name",
        "refused",
        "timeout",
        "ttl",
    )

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "brownout",
        ttl: float = 7 * 24 * 3600,
        max_entries: int = 100_000,
        wall: Callable[[], float] = time.time,
        timeout: float = 1.0,
        name: str | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError("ttl must be >= 1 second")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if not 1 <= max_entries < math.inf:  # (NaN too: Redis stays bounded)
            raise ValueError("max_entries must be >= 1")
        self._client = client
        self._prefix = prefix = tagged(prefix)  # one slot for every key (Redis Cluster)
        self.name = name if name is not None else prefix
        """What events and metrics call this ledger (default: its tagged prefix)."""
        self._pending = _bytes(f"{prefix}:outcomes:pending")
        self._resolved = _bytes(f"{prefix}:outcomes:resolved")
        self.ttl = int(ttl)
        self.max_entries = int(max_entries)
        self._wall = wall
        self.timeout = timeout
        self.evicted = 0
        """Resolved records this process evicted to stay within ``max_entries``."""
        self.refused = 0
        """Unknown outcomes this process could not record: pending records filled the
        ledger (each raised `OutcomeLedgerFull`). Alarm on it growing."""

    def _key(self, key: str) -> bytes:
        return _bytes(f"{self._prefix}:outcome:{key}")

    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        """Record an unknown outcome (see `OutcomeLedger.record_unknown`).

        Raises `OutcomeLedgerFull` when pending records alone fill ``max_entries``.
        """
        async with asyncio.timeout(self.timeout):
            status, count = await self._client.eval(
                _RECORD,
                3,
                self._key(key),
                self._pending,
                self._resolved,
                dependency,
                repr(self._wall()),
                detail[:500],
                str(self.ttl),
                _bytes(key),
                _bytes(f"{self._prefix}:outcome:"),
                str(self.max_entries),
            )
        if int(status) < 0:
            self.refused += 1
            raise OutcomeLedgerFull(key, pending=int(count), max_entries=self.max_entries)
        self.evicted += int(count)

    async def resolve(self, key: str, state: OutcomeState) -> None:
        async with asyncio.timeout(self.timeout):
            await self._client.eval(
                _RESOLVE,
                3,
                self._key(key),
                self._pending,
                self._resolved,
                state.value,
                _bytes(key),
                str(self.ttl),
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
            f"RedisOutcomeLedger(prefix={self._prefix!r}, ttl={self.ttl}, "
            f"max_entries={self.max_entries}, timeout={self.timeout})"
        )
