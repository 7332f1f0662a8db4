"""`RedisIdempotencyStore`: keys, leases and answers shared by every instance, on Redis.

One round trip per decision: ``begin`` and ``complete`` are each one Lua script (``EVALSHA``,
falling back to ``EVAL`` when the server has not seen it). Each key is one hash,
``{prefix}{<store key>}``: the store key (a fixed-length digest of caller and key) is the hash
tag, so anything ever kept beside it lands in the same Redis Cluster slot, and each script
touches that one key (Cluster-safe). A running key holds ``state=running``, the fingerprint
and the lease token, and expires when its lease ends; a completed one holds the answer and
expires ``ttl`` after completion. Memory is bounded in time by those expiries (size it with
Redis's ``maxmemory``; use a ``volatile-*`` policy, as every key here has an expiry).

``redis`` is imported only when a store is built, so the core stays standard-library only.
Every call is bounded by ``timeout`` seconds; a failure or timeout raises
`IdempotencyStoreUnavailable`, and the layer's ``on_outage`` decides (fail closed: 503; open:
run without deduplication).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from typing import Any

from .model import Claim, ClaimState, IdempotencyStoreUnavailable, StoredResponse

__all__ = ["BEGIN_SCRIPT", "COMPLETE_SCRIPT", "RedisIdempotencyStore"]

BEGIN_SCRIPT = """
-- KEYS[1] = record; ARGV = fingerprint, token, lease_ms
local r = redis.call('HMGET', KEYS[1], 'state', 'fp', 'status', 'headers', 'body')
if not r[1] then
  redis.call('HSET', KEYS[1], 'state', 'running', 'fp', ARGV[1], 'token', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'run'}
end
if r[2] ~= ARGV[1] then return {'mismatch'} end
if r[1] == 'running' then return {'in_progress', redis.call('PTTL', KEYS[1])} end
return {'replay', r[3], r[4], r[5]}
"""

COMPLETE_SCRIPT = """
-- KEYS[1] = record; ARGV = token, ttl_ms, status, headers, body ('' token: release)
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[3], 'headers', ARGV[4],
           'body', ARGV[5])
redis.call('HDEL', KEYS[1], 'token')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_BEGIN_SHA = hashlib.sha1(BEGIN_SCRIPT.encode()).hexdigest()
_COMPLETE_SHA = hashlib.sha1(COMPLETE_SCRIPT.encode()).hexdigest()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisIdempotencyStore:
    """An `IdempotencyStore` on Redis (single node or Cluster), shared across processes.

    Pass a ``redis.asyncio.Redis`` (or ``RedisCluster``) client. ``prefix`` starts every key
    name; ``timeout`` (seconds) bounds every call. ``calls`` counts round trips.
    """

    __slots__ = ("_client", "_no_script", "_redis_errors", "calls", "prefix", "timeout")

    def __init__(self, client: Any, *, prefix: str = "brownout:idem:", timeout: float = 0.25):
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if "{" in prefix or "}" in prefix:
            raise ValueError(
                f"prefix must not hold a hash tag (the store adds its own): {prefix!r}"
            )
        # Imported here, not at module import: the core stays standard-library only.
        from redis.exceptions import NoScriptError, RedisError

        self._client = client
        self._no_script: type[Exception] = NoScriptError
        self._redis_errors: tuple[type[Exception], ...] = (RedisError, OSError)
        self.prefix = prefix
        self.timeout = timeout
        self.calls = 0

    def key_name(self, key: str) -> str:
        """The Redis key holding ``key`` (a store key): its hash tag is the whole store key."""
        return f"{self.prefix}{{{key}}}"

    async def _script(self, sha: str, script: str, *args: Any) -> Any:
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    return await self._client.evalsha(sha, 1, *args)
                except self._no_script:
                    return await self._client.eval(script, 1, *args)
        except TimeoutError as e:
            raise IdempotencyStoreUnavailable(
                f"redis did not answer within {self.timeout * 1000:.0f} ms"
            ) from e
        except self._redis_errors as e:
            raise IdempotencyStoreUnavailable(f"redis failed: {type(e).__name__}: {e}") from e

    async def begin(self, key: str, fingerprint: str, lease: float) -> Claim:
        token = secrets.token_hex(8)
        lease_ms = max(1, int(lease * 1000))
        reply = await self._script(
            _BEGIN_SHA, BEGIN_SCRIPT, self.key_name(key), fingerprint, token, lease_ms
        )
        state = _text(reply[0])
        if state == "run":
            return Claim(ClaimState.RUN, key, fingerprint, token=token)
        if state == "mismatch":
            return Claim(ClaimState.MISMATCH, key, fingerprint)
        if state == "in_progress":
            left = int(reply[1])
            return Claim(ClaimState.IN_PROGRESS, key, fingerprint, retry_after=max(left, 1) / 1000)
        raw_body = reply[3]
        response = StoredResponse(
            int(reply[1]),
            tuple((str(k), str(v)) for k, v in json.loads(_text(reply[2]))),
            raw_body if isinstance(raw_body, bytes) else str(raw_body).encode(),
        )
        return Claim(ClaimState.REPLAY, key, fingerprint, response=response)

    async def complete(self, claim: Claim, response: StoredResponse, ttl: float) -> bool:
        headers = json.dumps([list(h) for h in response.headers], separators=(",", ":"))
        ttl_ms = max(1, int(ttl * 1000))
        done = await self._script(
            _COMPLETE_SHA,
            COMPLETE_SCRIPT,
            self.key_name(claim.key),
            claim.token,
            ttl_ms,
            response.status,
            headers,
            response.body,
        )
        return bool(int(done))

    async def release(self, claim: Claim) -> None:
        await self._script(
            _COMPLETE_SHA, COMPLETE_SCRIPT, self.key_name(claim.key), claim.token, "", 0, "", b""
        )

    def abandon(self, claim: Claim) -> None:
        """Nothing to do: the key stays locked until its lease ends (its Redis expiry)."""

    def __repr__(self) -> str:
        return f"RedisIdempotencyStore(prefix={self.prefix!r}, timeout={self.timeout})"
