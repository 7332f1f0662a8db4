"""The Redis quota store: one GCRA state per key shared by every instance of a service (F1).

Each decision is ONE round trip: ``EVALSHA`` of a small Lua script that reads the key's TAT,
decides, writes the new TAT and sets its expiry, atomically on the server. The script falls
back to ``EVAL`` (which also caches it) when the server has not seen it yet (a restart, a
failover, ``SCRIPT FLUSH``).

A key's state lives under ``prefix + KEY_SEPARATOR + key`` as the string ``gcra:<TAT>``; the
script answers "not mine" (`QuotaKeyUnusable`) for any other value or type under that name and
leaves it untouched.

Time comes from the Redis server (``TIME`` inside the script), so instances whose clocks
disagree still share one consistent quota. Every key expires by itself (``PX``) at the moment
its bucket is full again, when it no longer carries any information.

``redis`` is imported only when a `RedisQuotaStore` is built, so ``import brownout`` stays
standard-library only. Pass any ``redis.asyncio.Redis`` client (a cluster client works too:
each script touches one key).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Protocol

from .gcra import MAX_TIME, GcraOutcome, GcraPolicy, invalid_cost, invalid_time
from .store import QuotaKeyUnusable, QuotaStoreUnavailable

__all__ = ["GCRA_SCRIPT", "KEY_SEPARATOR", "RedisQuotaStore"]

GCRA_SCRIPT = """
-- brownout GCRA: KEYS[1] = key; ARGV = interval_us, burst, cost, now_us ('' = server TIME)
-- A quota's value is the string 'gcra:<TAT>'. Anything else under the name belongs to someone
-- else: answer {-1} and leave it alone.
local kind = redis.call('TYPE', KEYS[1])['ok']
local tat = nil
if kind == 'string' then
  local raw = redis.call('GET', KEYS[1])
  if string.sub(raw, 1, 5) ~= 'gcra:' then return {-1} end
  tat = tonumber(string.sub(raw, 6))
  if tat == nil then return {-1} end
elseif kind ~= 'none' then
  return {-1}
end
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local tolerance = burst * interval
if tat == nil or tat < now then tat = now end
local new_tat = tat + cost * interval
local allow_at = tat + (cost - burst) * interval
-- float round-off slack: the same rule as brownout._quota.gcra.decide
local slack = interval * 1e-6 + math.abs(tat) * 2e-15
if allow_at - now > slack then
  local remaining = math.floor((now + tolerance - tat + slack / 2) / interval)
  if remaining < 0 then remaining = 0 end
  return {0, math.ceil(allow_at - now), remaining, math.ceil(tat - now),
          string.format('%.17g', tat)}
end
local ttl_ms = math.ceil((new_tat - now) / 1000)
if ttl_ms < 1 then ttl_ms = 1 end
redis.call('SET', KEYS[1], 'gcra:' .. string.format('%.17g', new_tat), 'PX', ttl_ms)
local remaining = math.floor((now + tolerance - new_tat + slack / 2) / interval)
if remaining < 0 then remaining = 0 end
return {1, 0, remaining, math.ceil(new_tat - now), string.format('%.17g', new_tat)}
"""
"""The server-side decision; mirrors `brownout._quota.gcra.decide`, in microseconds."""

_SCRIPT_SHA = hashlib.sha1(GCRA_SCRIPT.encode()).hexdigest()
_US = 1_000_000.0

KEY_SEPARATOR = "\x00"
"""Between the prefix and the key in a Redis key name. A prefix may not contain it, so the
first one ends the prefix: no two (prefix, key) pairs share a name, whatever the keys hold
(``api:`` with key ``admin:x`` and ``api:admin:`` with key ``x`` are two names)."""


class _AsyncRedis(Protocol):
    """The two calls the store needs from a ``redis.asyncio`` client."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any: ...


