"""The Redis lease store: one fleet-wide concurrency limit shared by every instance (B3).

A limit's leases live in one sorted set, ``<tag>:leases`` (member: the fencing token; score:
the expiry in microseconds on the Redis server's clock, read with ``TIME`` inside the script,
so hosts' clocks do not matter), beside a counter ``<tag>:fence`` that only grows. ``<tag>`` is
`brownout._redis_keys.tagged` of ``prefix + name``, so both keys share a Cluster slot.

- acquire: ONE ``EVALSHA`` (purge expired leases, count, admit below the ceiling, ``INCR``
  the fence, add the lease); ``EVAL`` only when the server does not know the script yet;
- release: ONE ``ZREM``;
- renew: ONE ``EVALSHA`` that extends the lease only while it is unexpired.

A crashed holder's slot comes back when its lease expires: the next acquire purges it.
`BlockingRedisLeaseStore` sends the same commands with a blocking ``redis.Redis`` client
(threads). ``redis`` is imported only when a store is built.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from .._redis_keys import tagged
from .store import LeaseGrant, LeaseStoreUnavailable

__all__ = ["ACQUIRE_SCRIPT", "RENEW_SCRIPT", "BlockingRedisLeaseStore", "RedisLeaseStore"]

T = TypeVar("T")

ACQUIRE_SCRIPT = """
-- brownout fleet limit: KEYS = leases (zset), fence (counter); ARGV = ceiling, lease_us
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return {0, held, 0} end
local token = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), token)
return {1, held + 1, token}
"""

RENEW_SCRIPT = """
-- brownout fleet limit renew: KEYS = leases; ARGV = token, lease_us. 1: extended, 0: expired
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

_ACQUIRE_SHA = hashlib.sha1(ACQUIRE_SCRIPT.encode()).hexdigest()
_RENEW_SHA = hashlib.sha1(RENEW_SCRIPT.encode()).hexdigest()
_US = 1_000_000


