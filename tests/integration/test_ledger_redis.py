"""Unknown outcomes on a real Redis and a real HTTP server over loopback (D6, T3).

Every test that takes ``redis_client`` runs twice: on the shared Redis (127.0.0.1:6379, or
``BROWNOUT_TEST_REDIS``) and on a three-node Redis Cluster the session starts on loopback
ports (``redis_cluster`` in tests/conftest.py), with a unique key prefix per test (cleaned up).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tests import services

from brownout import (
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    OutcomeState,
    Reconciler,
    ResponseError,
    RetryPolicy,
    TransientError,
    UnknownOutcome,
)
from brownout._retry import OutcomeRecord
from brownout._retry.idempotency import OutcomeLedgerFull
from brownout._retry.ledger_redis import RedisOutcomeLedger

redis_asyncio = pytest.importorskip("redis.asyncio")
ClusterNode = pytest.importorskip("redis.asyncio.cluster").ClusterNode
httpx = pytest.importorskip("httpx")
web = pytest.importorskip("aiohttp.web")

pytestmark = pytest.mark.integration


@pytest.fixture(params=["single", "cluster"])
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[tuple[object, str]]:
    """(client, prefix): a client of one Redis or of the test cluster, and a unique prefix
    with its hash tag (the ledger's key names start with it)."""
    client: Any
    if request.param == "single":
        server: services.Service = request.getfixturevalue("redis_server")
        client = redis_asyncio.Redis(host=server.host, port=server.port)
    else:
        nodes: list[tuple[str, int]] = request.getfixturevalue("redis_cluster")
        client = redis_asyncio.RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes]
        )
    prefix = f"{{test-ledger-{uuid.uuid4().hex}}}"
    yield client, prefix
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_record_resolve_pending_and_expiry(redis_client: tuple[object, str]) -> None:
    client, prefix = redis_client
    ledger = RedisOutcomeLedger(client, prefix=prefix, ttl=60, wall=lambda: 1000.0)
    await ledger.record_unknown("k1", dependency="payments", detail="read timeout")
    await ledger.record_unknown("k1", dependency="other")  # first record wins
    await ledger.record_unknown("k2", dependency="payments")
    rec = await ledger.get("k1")
    assert rec == OutcomeRecord("k1", "payments", OutcomeState.PENDING, 1000.0, "read timeout")
    assert [r.key for r in await ledger.pending()] == ["k1", "k2"]
    ttl = await client.ttl(f"{prefix}:outcome:k1")  # type: ignore[attr-defined]
    assert 0 < ttl <= 60  # bounded in time

    await ledger.note_check("k2")
    await ledger.resolve("k1", OutcomeState.APPLIED)
    got = await ledger.get("k1")
    assert got is not None and got.state is OutcomeState.APPLIED
    pending = await ledger.pending()
    assert [(r.key, r.checks) for r in pending] == [("k2", 1)]

    await client.delete(f"{prefix}:outcome:k2")  # as if it expired
    assert await ledger.pending() == []
    assert await client.zcard(f"{prefix}:outcomes:pending") == 0  # type: ignore[attr-defined]
    await ledger.resolve("gone", OutcomeState.APPLIED)  # no half-written record appears
    assert await ledger.get("gone") is None


