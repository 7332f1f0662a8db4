"""Durable queues on Redis Streams with consumer groups (redis-py asyncio), issue 26.

::

    producer = Producer(redis, "orders", group="workers", bound=BacklogBound(max_depth=10_000))
    await producer.publish(b"...", headers={"tenant": "acme"})

    consumer = Consumer(redis, "orders", "workers", handle, policy=MessagePolicy(max_age=60))
    await consumer.run()  # until `await consumer.stop()`

This module only translates between Redis and the broker-independent core
(`brownout.durable.Publisher` and `brownout.durable.MessageRunner`), which decide.

Keys. ``stream_keys("orders")`` gives the stream ``{orders}``, its retry set
``{orders}:retry`` (a sorted set of delayed copies by due time) and its parked stream
``{orders}:parked``: the hash tag keeps the three in one Redis Cluster slot, so each script
touches one slot. A name that already has a hash tag (``"app:{orders}"``) is used as given.

Entries. A message is one stream entry: the body under the field ``body``, the envelope
fields (`brownout.durable.ENVELOPE_FIELDS`) and the user's headers as text fields.

Acknowledging. ``XACK`` and, with ``delete_on_ack=True`` (default), ``XDEL`` in one
script: the stream holds only work not yet done, so its memory is its backlog's. A
stream read by several groups (fan-out) needs ``delete_on_ack=False`` and its own trimming
(``XTRIM MINID`` below the slowest group's last delivered id).

Retries and parking are Lua scripts, each atomic: the delayed copy is stored in the retry set
and the original acknowledged in one step; a mover task in each consumer puts due copies
back into the stream (``XADD`` + ``ZREM`` in one step); a parked copy is added to the parked
stream and the original acknowledged in one step. A crash between two steps cannot lose a
message or duplicate it; a script that finds the entry already acknowledged (another
consumer claimed and settled it) stores nothing.

Clocks. Due times of retries and the backlog's oldest age use the Redis server's clock only
(stream entry ids are milliseconds of that clock; ages are measured against ``TIME``), so
hosts' clocks do not matter for them. The envelope's times are wall clock (see
`brownout.durable.MessagePolicy` ``max_skew``).

Failures. Every Redis call is bounded by ``timeout`` seconds (a stalled Redis never hangs a
caller). A producer raises `StreamUnavailable` when Redis fails or is unreachable, and
`brownout.UnknownOutcome` (with the message's idempotency key) when an ``XADD`` was sent
and not answered in time. A consumer logs a Redis failure, backs off (at most 5 s) and
carries on; entries it held stay pending and are claimed again (``XAUTOCLAIM``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

try:
    from redis.exceptions import NoScriptError, RedisError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "redis", e) from e

from .._admission import Bulkhead
from .._clock import Clock
from .._durable import (
    ENVELOPE_FIELDS,
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    PARKED_FIELDS,
    BacklogBound,
    Envelope,
    MessageHandler,
    MessagePolicy,
    MessageRunner,
    ParkedMessage,
    Publisher,
)
from .._durable.envelope import KEY_FIELD
from .._errors import BrownoutError, UnknownOutcome
from .._priority import Priority
from .._redis_keys import tagged
from ..events import EventHub, hub

__all__ = [
    "BODY_FIELD",
    "ORIGINAL_ID_FIELD",
    "Consumer",
    "ParkedStream",
    "Producer",
    "StreamEntry",
    "StreamKeys",
    "StreamUnavailable",
    "stream_keys",
]

_log = logging.getLogger("brownout.queue")
T = TypeVar("T")

BODY_FIELD = "body"
"""The entry field holding a message's body."""
ORIGINAL_ID_FIELD = "brownout-original-id"
"""On a parked copy: the id the entry had in the stream."""
_RESERVED = frozenset({BODY_FIELD, ORIGINAL_ID_FIELD, *ENVELOPE_FIELDS, *PARKED_FIELDS})
_ENVELOPE_KEYS = frozenset(f.encode() for f in ENVELOPE_FIELDS)
_PARKED_KEYS = frozenset(f.encode() for f in (*PARKED_FIELDS, ORIGINAL_ID_FIELD))
_BODY = BODY_FIELD.encode()
_ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")
_MAX_BACKOFF = 5.0
_PAGE = 200


