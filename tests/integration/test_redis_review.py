"""Hostile inputs and hostile Redis states for the Redis quota store and outcome ledger.

- a caller id that is not valid UTF-8 (aiohttp decodes header bytes with ``surrogateescape``)
  is a quota key like any other: it never raises into the request path and never collides;
- an outcome ledger on a Redis that never answers raises within its timeout instead of
  hanging the request that records an unknown outcome (D6, "nothing hangs");
- the ledger's index of pending keys stays bounded by live records even when nobody runs a
  reconciler (expired records do not pile up in it);
- idempotency keys round-trip exactly through the Redis ledger, whatever their characters.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from tests.integration.test_quota_redis import SHARED_PORT, ListSink, shared_redis  # noqa: F401

from brownout import (
    Dependency,
    EventHub,
    Quota,
    Reason,
    RedisQuotaStore,
    RetryPolicy,
    UnknownOutcome,
)
from brownout.retry import InMemoryOutcomeLedger, OutcomeState, TransientError
from brownout.retry.ledger_redis import RedisOutcomeLedger

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = pytest.mark.integration


@pytest.fixture
async def client() -> AsyncIterator[object]:
    c = redis_asyncio.Redis(host="127.0.0.1", port=SHARED_PORT)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture
async def ledger_prefix(client: object) -> AsyncIterator[str]:
    prefix = f"test-review-ledger-{uuid.uuid4().hex}"
    yield prefix
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]  # type: ignore[attr-defined]
    if keys:
        await client.delete(*keys)  # type: ignore[attr-defined]


@pytest.fixture
async def black_hole() -> AsyncIterator[int]:
    """A port that accepts connections and never answers (a wedged Redis)."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


# -- quota keys ------------------------------------------------------------------------------
async def test_a_caller_id_that_is_not_utf8_gets_a_shared_decision(client: object) -> None:
    """aiohttp hands ``b"\\xff"`` in a header over as ``"\\udcff"``: still just a key."""
    prefix = f"bq-review:{uuid.uuid4().hex[:12]}:"
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(100.0, 2, store=store, events=EventHub())
    hostile = b"tenant-\xff\xfe".decode("utf-8", "surrogateescape")
    first = await quota.check(hostile)  # raised UnicodeEncodeError into the request path
    assert first.backend == "shared" and first.allowed and first.remaining == 1
    assert (await quota.check(hostile)).allowed
    assert not (await quota.check(hostile)).allowed  # its own allowance, enforced
    # ... which no other key shares (not even one whose UTF-8 bytes look alike).
    for other in ("tenant-", "tenant-\xff\xfe", "tenant-\ufffd\ufffd", "tenant-\\udcff\\udcfe"):
        assert (await quota.check(other)).remaining == 1, other
    assert not quota.fallback_active and quota.store_failures == 0


# -- the outcome ledger ----------------------------------------------------------------------
async def test_ledger_on_a_redis_that_never_answers_raises_within_its_timeout(
    black_hole: int,
) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=black_hole)
    try:
        ledger = RedisOutcomeLedger(c, prefix="x", timeout=0.1)
        loop = asyncio.get_running_loop()
        for call in (
            lambda: ledger.record_unknown("k", dependency="d"),
            lambda: ledger.resolve("k", OutcomeState.APPLIED),
            lambda: ledger.note_check("k"),
            lambda: ledger.get("k"),
            lambda: ledger.pending(),
        ):
            t0 = loop.time()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(5):  # the test's own guard: 5 s means "hangs"
                    await call()
            assert loop.time() - t0 < 0.1 + 0.5
    finally:
        await c.aclose()


async def test_unknown_outcome_reaches_the_caller_when_the_ledger_redis_is_wedged(
    black_hole: int,
) -> None:
    """The mutation timed out; recording it must not hang the request forever (D6)."""
    c = redis_asyncio.Redis(host="127.0.0.1", port=black_hole)
    try:
        ledger = RedisOutcomeLedger(c, prefix="x")  # the default timeout
        shop = Dependency("shop", timeout=0.05, retry=RetryPolicy(1), ledger=ledger)

        async def charge() -> str:
            await asyncio.sleep(10)  # sent, never answered
            raise TransientError("unreachable", sent=True)

        with pytest.raises(UnknownOutcome):
            async with asyncio.timeout(5):  # before the fix: stuck here until this guard
                await shop.call(charge)
    finally:
        await c.aclose()