class PaymentServer:
    """Applies a charge once the test releases it (after the client gave up), deduplicating by
    Idempotency-Key."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.applied: dict[str, int] = {}
        self.work: set[asyncio.Task[None]] = set()
        self.release = asyncio.Event()

    async def apply(self, key: str) -> None:
        await self.release.wait()
        self.applied[key] = self.applied.get(key, 0) + (0 if key in self.applied else 1)

    async def charge(self, request: web.Request) -> web.Response:
        key = request.headers["idempotency-key"]
        self.received.append(key)
        if key in self.applied:
            return web.json_response({"status": "applied"})
        task = asyncio.create_task(self.apply(key))
        self.work.add(task)
        await asyncio.shield(task)
        return web.json_response({"status": "applied"})

    async def status(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        return web.json_response({"applied": key in self.applied})


async def test_mutation_applied_after_client_timeout_is_reconciled_by_key(
    redis_client: tuple[object, str],
) -> None:
    client, prefix = redis_client
    server = PaymentServer()
    app = web.Application()
    app.router.add_post("/charge", server.charge)
    app.router.add_get("/status/{key}", server.status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as http:

            async def charge(amount: int) -> object:
                from brownout import current

                key = current().idempotency_key
                assert key is not None
                try:
                    r = await http.post(
                        "/charge", json={"amount": amount}, headers={"idempotency-key": key}
                    )
                except httpx.ConnectError as e:
                    raise TransientError(str(e), sent=False) from e
                except httpx.TransportError as e:
                    raise TransientError(str(e), sent=True) from e
                if r.status_code >= 400:
                    raise ResponseError(r.status_code, response=r)
                return r.json()

            ledger = RedisOutcomeLedger(client, prefix=prefix, ttl=60)
            payments = Dependency(
                "payments",
                timeout=0.2,
                retry=RetryPolicy(2, backoff=ExponentialBackoff(0.01, cap=0.02)),
                ledger=ledger,
            )
            with pytest.raises(UnknownOutcome) as info:
                await payments.call(charge, 10)  # a mutation: keyed, retried, then unknown
            key = info.value.idempotency_key
            assert key is not None
            rec = await ledger.get(key)
            assert rec is not None and rec.state is OutcomeState.PENDING

            async def check(record: OutcomeRecord) -> OutcomeState:
                r = await http.get(f"/status/{record.key}")
                return OutcomeState.APPLIED if r.json()["applied"] else OutcomeState.PENDING

            reconciler = Reconciler(ledger, check)
            assert await reconciler.run_once() == []  # not applied yet: still unknown
            server.release.set()  # the charge lands after the client's deadline
            await asyncio.gather(*server.work)
            resolved = await reconciler.run_once()
            assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.APPLIED)]
            assert server.received == [key, key]  # the retry carried the same key
            assert server.applied == {key: 1}  # ... and caused no duplicate side effect
            assert await ledger.pending() == []
    finally:
        await runner.cleanup()


@pytest.fixture
def client(redis_client: tuple[object, str]) -> object:
    return redis_client[0]


@pytest.fixture
def ledger_prefix(redis_client: tuple[object, str]) -> str:
    """A unique key prefix; `redis_client` deletes its keys afterwards."""
    return redis_client[1]


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


# -- issue 24 --------------------------------------------------------------------------------
async def test_a_new_unknown_for_a_resolved_key_is_pending_again(
    client: object, ledger_prefix: str
) -> None:
    """Reconciled NOT_APPLIED, resent with the same key, unknown again: the resend may have
    applied it, so it must be reconciled again (the ledger kept the old resolution)."""
    now = [1000.0]
    ledger = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, wall=lambda: now[0])
    await ledger.record_unknown("order-7", dependency="payments", detail="read timeout")
    await ledger.record_unknown("order-8", dependency="payments")
    await ledger.note_check("order-7")
    await ledger.resolve("order-7", OutcomeState.NOT_APPLIED)
    now[0] = 1005.0
    await ledger.record_unknown("order-7", dependency="payments", detail="timeout again")
    rec = await ledger.get("order-7")
    assert rec is not None and rec.state is OutcomeState.PENDING  # was: still NOT_APPLIED
    assert rec == OutcomeRecord(
        "order-7",
        "payments",
        OutcomeState.PENDING,
        1005.0,
        "timeout again",
        checks=0,
        previous=OutcomeState.NOT_APPLIED,
    )
    assert [r.key for r in await ledger.pending()] == ["order-8", "order-7"]
    await ledger.record_unknown("order-7", dependency="payments", detail="third")  # pending
    again = await ledger.get("order-7")
    assert again is not None and again.detail == "timeout again"  # the first record stands
    await ledger.resolve("order-7", OutcomeState.APPLIED)
    done = await ledger.get("order-7")
    assert done is not None and done.state is OutcomeState.APPLIED
    assert done.previous is OutcomeState.NOT_APPLIED


async def test_a_new_unknown_for_a_key_left_for_a_human_is_checked_again(
    client: object, ledger_prefix: str
) -> None:
    """Pending and checked ``max_checks`` times (left for a human), then a new attempt with
    the same key is unknown too: its checks start again, so the reconciler looks at it."""
    ledger = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, wall=lambda: 1000.0)
    asked: list[str] = []

    async def check(record: OutcomeRecord) -> OutcomeState:
        asked.append(record.key)
        return OutcomeState.PENDING

    reconciler = Reconciler(ledger, check, max_checks=2)
    await ledger.record_unknown("order-9", dependency="payments", detail="read timeout")
    for _ in range(3):
        await reconciler.run_once()
    assert asked == ["order-9", "order-9"]  # left for a human
    await ledger.record_unknown("order-9", dependency="payments", detail="timeout again")
    rec = await ledger.get("order-9")
    assert rec == OutcomeRecord(
        "order-9", "payments", OutcomeState.PENDING, 1000.0, "read timeout", checks=0
    )  # the first record stands, its checks start again
    await reconciler.run_once()
    assert asked == ["order-9"] * 3


async def _stored(client: Any, prefix: str) -> tuple[int, int]:
    """(records, index rows) under ``prefix``: what the ledger costs Redis."""
    records = [k async for k in client.scan_iter(match=f"{prefix}:outcome:*")]
    rows = sum([await client.zcard(f"{prefix}:outcomes:{name}") for name in INDEXES])
    return len(records), rows


INDEXES = ("pending", "resolved")


async def test_bounded_by_max_entries_resolved_first_pending_never_dropped(
    client: Any, ledger_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bounded only by its 7-day expiry, an outage's worth of keys (100,000 cost 44 MiB)
    stayed in Redis. At ``max_entries`` the oldest resolved record goes; when pending records
    alone fill it, the new one is refused with `OutcomeLedgerFull`, never dropped unsaid."""
    ledger = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, max_entries=5)
    for k in "abcde":
        await ledger.record_unknown(k, dependency="payments")
    await ledger.resolve("d", OutcomeState.APPLIED)
    await ledger.resolve("b", OutcomeState.NOT_APPLIED)
    await ledger.record_unknown("f", dependency="payments")  # evicts b (recorded before d)
    assert await ledger.get("b") is None and await ledger.get("d") is not None
    await ledger.record_unknown("g", dependency="payments")  # evicts d
    assert await ledger.get("d") is None and ledger.evicted == 2
    assert await _stored(client, ledger_prefix) == (5, 5)

    with pytest.raises(OutcomeLedgerFull) as full:  # five pending: no room, nothing to evict
        await ledger.record_unknown("h", dependency="payments")
    assert full.value.key == "h" and full.value.max_entries == 5
    assert ledger.refused == 1 and await ledger.get("h") is None
    assert [r.key for r in await ledger.pending()] == list("acefg")  # none dropped
    assert await _stored(client, ledger_prefix) == (5, 5)

    await ledger.resolve("a", OutcomeState.APPLIED)
    await ledger.record_unknown("a", dependency="payments")  # pending again: no new entry
    await ledger.resolve("c", OutcomeState.APPLIED)
    await ledger.record_unknown("h", dependency="payments")  # room again: evicts c
    assert await ledger.get("c") is None
    assert [r.key for r in await ledger.pending()] == list("efgah")
    assert await _stored(client, ledger_prefix) == (5, 5)

    # A Dependency whose ledger is full: the caller still gets UnknownOutcome, and the
    # refused key is logged (the only record of it), never silently lost.
    shop = Dependency("shop", timeout=0.05, retry=RetryPolicy(1), ledger=ledger)

    async def charge() -> str:
        await asyncio.sleep(10)  # sent, never answered
        return "never"

    with caplog.at_level(logging.ERROR, logger="brownout"), pytest.raises(UnknownOutcome) as lost:
        await shop.call(charge)
    assert ledger.refused == 2
    assert lost.value.idempotency_key is not None
    assert lost.value.idempotency_key in caplog.text and "OutcomeLedgerFull" in caplog.text