class StreamUnavailable(BrownoutError, ConnectionError):
    """Redis failed, refused, or did not answer within the timeout."""

    def __init__(self, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """The Redis keys of one queue, all in one Cluster slot (one hash tag)."""

    stream: str
    retry: str
    """Sorted set of delayed copies, scored by due time (ms of the server's clock)."""
    parked: str


def stream_keys(name: str) -> StreamKeys:
    """The keys of the queue ``name``: ``{name}``, ``{name}:retry``, ``{name}:parked``, or
    ``name`` itself as the stream when it already carries a hash tag."""
    if not isinstance(name, str) or not name:
        raise ValueError("a stream name must be a non-empty string")
    stream = tagged(name)
    return StreamKeys(stream, stream + ":retry", stream + ":parked")


# -- scripts ----------------------------------------------------------------------------------

_ACK = """
-- KEYS: stream. ARGV: group, delete ('1'), ids... (one command for a batch of entries)
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], unpack(ARGV, 3)) end
return acked
"""

_RETRY = """
-- KEYS: stream, retry set. ARGV: group, id, delay ms, delete ('1'), fields...
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], ARGV[2]) end
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
local copy = {ARGV[2]}
for i = 5, #ARGV do copy[#copy + 1] = ARGV[i] end
redis.call('ZADD', KEYS[2], due, cmsgpack.pack(copy))
return 1
"""

_PARK = """
-- KEYS: stream, parked stream. ARGV: group, id, delete ('1'), maxlen ('' = none), fields...
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] == '1' then redis.call('XDEL', KEYS[1], ARGV[2]) end
if ARGV[4] == '' then
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
end
return 1
"""

_MOVE = """
-- KEYS: stream, retry set, parked stream. ARGV: most copies to move.
-- Returns {moved, ms until the next copy is due (-1: none)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, member in ipairs(due) do
  local ok, copy = pcall(cmsgpack.unpack, member)
  if ok and type(copy) == 'table' and #copy >= 3 and #copy % 2 == 1 then
    redis.call('XADD', KEYS[1], '*', unpack(copy, 2))
  else
    -- not a copy this script stored: park it rather than fail every move after it
    redis.call('XADD', KEYS[3], '*', 'body', member, 'brownout-park-reason', 'malformed',
               'brownout-park-detail', 'unreadable retry-set member')
  end
  redis.call('ZREM', KEYS[2], member)
end
local following = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #following == 0 then return {#due, -1} end
return {#due, math.max(0, tonumber(following[2]) - now)}
"""

_REPLAY = """
-- KEYS: parked stream, stream. ARGV: parked id, fields...
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], ARGV[1])
return 1
"""


_DELAYED_AND_TIME = """
return {redis.call('ZCARD', KEYS[1]), redis.call('TIME')}
"""


class _Script:
    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restart or SCRIPT FLUSH: EVAL sends and caches it
            return await client.eval(self.text, len(keys), *keys, *args)


_ACK_SCRIPT = _Script(_ACK)
_RETRY_SCRIPT = _Script(_RETRY)
_PARK_SCRIPT = _Script(_PARK)
_MOVE_SCRIPT = _Script(_MOVE)
_REPLAY_SCRIPT = _Script(_REPLAY)


async def _bounded(call: Awaitable[T], within: float, what: str) -> T:
    """``call`` within ``within`` s; Redis's failures as `StreamUnavailable`."""
    try:
        async with asyncio.timeout(within):
            return await call
    except (TimeoutError, RedisTimeoutError) as e:
        raise StreamUnavailable(
            f"redis did not answer {what} within {within:g} s", timed_out=True
        ) from e
    except (RedisError, OSError) as e:
        raise StreamUnavailable(f"redis failed {what}: {type(e).__name__}: {e}") from e


def _check_client(client: Any) -> None:
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if isinstance(kwargs, dict) and kwargs.get("decode_responses"):
        raise ValueError("pass a redis client with decode_responses=False: bodies are bytes")


def _check_timeout(timeout: float) -> None:
    if not 0 < timeout < math.inf:
        raise ValueError("timeout must be positive and finite")


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def _raw(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return str(value).encode("utf-8", "surrogateescape")


def _entry_ms(entry_id: Any) -> int | None:
    text = _text(entry_id)
    head = text.split("-", 1)[0]
    return int(head) if head.isdigit() else None


async def _ensure_group(client: Any, keys: StreamKeys, group: str, within: float) -> None:
    """Create ``group`` from the start of the stream (``0``: entries added before the first
    consumer are delivered too), and the stream with it; an existing group is kept."""
    try:
        await _bounded(
            client.xgroup_create(keys.stream, group, id="0", mkstream=True),
            within,
            "XGROUP CREATE",
        )
    except StreamUnavailable as e:
        cause = e.__cause__
        if isinstance(cause, ResponseError) and "BUSYGROUP" in str(cause):
            return
        raise


# -- the producer -----------------------------------------------------------------------------


class Producer:
    """Publishes to a stream through `brownout.durable.Publisher`: stamps the envelope from
    the current request, refuses (`brownout.Rejected`, ``backlog_full``) while the queue is
    over ``bound``, then ``XADD``.

    The backlog is read for consumer ``group`` (needed with a ``bound``; created if missing)
    at most once per ``refresh`` s: depth is the entries not yet delivered to the group
    (``XINFO GROUPS`` lag), plus those delivered and not acknowledged (pending), plus delayed
    retries; the oldest age is that of the oldest undelivered or pending entry, by the Redis
    server's clock (entry ids are its milliseconds; a retried copy's age counts from when it
    was put back).
    """

    def __init__(
        self,
        redis: Any,
        stream: str,
        *,
        bound: BacklogBound | None = None,
        group: str | None = None,
        ttl: float | None = None,
        refresh: float = 1.0,
        timeout: float = 1.0,
        events: EventHub = hub,
        wall: Any = time.time,
        clock: Clock | None = None,
    ) -> None:
        if bound is not None and group is None:
            raise ValueError("a bound needs group=, the consumer group whose backlog it bounds")
        if ttl is not None and not 0 < ttl < math.inf:
            raise ValueError("ttl must be None or positive and finite")
        _check_timeout(timeout)
        _check_client(redis)
        self.redis = redis
        self.keys = stream_keys(stream)
        self.group = group
        self.timeout = timeout
        self._group_ready = False
        self.publisher = Publisher(
            stream,
            self._send,
            bound=bound,
            measure=self.measure if group is not None else None,
            refresh=refresh,
            ttl=ttl,
            events=events,
            wall=wall,
            clock=clock,
        )

    async def publish(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        idempotency_key: str | None = None,
        operation: str | None = None,
        priority: Priority | None = None,
    ) -> Envelope:
        """``XADD`` ``body`` with its envelope and ``headers``; returns the envelope.

        Raises `brownout.Rejected` (``backlog_full``) over the bound, `StreamUnavailable`
        when Redis fails, `brownout.UnknownOutcome` when the ``XADD`` was not answered in
        time (it may be in the stream), and `ValueError` for a header name brownout uses.
        """
        if not isinstance(body, bytes | bytearray):
            raise TypeError(f"body must be bytes, not {type(body).__name__}")
        for name in headers or ():
            if name in _RESERVED:
                raise ValueError(f"header {name!r} is brownout's own field")
        return await self.publisher.publish(
            bytes(body),
            headers=headers,
            ttl=ttl,
            idempotency_key=idempotency_key,
            operation=operation,
            priority=priority,
        )

    async def _send(self, body: bytes, headers: dict[str, str]) -> None:
        fields: dict[str, Any] = {BODY_FIELD: body, **headers}
        try:
            await _bounded(self.redis.xadd(self.keys.stream, fields), self.timeout, "XADD")
        except StreamUnavailable as e:
            if e.timed_out:
                raise UnknownOutcome(headers.get(KEY_FIELD), str(e)) from e
            raise

    async def measure(self) -> tuple[int | None, float | None]:
        """The group's (depth, oldest age in seconds) now, in two round trips."""
        if self.group is None:
            return None, None
        try:
            if not self._group_ready:
                await _ensure_group(self.redis, self.keys, self.group, self.timeout)
                self._group_ready = True
            return await _bounded(self._measure(self.group), self.timeout, "backlog")
        except StreamUnavailable:
            self._group_ready = False  # the stream may be gone: make the group again
            raise

    async def _measure(self, group: str) -> tuple[int | None, float | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xinfo_groups(self.keys.stream)
            pipe.xpending(self.keys.stream, group)
            # The server's clock in a script on the queue's slot: a cluster pipeline refuses a
            # keyless TIME, and another node's clock is not the one that stamped the entries.
            pipe.eval(_DELAYED_AND_TIME, 1, self.keys.retry)
            groups, pending, (delayed, now) = await pipe.execute()
        mine = next((g for g in groups if _text(g.get("name")) == group), None)
        if mine is None:
            self._group_ready = False
            return None, None
        last = _text(mine.get("last-delivered-id", "0-0"))
        lag = mine.get("lag")
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(self.keys.stream, min="(" + last, max="+", count=1)
            if lag is None:  # unknown after some deletions: count the undelivered, bounded
                pipe.xrange(self.keys.stream, min="(" + last, max="+", count=100_000)
            replies = await pipe.execute()
        first_undelivered = replies[0]
        undelivered = int(lag) if lag is not None else len(replies[1])
        depth = undelivered + int(pending.get("pending", 0)) + int(delayed)
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        stamps = []
        if int(pending.get("pending", 0)) > 0 and pending.get("min") is not None:
            stamps.append(_entry_ms(pending["min"]))
        if first_undelivered:
            stamps.append(_entry_ms(first_undelivered[0][0]))
        known = [s for s in stamps if s is not None]
        age = max(0.0, (now_ms - min(known)) / 1000.0) if known else None
        return depth, age

    def __repr__(self) -> str:
        return f"Producer(stream={self.keys.stream!r}, group={self.group!r})"


# -- the consumer -----------------------------------------------------------------------------


class StreamEntry:
    """One delivered stream entry: the `brownout.durable.Delivery` a `Consumer` hands to
    `brownout.durable.MessageRunner` (``Message.delivery`` in a handler)."""

    __slots__ = ("body", "fields", "headers", "id", "redeliveries", "settled")

    def __init__(self, entry_id: str, fields: Mapping[bytes, bytes], redeliveries: int = 0):
        self.id = entry_id
        self.fields = dict(fields)
        """The entry's raw fields, as stored."""
        self.body = self.fields.get(_BODY, b"")
        self.headers = {_text(k): _text(v) for k, v in self.fields.items() if k != _BODY}
        """Every field but the body, as text (envelope fields included)."""
        self.redeliveries = redeliveries
        """Deliveries of this entry before this one (``times delivered - 1``)."""
        self.settled = False

    def __repr__(self) -> str:
        return f"StreamEntry(id={self.id!r}, redeliveries={self.redeliveries})"


def _fields(reply: Any) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = dict(reply)
    if all(type(k) is bytes and type(v) is bytes for k, v in fields.items()):
        return fields  # what a client without decode_responses returns
    return {_raw(k): _raw(v) for k, v in fields.items()}


def _entries(reply: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
    """``(id, fields)`` from an XREADGROUP or XAUTOCLAIM reply (RESP2 or RESP3 shapes)."""
    out: list[tuple[str, dict[bytes, bytes] | None]] = []
    for item in reply or ():
        entry_id, fields = item[0], item[1]
        out.append(
            (
                _text(entry_id),
                None if fields is None else _fields(fields),
            )
        )
    return out


class Consumer:
    """Consumes a stream for consumer ``group`` through `brownout.durable.MessageRunner`.

    - reads with ``XREADGROUP`` at most as many entries as the ``bulkhead`` (or, without one,
      ``concurrency``) can start now, blocking at most ``block`` s per read;
    - creates the group if missing (from the stream's start, ``MKSTREAM``);
    - every ``claim_idle / 4`` s claims entries pending longer than ``claim_idle`` s
      (``XAUTOCLAIM``), a dead consumer's; keep ``claim_idle`` above the longest a handler may
      run (the policy's ``max_age``), or a slow live consumer's entry is run twice;
    - a claimed entry's deliveries so far (``XPENDING`` times delivered) count as attempts;
    - moves due retries back into the stream (a mover task);
    - ``stop()`` ends the reads, lets running handlers finish for ``grace`` s, then cancels
      them: their entries stay pending and are claimed again.

    ``consumer_name`` defaults to host, pid and a random suffix. ``parked_maxlen`` bounds the
    parked stream (approximately, oldest trimmed first; ``None``: unbounded).
    """

    def __init__(
        self,
        redis: Any,
        stream: str,
        group: str,
        handler: MessageHandler,
        *,
        consumer_name: str | None = None,
        policy: MessagePolicy | None = None,
        bulkhead: Bulkhead | None = None,
        concurrency: int = 16,
        claim_idle: float = 60.0,
        block: float = 1.0,
        timeout: float = 5.0,
        delete_on_ack: bool = True,
        parked_maxlen: int | None = 1_000_000,
        events: EventHub = hub,
        wall: Any = time.time,
        clock: Clock | None = None,
    ) -> None:
        if not group:
            raise ValueError("group must be a non-empty string")
        if not 1 <= concurrency <= 100_000:
            raise ValueError("concurrency must be 1..100000")
        if not 0 < claim_idle < math.inf:
            raise ValueError("claim_idle must be positive and finite")
        if not 0 < block <= 60:
            raise ValueError("block must be in (0, 60] seconds")
        if parked_maxlen is not None and parked_maxlen < 1:
            raise ValueError("parked_maxlen must be None or >= 1")
        _check_timeout(timeout)
        _check_client(redis)
        self.redis = redis
        self.keys = stream_keys(stream)
        self.group = group
        self.name = consumer_name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bulkhead = bulkhead
        self.concurrency = concurrency
        self.claim_idle = claim_idle
        self.claim_every = min(30.0, max(0.05, claim_idle / 4))
        self.block = block
        self.timeout = timeout
        self.delete_on_ack = delete_on_ack
        self.parked_maxlen = parked_maxlen
        self.wall = wall
        self.runner = MessageRunner(
            handler,
            self,
            queue=stream,
            policy=policy,
            bulkhead=bulkhead,
            events=events,
            wall=wall,
            clock=clock,
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slot = asyncio.Event()
        self._stop = asyncio.Event()
        self._running = False
        self._done = asyncio.Event()
        self._grace = 10.0
        self._claim_cursor = "0-0"
        self._acks: list[tuple[str, asyncio.Future[None]]] = []
        self._ack_flush: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Consume until `stop`; Redis failures are logged and retried with backoff."""
        if self._running:
            raise RuntimeError("this consumer is already running")
        self._running = True
        self._done = asyncio.Event()
        mover = asyncio.create_task(self._move_loop(), name=f"brownout-mover-{self.name}")
        try:
            await self._read_loop()
        finally:
            mover.cancel()
            await asyncio.gather(mover, return_exceptions=True)
            await self._drain(self._grace)
            self._running = False
            self._stop.clear()  # a stop before this run ended it; the next run starts afresh
            self._done.set()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop reading, let running handlers finish for ``grace`` s, then cancel them;
        returns once `run` has returned (at most about ``block + grace + timeout`` s)."""
        self._grace = max(0.0, grace)
        self._stop.set()
        self._slot.set()
        if self._running:
            await self._done.wait()

    @property
    def in_flight(self) -> int:
        """Entries this consumer is handling now."""
        return len(self._tasks)

    async def _drain(self, grace: float) -> None:
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _done, late = await asyncio.wait(tasks, timeout=grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less when stopped."""
        if seconds <= 0 or self._stop.is_set():
            return
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        except TimeoutError:
            pass

    def _free(self) -> int:
        if self.bulkhead is None:
            return self.concurrency - len(self._tasks)
        return self.bulkhead.limit - max(len(self._tasks), self.bulkhead.in_flight)

    # -- reading ------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        group_ready = False
        own_cursor: str | None = "0"  # this name's pending entries first (a restart)
        claim_at = loop.time()
        while not self._stop.is_set():
            free = self._free()
            if free <= 0:
                self._slot.clear()
                try:
                    async with asyncio.timeout(self.block):
                        await self._slot.wait()
                except TimeoutError:
                    pass
                continue
            try:
                if not group_ready:
                    await _ensure_group(self.redis, self.keys, self.group, self.timeout)
                    group_ready = True
                if own_cursor is not None:
                    own_cursor = await self._read_own(own_cursor, free)
                elif loop.time() >= claim_at:
                    swept = await self._claim(free)
                    claim_at = loop.time() + (self.claim_every if swept else 0.0)
                else:
                    await self._read_new(free)
                failures = 0
            except StreamUnavailable as e:
                failures += 1
                if e.__cause__ is not None and "NOGROUP" in str(e.__cause__):
                    group_ready = False  # the stream or group was deleted: make it again
                wait = min(_MAX_BACKOFF, 0.05 * 2**failures)
                _log.warning("redis stream %s: %s; again in %.2f s", self.keys.stream, e, wait)
                await self._pause(wait)

    async def _read_new(self, count: int) -> None:
        reply = await _bounded(
            self.redis.xreadgroup(
                self.group,
                self.name,
                {self.keys.stream: ">"},
                count=count,
                block=max(1, int(self.block * 1000)),
            ),
            self.block + self.timeout,
            "XREADGROUP",
        )
        for _stream, items in _stream_replies(reply):
            for entry_id, fields in _entries(items):
                self._start(entry_id, fields, 0)

    async def _read_own(self, cursor: str, count: int) -> str | None:
        """This consumer name's pending entries after ``cursor``; the next cursor, or
        ``None`` once they are all started."""
        reply = await _bounded(
            self.redis.xreadgroup(self.group, self.name, {self.keys.stream: cursor}, count=count),
            self.timeout,
            "XREADGROUP (pending)",
        )
        found = [e for _s, items in _stream_replies(reply) for e in _entries(items)]
        if not found:
            return None
        await self._start_redelivered(found)
        return found[-1][0]

    async def _claim(self, count: int) -> bool:
        """Claim one page of entries idle past ``claim_idle``; True once a sweep ended."""
        reply = await _bounded(
            self.redis.xautoclaim(
                self.keys.stream,
                self.group,
                self.name,
                min_idle_time=int(self.claim_idle * 1000),
                start_id=self._claim_cursor,
                count=count,
            ),
            self.timeout,
            "XAUTOCLAIM",
        )
        self._claim_cursor = _text(reply[0])
        found = [e for e in _entries(reply[1]) if e[0] not in self._tasks]
        if found:
            _log.info("redis stream %s: claimed %d idle entries", self.keys.stream, len(found))
            await self._start_redelivered(found)
        return self._claim_cursor == "0-0"

    async def _start_redelivered(self, found: list[tuple[str, dict[bytes, bytes] | None]]) -> None:
        ids = [entry_id for entry_id, _ in found]
        rows = await _bounded(
            self.redis.xpending_range(
                self.keys.stream,
                self.group,
                min=ids[0],
                max=ids[-1],
                count=len(ids) + len(self._tasks) + 16,  # our in-flight ones may interleave
                consumername=self.name,
            ),
            self.timeout,
            "XPENDING",
        )
        delivered = {_text(r["message_id"]): int(r["times_delivered"]) for r in rows}
        for entry_id, fields in found:
            if entry_id in self._tasks:
                continue
            self._start(entry_id, fields, max(0, delivered.get(entry_id, 1) - 1))

    def _start(self, entry_id: str, fields: dict[bytes, bytes] | None, redeliveries: int) -> None:
        task = asyncio.create_task(self._handle(entry_id, fields, redeliveries))
        self._tasks[entry_id] = task
        task.add_done_callback(functools.partial(self._finished, entry_id))

    def _finished(self, entry_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(entry_id, None)
        self._slot.set()

    async def _handle(
        self, entry_id: str, fields: dict[bytes, bytes] | None, redeliveries: int
    ) -> None:
        entry = StreamEntry(entry_id, fields or {}, redeliveries)
        try:
            if fields is None:  # deleted while pending: nothing left to run
                await self.ack(entry)
                return
            await self.runner.process(entry)
        except Exception as e:  # Redis could not store or acknowledge: left pending
            _log.warning(
                "redis stream %s: entry %s left pending: %s", self.keys.stream, entry_id, e
            )

    # -- the broker side (brownout.durable.MessageBroker) -------------------------------------
    async def ack(self, delivery: StreamEntry) -> None:
        """``XACK`` (and ``XDEL`` with ``delete_on_ack``), atomically; returns once Redis
        confirmed it. Acknowledgements that arrive together share one script call."""
        if delivery.settled:
            return
        done = asyncio.get_running_loop().create_future()
        self._acks.append((delivery.id, done))
        if self._ack_flush is None:
            self._ack_flush = asyncio.create_task(self._flush_acks())
        await done
        delivery.settled = True

    async def _flush_acks(self, most: int = 256) -> None:
        try:
            while self._acks:
                await asyncio.sleep(0)  # acknowledgements of this loop turn join the batch
                batch, self._acks = self._acks[:most], self._acks[most:]
                args = [self.group, "1" if self.delete_on_ack else "0", *(i for i, _ in batch)]
                try:
                    await _bounded(
                        _ACK_SCRIPT(self.redis, (self.keys.stream,), args), self.timeout, "XACK"
                    )
                except Exception as e:
                    for _, waiter in batch:
                        if not waiter.done():
                            waiter.set_exception(e)
                else:
                    for _, waiter in batch:
                        if not waiter.done():
                            waiter.set_result(None)
        finally:
            self._ack_flush = None

    async def retry_later(self, delivery: StreamEntry, envelope: Envelope, delay: float) -> None:
        """Store a copy with ``envelope`` in the retry set, due in ``delay`` s, and
        acknowledge the original, atomically."""
        fields = _with_envelope(delivery.fields, envelope)
        delay_ms = max(0, min(int(delay * 1000), 366 * 86_400_000))
        args = [self.group, delivery.id, delay_ms, "1" if self.delete_on_ack else "0", *fields]
        await _bounded(
            _RETRY_SCRIPT(self.redis, (self.keys.stream, self.keys.retry), args),
            self.timeout,
            "retry",
        )
        delivery.settled = True

    async def park(
        self, delivery: StreamEntry, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        """Add a copy to the parked stream with its reason and acknowledge the original,
        atomically."""
        fields = (
            _with_envelope(delivery.fields, envelope)
            if envelope is not None
            else _flat(delivery.fields, skip=_PARKED_KEYS)
        )
        fields += [
            ORIGINAL_ID_FIELD,
            delivery.id,
            PARK_REASON_FIELD,
            reason,
            PARK_DETAIL_FIELD,
            detail[:1024],
            PARKED_AT_FIELD,
            repr(float(self.wall())),
        ]
        maxlen = "" if self.parked_maxlen is None else str(self.parked_maxlen)
        args = [self.group, delivery.id, "1" if self.delete_on_ack else "0", maxlen, *fields]
        await _bounded(
            _PARK_SCRIPT(self.redis, (self.keys.stream, self.keys.parked), args),
            self.timeout,
            "park",
        )
        delivery.settled = True

    # -- the mover ----------------------------------------------------------------------------
    async def _move_loop(self, batch: int = 100) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                moved, wait_ms = await _bounded(
                    _MOVE_SCRIPT(
                        self.redis, (self.keys.stream, self.keys.retry, self.keys.parked), [batch]
                    ),
                    self.timeout,
                    "retry move",
                )
                failures = 0
            except StreamUnavailable as e:
                failures += 1
                wait = min(_MAX_BACKOFF, 0.05 * 2**failures)
                _log.warning("redis stream %s: %s; again in %.2f s", self.keys.retry, e, wait)
                await self._pause(wait)
                continue
            if int(moved) >= batch:
                continue
            wait = 1.0 if int(wait_ms) < 0 else min(1.0, max(0.005, int(wait_ms) / 1000))
            await self._pause(wait)

    def __repr__(self) -> str:
        return f"Consumer(stream={self.keys.stream!r}, group={self.group!r}, name={self.name!r})"


def _stream_replies(reply: Any) -> list[tuple[Any, Any]]:
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in reply.items()]
    return [(item[0], item[1]) for item in reply]


def _flat(fields: Mapping[bytes, bytes], *, skip: frozenset[bytes]) -> list[bytes | str]:
    out: list[bytes | str] = []
    for k, v in fields.items():
        if k not in skip:
            out += [k, v]
    return out


def _with_envelope(fields: Mapping[bytes, bytes], envelope: Envelope) -> list[bytes | str]:
    """The entry's fields with ``envelope`` in place of its envelope fields (and without
    parking's)."""
    out = _flat(fields, skip=_ENVELOPE_KEYS | _PARKED_KEYS)
    for k, v in envelope.encode().items():
        out += [k, v]
    return out


# -- parking ----------------------------------------------------------------------------------


class ParkedStream:
    """The parked stream of a queue: list, show, replay and purge parked messages.

    Ids are the parked stream's entry ids. Each `replay` puts a message back in the queue's
    stream with a fresh envelope (enqueued now, valid for ``ttl`` s or without a deadline of
    its own, attempt 1, the same idempotency key, its history kept plus a ``replayed`` entry)
    and removes it from the parked stream, atomically per message.
    """

    def __init__(
        self, redis: Any, stream: str, *, timeout: float = 5.0, wall: Any = time.time
    ) -> None:
        _check_timeout(timeout)
        _check_client(redis)
        self.redis = redis
        self.keys = stream_keys(stream)
        self.timeout = timeout
        self.wall = wall

    async def _pages(self) -> AsyncIterator[list[tuple[str, dict[bytes, bytes]]]]:
        start = "-"
        while True:
            rows = await _bounded(
                self.redis.xrange(self.keys.parked, min=start, max="+", count=_PAGE),
                self.timeout,
                "XRANGE",
            )
            page = [(i, f) for i, f in _entries(rows) if f is not None]
            if page:
                yield page
            if len(rows) < _PAGE:
                return
            start = "(" + _text(rows[-1][0])

    async def list(self, limit: int = 100, reason: str | None = None) -> list[ParkedMessage]:
        """Up to ``limit`` parked messages, oldest first; only ``reason``'s when given."""
        if limit < 0:
            raise ValueError("limit must be >= 0")
        out: list[ParkedMessage] = []
        if limit == 0:
            return out
        async for page in self._pages():
            for entry_id, fields in page:
                parked = _parked(entry_id, fields)
                if reason is None or parked.reason == reason:
                    out.append(parked)
                    if len(out) >= limit:
                        return out
        return out

    async def get(self, id: str) -> ParkedMessage | None:
        """The parked message ``id``, or ``None`` when there is none."""
        entry_id = _checked_id(id)
        rows = await _bounded(
            self.redis.xrange(self.keys.parked, min=entry_id, max=entry_id, count=1),
            self.timeout,
            "XRANGE",
        )
        found = [(i, f) for i, f in _entries(rows) if f is not None]
        return _parked(*found[0]) if found else None

    async def count(self) -> int:
        """Parked messages now (``XLEN``)."""
        return int(await _bounded(self.redis.xlen(self.keys.parked), self.timeout, "XLEN"))

    async def replay(self, ids: Sequence[str] | None, *, ttl: float | None) -> int:
        """Put ``ids`` (``None``: every parked message) back into the stream with a new
        deadline ``ttl`` s from now; returns how many were replayed."""
        if ttl is not None and not 0 < ttl < math.inf:
            raise ValueError("ttl must be None or positive and finite")
        replayed = 0
        if ids is None:
            async for page in self._pages():
                for entry_id, fields in page:
                    replayed += await self._replay_one(entry_id, fields, ttl)
            return replayed
        for entry_id in ids:
            checked = _checked_id(entry_id)
            rows = await _bounded(
                self.redis.xrange(self.keys.parked, min=checked, max=checked, count=1),
                self.timeout,
                "XRANGE",
            )
            for found_id, found in _entries(rows):
                if found is not None:
                    replayed += await self._replay_one(found_id, found, ttl)
        return replayed

    async def _replay_one(
        self, entry_id: str, fields: dict[bytes, bytes], ttl: float | None
    ) -> int:
        fresh = _parked(entry_id, fields).replay_envelope(float(self.wall()), ttl)
        copy = _with_envelope(fields, fresh)
        done = await _bounded(
            _REPLAY_SCRIPT(self.redis, (self.keys.parked, self.keys.stream), [entry_id, *copy]),
            self.timeout,
            "replay",
        )
        return int(done)

    async def purge(self, ids: Sequence[str] | None) -> int:
        """Delete ``ids`` (``None``: every parked message) for good; returns how many."""
        if ids is None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xlen(self.keys.parked)
                pipe.delete(self.keys.parked)
                count, _ = await _bounded(pipe.execute(), self.timeout, "purge")
            return int(count)
        checked = [_checked_id(i) for i in ids]
        purged = 0
        for at in range(0, len(checked), _PAGE):
            chunk = checked[at : at + _PAGE]
            purged += int(
                await _bounded(self.redis.xdel(self.keys.parked, *chunk), self.timeout, "XDEL")
            )
        return purged

    def __repr__(self) -> str:
        return f"ParkedStream(parked={self.keys.parked!r})"


def _checked_id(entry_id: str) -> str:
    if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
        raise ValueError(f"not a stream entry id (like 1700000000000-0): {entry_id!r}")
    return entry_id


def _parked(entry_id: str, fields: Mapping[bytes, bytes]) -> ParkedMessage:
    body = fields.get(_BODY, b"")
    headers = {_text(k): _text(v) for k, v in fields.items() if k != _BODY}
    return ParkedMessage.from_headers(entry_id, body, headers)