class RedisQuotaStore:
    """GCRA state in Redis, shared by every instance that uses the same ``prefix``.

    ``timeout`` (seconds) bounds every decision, connection included; `Quota` shortens it
    further to the request's remaining deadline. Failures raise `QuotaStoreUnavailable`.
    """

    __slots__ = (
        "_client",
        "_no_script",
        "_redis_errors",
        "calls",
        "prefix",
        "script_loads",
        "timeout",
    )

    shared = True

    def __init__(self, client: _AsyncRedis, *, prefix: str = "bq:", timeout: float = 0.05) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if KEY_SEPARATOR in prefix:
            raise ValueError(f"prefix must not contain {KEY_SEPARATOR!r}: {prefix!r}")
        # Imported here, not at module import: the core stays standard-library only.
        from redis.exceptions import NoScriptError, RedisError

        self._client = client
        self._no_script: type[Exception] = NoScriptError
        self._redis_errors: tuple[type[Exception], ...] = (RedisError, OSError)
        self.prefix = prefix
        self.timeout = timeout
        self.calls = 0
        """Decisions attempted against Redis (to check that a dead Redis is not hammered)."""
        self.script_loads = 0
        """Times the script had to be sent with EVAL because the server did not know it."""

    @property
    def client(self) -> _AsyncRedis:
        return self._client

    def key_name(self, key: str) -> bytes:
        """The Redis key name holding ``key``'s state: ``prefix``, `KEY_SEPARATOR`, ``key``, in
        UTF-8 with ``surrogatepass``.

        Bytes, not str: a caller id need not be valid UTF-8 (aiohttp decodes header bytes with
        ``surrogateescape``), and the client's strict encoder would raise into the request.
        ``surrogatepass`` is one-to-one, so no two keys share a bucket.
        """
        return (self.prefix + KEY_SEPARATOR + key).encode("utf-8", "surrogatepass")

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        """Decide one request on the server's clock, in one round trip, within the timeout."""
        return await self._run(key, policy, cost, budget, None)

    async def decide_at(
        self, key: str, policy: GcraPolicy, cost: int, now: float, budget: float | None = None
    ) -> GcraOutcome:
        """Decide at an explicit ``now`` (seconds) instead of the server's clock.

        For tests that check the script against `brownout._quota.gcra.decide` step by step;
        production code uses `decide`. ``now`` is checked as `brownout._quota.gcra.decide`
        checks it (the script would fail on it as a store error, or overflow).
        """
        return await self._run(key, policy, cost, budget, now)

    async def _run(
        self, key: str, policy: GcraPolicy, cost: int, budget: float | None, now: float | None
    ) -> GcraOutcome:
        # The same check and error as the pure GCRA: a NaN cost must not reach the script,
        # whose error would read as a store failure and switch every key to the fallback.
        if not 1 <= cost <= policy.burst:
            raise invalid_cost(cost, policy.burst)
        if now is None:
            now_us = ""  # the script reads the server's TIME
        elif -MAX_TIME <= now <= MAX_TIME:
            now_us = repr(now * _US)
        else:
            raise invalid_time(now)
        budget = self.timeout if budget is None else min(budget, self.timeout)
        if budget <= 0:
            raise QuotaStoreUnavailable("no time left to ask Redis", timed_out=True)
        name = self.key_name(key)
        args = (name, repr(policy.interval * _US), policy.burst, cost, now_us)
        self.calls += 1
        try:
            async with asyncio.timeout(budget):
                try:
                    reply = await self._client.evalsha(_SCRIPT_SHA, 1, *args)
                except self._no_script:
                    self.script_loads += 1
                    reply = await self._client.eval(GCRA_SCRIPT, 1, *args)
        except TimeoutError as e:
            raise QuotaStoreUnavailable(
                f"redis did not answer within {budget * 1000:.0f} ms", timed_out=True
            ) from e
        except self._redis_errors as e:
            if str(e).startswith("WRONGTYPE"):
                raise QuotaKeyUnusable(f"redis key {args[0]!r} is not a quota: {e}") from e
            raise QuotaStoreUnavailable(f"redis failed: {type(e).__name__}: {e}") from e
        if int(reply[0]) < 0:
            raise QuotaKeyUnusable(f"redis key {name!r} holds a value that is not a quota")
        allowed, retry_us, remaining, reset_us, tat = reply
        return GcraOutcome(
            allowed=bool(allowed),
            tat=float(tat) / _US,
            retry_after=int(retry_us) / _US,
            remaining=int(remaining),
            reset=max(0.0, int(reset_us) / _US),
        )

    def __repr__(self) -> str:
        return f"RedisQuotaStore(prefix={self.prefix!r}, timeout={self.timeout!r})"