async def test_pending_index_stays_bounded_without_a_reconciler(
    client: object, ledger_prefix: str
) -> None:
    """Records expire after ``ttl``; their entries in the pending index must go too, even
    when nobody calls `pending` (later writes keep the index key itself alive)."""
    short = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=1)
    long = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60)
    for i in range(100):
        await short.record_unknown(f"old-{i}", dependency="d")
    await long.record_unknown("keeper", dependency="d")  # keeps the index key alive
    await asyncio.sleep(1.3)  # every old record has expired
    for i in range(100):
        await long.record_unknown(f"new-{i}", dependency="d")
    index = await client.zcard(f"{ledger_prefix}:outcomes:pending")  # type: ignore[attr-defined]
    assert index == 1 + 100  # was 201: expired keys stayed until a reconciler met them
    assert [r.key for r in await long.pending(500)] == ["keeper"] + [f"new-{i}" for i in range(100)]


async def test_ledger_round_trips_any_idempotency_key(client: object, ledger_prefix: str) -> None:
    ledger = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, wall=lambda: 1234.5)
    keys = [
        "plain",
        "ключ:{slot}\nnext line",
        "emoji-\U0001f600",
        b"raw-\xff\xfe".decode("utf-8", "surrogateescape"),  # an inbound header, via aiohttp
        "\ud83d\ude00",  # a surrogate pair, not the emoji: a different key
    ]
    for key in keys:
        await ledger.record_unknown(key, dependency="payments", detail="d" * 400 + "é€")
    pending = await ledger.pending()
    assert [r.key for r in pending] == sorted(
        keys, key=lambda k: k.encode("utf-8", "surrogatepass")
    )
    for key in keys:
        rec = await ledger.get(key)
        assert rec is not None and rec.key == key and rec.recorded_at == 1234.5
        await ledger.note_check(key)
        await ledger.resolve(key, OutcomeState.NOT_APPLIED)
        rec = await ledger.get(key)
        assert rec is not None and rec.state is OutcomeState.NOT_APPLIED and rec.checks == 1
    assert await ledger.pending() == []


async def test_pending_with_no_room_returns_nothing_in_both_ledgers(
    client: object, ledger_prefix: str
) -> None:
    # ``pending(0)`` asked Redis for ZRANGE 0 0 and returned one entry.
    for ledger in (RedisOutcomeLedger(client, prefix=ledger_prefix), InMemoryOutcomeLedger()):
        await ledger.record_unknown("k1", dependency="payments")
        await ledger.record_unknown("k2", dependency="payments")
        assert await ledger.pending(0) == []
        assert await ledger.pending(-1) == []
        assert [r.key for r in await ledger.pending(1)] == ["k1"]


# -- a key another application owns -------------------------------------------------------
async def test_one_key_of_the_wrong_type_does_not_take_the_quota_down_for_everyone(
    client: object,
) -> None:
    """Another app's list under one caller's key name (WRONGTYPE) is that key's problem: the
    failure policy decides that key, while every other caller keeps the shared quota."""
    prefix = f"bq-review:{uuid.uuid4().hex[:12]}:"
    await client.rpush(prefix + "tenant-7", "someone else's data")  # type: ignore[attr-defined]
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(100.0, 5, store=store, on_store_failure="closed", events=events)
    try:
        for _ in range(3):
            poisoned = await quota.check("tenant-7")
            assert not poisoned.allowed and poisoned.reason is Reason.DEPENDENCY_UNAVAILABLE
            innocent = await quota.check("tenant-8")
            assert innocent.backend == "shared" and innocent.allowed  # was: 503 for everyone
        assert not quota.fallback_active and sink.events == []
        assert await client.lrange(prefix + "tenant-7", 0, -1) == [  # type: ignore[attr-defined]
            b"someone else's data"
        ]  # untouched
    finally:
        await client.delete(prefix + "tenant-7", prefix + "tenant-8")  # type: ignore[attr-defined]