class _AsyncRedis(Protocol):
    """The calls the store needs from a ``redis.asyncio`` client (a cluster client works)."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def zrem(self, name: str, *values: Any) -> Any: ...


def _key_names(prefix: str, name: str) -> tuple[str, str]:
    tag = tagged(prefix + name)
    return tag + ":leases", tag + ":fence"


def _lease_us(lease: float) -> int:
    return max(1, round(lease * _US))


def _grant(reply: Any) -> LeaseGrant:
    granted, held, token = (int(x) for x in reply)
    return LeaseGrant(bool(granted), token if granted else None, held)


class RedisLeaseStore:
    """Leases in Redis, shared by every instance that uses the same ``prefix`` and name.

    ``timeout`` (seconds) bounds every call, connection included; `FleetLimit` shortens it
    further to its share of the request's remaining deadline. Failures raise
    `LeaseStoreUnavailable`. ``calls`` counts round trips attempted (a dead Redis is not
    hammered), ``script_loads`` the times a script had to be sent with ``EVAL``.
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

    def __init__(self, client: _AsyncRedis, *, prefix: str = "bfl:", timeout: float = 0.05) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        # Imported here, not at module import: the core stays standard-library only.
        from redis.exceptions import NoScriptError, RedisError

        self._client = client
        self._no_script: type[Exception] = NoScriptError
        self._redis_errors: tuple[type[Exception], ...] = (RedisError, OSError)
        self.prefix = prefix
        self.timeout = timeout
        self.calls = 0
        self.script_loads = 0

    @property
    def client(self) -> _AsyncRedis:
        return self._client

    def key_names(self, name: str) -> tuple[str, str]:
        """The Redis keys of limit ``name``: its leases (a sorted set) and its fence counter."""
        return _key_names(self.prefix, name)

    async def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        args = (*self.key_names(name), ceiling, _lease_us(lease))
        reply = await self._bounded(
            budget, lambda: self._script(_ACQUIRE_SHA, ACQUIRE_SCRIPT, 2, args)
        )
        return _grant(reply)

    async def release(self, name: str, token: int, budget: float | None = None) -> None:
        leases = self.key_names(name)[0]
        await self._bounded(budget, lambda: self._client.zrem(leases, str(token)))

    async def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        args = (self.key_names(name)[0], str(token), _lease_us(lease))
        reply = await self._bounded(budget, lambda: self._script(_RENEW_SHA, RENEW_SCRIPT, 1, args))
        return int(reply) == 1

    async def _script(self, sha: str, script: str, numkeys: int, args: tuple[Any, ...]) -> Any:
        try:
            return await self._client.evalsha(sha, numkeys, *args)
        except self._no_script:
            self.script_loads += 1
            return await self._client.eval(script, numkeys, *args)

    async def _bounded(self, budget: float | None, call: Callable[[], Awaitable[T]]) -> T:
        budget = self.timeout if budget is None else min(budget, self.timeout)
        if budget <= 0:
            raise LeaseStoreUnavailable("no time left to ask Redis", timed_out=True)
        self.calls += 1
        try:
            async with asyncio.timeout(budget):
                return await call()
        except TimeoutError as e:
            raise LeaseStoreUnavailable(
                f"redis did not answer within {budget * 1000:.0f} ms", timed_out=True
            ) from e
        except self._redis_errors as e:
            raise LeaseStoreUnavailable(f"redis failed: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"RedisLeaseStore(prefix={self.prefix!r}, timeout={self.timeout!r})"


class _BlockingRedis(Protocol):
    """The calls the blocking store needs from a ``redis.Redis`` client."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def zrem(self, name: str, *values: Any) -> Any: ...

    def get_connection_kwargs(self) -> dict[str, Any]: ...

    def get_retry(self) -> Any: ...


class BlockingRedisLeaseStore:
    """`RedisLeaseStore` for threads: the same scripts and keys, with a blocking ``redis.Redis``.

    A blocking client cannot be interrupted, so its own socket timeouts bound each call: the
    client must be built with ``socket_timeout`` and ``socket_connect_timeout`` such that
    every attempt it makes (``retry``'s retries plus one) fits in ``timeout``, else
    `ValueError`: ``redis.Redis(socket_timeout=0.05, socket_connect_timeout=0.05,
    retry=Retry(NoBackoff(), 0))``. For the same reason a call is not cut shorter than that
    by the request's deadline. Failures raise `LeaseStoreUnavailable`.
    """

    __slots__ = (
        "_client",
        "_no_script",
        "_redis_errors",
        "_redis_timeout",
        "calls",
        "prefix",
        "script_loads",
        "timeout",
    )

    shared = True

    def __init__(
        self, client: _BlockingRedis, *, prefix: str = "bfl:", timeout: float = 0.05
    ) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        # Imported here, not at module import: the core stays standard-library only.
        from redis.exceptions import NoScriptError, RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        settings = client.get_connection_kwargs()
        read = settings.get("socket_timeout")
        connect = settings.get("socket_connect_timeout") or read
        if read is None or connect is None:
            raise ValueError(
                "the redis client needs socket_timeout= (seconds): a blocking call to the "
                "lease store must not wait without bound"
            )
        retry = client.get_retry()
        attempts = 1 + (retry.get_retries() if retry is not None else 0)
        if attempts * max(read, connect) > timeout:
            raise ValueError(
                f"the redis client may wait {attempts} x {max(read, connect)} s per call, over "
                f"timeout={timeout}: build it with socket_timeout= and socket_connect_timeout= "
                "at most the timeout, and retry=Retry(NoBackoff(), 0)"
            )
        self._client = client
        self._no_script: type[Exception] = NoScriptError
        self._redis_timeout: type[Exception] = RedisTimeout
        self._redis_errors: tuple[type[Exception], ...] = (RedisError, OSError)
        self.prefix = prefix
        self.timeout = timeout
        self.calls = 0
        self.script_loads = 0

    @property
    def client(self) -> _BlockingRedis:
        return self._client

    def key_names(self, name: str) -> tuple[str, str]:
        """The Redis keys of limit ``name``: its leases (a sorted set) and its fence counter."""
        return _key_names(self.prefix, name)

    def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        args = (*self.key_names(name), ceiling, _lease_us(lease))
        return _grant(self._call(lambda: self._script(_ACQUIRE_SHA, ACQUIRE_SCRIPT, 2, args)))

    def release(self, name: str, token: int, budget: float | None = None) -> None:
        leases = self.key_names(name)[0]
        self._call(lambda: self._client.zrem(leases, str(token)))

    def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        args = (self.key_names(name)[0], str(token), _lease_us(lease))
        return int(self._call(lambda: self._script(_RENEW_SHA, RENEW_SCRIPT, 1, args))) == 1

    def _script(self, sha: str, script: str, numkeys: int, args: tuple[Any, ...]) -> Any:
        try:
            return self._client.evalsha(sha, numkeys, *args)
        except self._no_script:
            self.script_loads += 1
            return self._client.eval(script, numkeys, *args)

    def _call(self, call: Callable[[], T]) -> T:
        self.calls += 1
        try:
            return call()
        except self._redis_timeout as e:
            raise LeaseStoreUnavailable(
                f"redis did not answer within {self.timeout * 1000:.0f} ms", timed_out=True
            ) from e
        except self._redis_errors as e:
            raise LeaseStoreUnavailable(f"redis failed: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"BlockingRedisLeaseStore(prefix={self.prefix!r}, timeout={self.timeout!r})"