async def test_a_lowered_bound_shrinks_the_ledger_and_expired_records_make_room(
    client: Any, ledger_prefix: str
) -> None:
    roomy = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, max_entries=100)
    for i in range(20):
        await roomy.record_unknown(f"old-{i}", dependency="d")
        await roomy.resolve(f"old-{i}", OutcomeState.APPLIED)
    tight = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60, max_entries=3)
    await tight.record_unknown("new-1", dependency="d")  # evicts what one write may (16)
    await tight.record_unknown("new-2", dependency="d")
    assert await _stored(client, ledger_prefix) == (3, 3)

    short = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=1, max_entries=3)
    await short.record_unknown("brief", dependency="d")  # evicts the last old one
    assert await _stored(client, ledger_prefix) == (3, 3)
    await asyncio.sleep(1.3)  # "brief" expired: its place is free, though still pending
    await tight.record_unknown("new-3", dependency="d")
    assert [r.key for r in await tight.pending()] == ["new-1", "new-2", "new-3"]


def _slot(key: bytes) -> int:
    """The Redis Cluster hash slot of a key (CRC16/XMODEM of its hash tag, mod 16384)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    crc = 0
    for byte in key:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc % 16384


def test_slot_matches_the_cluster_spec() -> None:
    assert _slot(b"123456789") == 0x31C3 % 16384  # the spec's CRC16 check value
    assert _slot(b"{user1000}.following") == _slot(b"{user1000}.followers")


class _SlotCheckingClient:
    """Passes calls through, checking every script's keys share one hash slot (Cluster)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.scripts = 0

    async def eval(self, script: str, numkeys: int, *args: Any) -> Any:
        keys = [k if isinstance(k, bytes) else k.encode() for k in args[:numkeys]]
        assert len({_slot(k) for k in keys}) == 1, keys
        self.scripts += 1
        return await self.inner.eval(script, numkeys, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_every_key_of_a_ledger_shares_one_slot(client: Any, ledger_prefix: str) -> None:
    """On Redis Cluster a script's keys (and the records it evicts) must share a slot. The
    default prefix had no hash tag: each script failed there with "all keys must map to the
    same key slot". A prefix without one now gets one; one with a tag is kept as given."""
    plain = ledger_prefix.strip("{}")
    for given, stored_as in ((plain, "{" + plain + "}"), (f"app:{{{plain}}}", f"app:{{{plain}}}")):
        checking = _SlotCheckingClient(client)
        ledger = RedisOutcomeLedger(checking, prefix=given, ttl=60, max_entries=2)
        try:
            for k in ("a", "b", "ключ:{slot}"):
                await ledger.record_unknown(k, dependency="d")
                await ledger.note_check(k)
                await ledger.resolve(k, OutcomeState.APPLIED)
            await ledger.record_unknown("a", dependency="d")
            await ledger.pending()
            assert checking.scripts == 10 and ledger.evicted == 2  # a, then b
            stored = [k async for k in client.scan_iter(match=f"{stored_as}:*")]
            assert len(stored) == 4  # two records, two indexes
            assert len({_slot(k) for k in stored}) == 1
            assert ledger.name == stored_as
        finally:
            stored = [k async for k in client.scan_iter(match=f"{stored_as}:*")]
            if stored:
                await client.delete(*stored)


@pytest.mark.parametrize("bad", ["", "}x"])
def test_a_prefix_that_cannot_carry_a_hash_tag_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisOutcomeLedger(object(), prefix=bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_max_entries_must_be_a_finite_bound(bad: float) -> None:
    with pytest.raises(ValueError):
        RedisOutcomeLedger(object(), max_entries=bad)  # type: ignore[arg-type]


async def test_a_key_resolved_back_to_pending_is_reconciled(
    client: object, ledger_prefix: str
) -> None:
    """``resolve(key, PENDING)`` (the protocol allows it; the in-memory ledger honours it)
    set the state but left the key out of the pending index: never reconciled."""
    ledger = RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60)
    await ledger.record_unknown("k", dependency="d")
    await ledger.resolve("k", OutcomeState.APPLIED)
    await ledger.resolve("k", OutcomeState.PENDING)
    assert [r.key for r in await ledger.pending()] == ["k"]


# -- issue 27: a failed ledger write is counted, and the caller is told -----------------------
async def test_a_failed_ledger_write_is_an_event_a_counter_and_the_callers_to_keep(
    black_hole: int, client: Any, ledger_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stalled Redis, a closed port, a script error: each failed write was one log line,
    and nothing told the caller its unknown outcome went unrecorded. Each is now a
    `LedgerWriteFailed` counted by `Stats`, and `UnknownOutcome.recorded` is False."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from brownout import Stats
    from brownout.events import EventHub

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = int(s.getsockname()[1])  # refused once the block ends
    no_retry = Retry(NoBackoff(), 0)  # (redis-py retries would turn refusals into timeouts)
    stalled = redis_asyncio.Redis(host="127.0.0.1", port=black_hole, retry=no_retry)
    refused = redis_asyncio.Redis(host="127.0.0.1", port=closed, retry=no_retry)
    # A key of the wrong type under the ledger's index: its script fails (WRONGTYPE).
    await client.set(f"{ledger_prefix}:outcomes:pending", "not a sorted set")
    hub = EventHub()
    stats = hub.subscribe(Stats())

    async def charge() -> str:
        await asyncio.sleep(10)  # sent, never answered
        return "never"

    ledgers = [
        RedisOutcomeLedger(stalled, prefix="x", timeout=0.2, name="stalled"),
        RedisOutcomeLedger(refused, prefix="x", timeout=2.0, name="refused"),
        RedisOutcomeLedger(client, prefix=ledger_prefix, ttl=60),
    ]
    try:
        with caplog.at_level(logging.ERROR, logger="brownout"):
            for ledger in ledgers:
                shop = Dependency(
                    "shop", timeout=0.05, retry=RetryPolicy(1), ledger=ledger, events=hub
                )
                with pytest.raises(UnknownOutcome) as lost:
                    async with asyncio.timeout(5):  # the test's guard: nothing hangs
                        await shop.call(charge)
                key = lost.value.idempotency_key
                assert key is not None and lost.value.recorded is False
                assert any(key in note for note in lost.value.__notes__)
                assert key in caplog.text
        assert stats.ledger_write_failures == {
            ("shop", "stalled", "TimeoutError"): 1,
            ("shop", "refused", "ConnectionError"): 1,
            ("shop", ledger_prefix, "ResponseError"): 1,
        }

        await client.delete(f"{ledger_prefix}:outcomes:pending")  # the store answers again
        shop = Dependency("shop", timeout=0.05, retry=RetryPolicy(1), ledger=ledgers[2], events=hub)
        with pytest.raises(UnknownOutcome) as kept:
            await shop.call(charge)
        assert kept.value.recorded is True
        assert await ledgers[2].get(str(kept.value.idempotency_key)) is not None
        assert sum(stats.ledger_write_failures.values()) == 3
    finally:
        await stalled.aclose()
        await refused.aclose()
