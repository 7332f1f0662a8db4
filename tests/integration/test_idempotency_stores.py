"""The idempotency stores on the real Redis and PostgreSQL: the same decisions as in memory,
one round trip per Redis decision, Cluster-safe key names, outages, and exactly-once against
PostgreSQL (N concurrent and retried requests with one key write one row)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tests import services

from brownout.idempotency import (
    Idempotency,
    IdempotentAnswer,
    PostgresIdempotencyStore,
    RedisIdempotencyStore,
    Ticket,
    transaction,
)

pytestmark = pytest.mark.integration

redis_asyncio = pytest.importorskip("redis.asyncio")
asyncpg = pytest.importorskip("asyncpg")


@pytest.fixture
async def redis_store(redis_server: services.Service) -> AsyncIterator[RedisIdempotencyStore]:
    client = redis_asyncio.Redis(host=redis_server.host, port=redis_server.port)
    yield RedisIdempotencyStore(client, prefix=f"test:idem:{uuid.uuid4().hex[:8]}:")
    await client.aclose()


@pytest.fixture
async def pg_pool(postgres_server: services.Service) -> AsyncIterator[Any]:
    pool = await asyncpg.create_pool(
        host=postgres_server.host,
        port=postgres_server.port,
        user="postgres",
        database="test",
        min_size=1,
        max_size=12,
    )
    yield pool
    await pool.close()


@pytest.fixture
async def pg_store(pg_pool: Any) -> AsyncIterator[PostgresIdempotencyStore]:
    table = f"idem_{uuid.uuid4().hex[:8]}"
    store = PostgresIdempotencyStore(pg_pool, table=table)
    await store.setup()
    await pg_pool.execute(f"CREATE TABLE {table}_effects (key text, amount int)")
    yield store
    await pg_pool.execute(f"DROP TABLE {table}")
    await pg_pool.execute(f"DROP TABLE {table}_effects")


async def begin(idem: Idempotency, key: str = "k", body: bytes = b"{}", **kw: Any) -> Any:
    return await idem.begin(
        method="POST", target="/pay", operation="/pay", key=key, body=body, caller="c", **kw
    )


async def states(idem: Idempotency) -> None:
    """run, 409 while running, store, replay byte for byte, 422, release then run again."""
    first = await begin(idem)
    assert isinstance(first, Ticket)
    busy = await begin(idem)
    assert isinstance(busy, IdempotentAnswer) and busy.status == 409
    await first.complete(201, [("content-type", "application/json")], b'{"id": 1}\x00\xff')
    replay = await begin(idem)
    assert isinstance(replay, IdempotentAnswer) and replay.replayed
    assert (replay.status, replay.body) == (201, b'{"id": 1}\x00\xff')
    assert replay.headers[0] == ("content-type", "application/json")
    other = await begin(idem, body=b'{"x": 1}')
    assert isinstance(other, IdempotentAnswer) and other.status == 422
    crash = await begin(idem, key="k2")
    assert isinstance(crash, Ticket)
    await crash.release()
    again = await begin(idem, key="k2")
    assert isinstance(again, Ticket)
    await again.release()


async def test_redis_store_decides_like_memory(redis_store: RedisIdempotencyStore) -> None:
    await states(Idempotency(redis_store))
    # begin and complete are one round trip each
    idem = Idempotency(redis_store)
    before = redis_store.calls
    ticket = await begin(idem, key="one-trip")
    await ticket.complete(200, [], b"ok")
    await begin(idem, key="one-trip")
    assert redis_store.calls - before == 3


async def test_redis_keys_carry_a_hash_tag_and_expire(redis_store: RedisIdempotencyStore) -> None:
    idem = Idempotency(redis_store, ttl=30.0, lease_margin=0.0)
    ticket = await begin(idem, remaining=5.0)
    assert isinstance(ticket, Ticket)
    client = redis_store._client
    names = [n async for n in client.scan_iter(match=f"{redis_store.prefix}*")]
    assert len(names) == 1
    name = names[0].decode()
    tag = name[name.index("{") + 1 : name.index("}")]
    assert len(tag) == 64  # the whole store key: its slot is the record's
    assert 4000 < await client.pttl(name) <= 5000  # the lease
    await ticket.complete(200, [], b"ok")
    assert 29_000 < await client.pttl(name) <= 30_000  # the answer's ttl


async def test_redis_lease_ends_then_a_later_attempt_runs(
    redis_store: RedisIdempotencyStore,
) -> None:
    idem = Idempotency(redis_store, lease_margin=0.0)
    ticket = await begin(idem, remaining=0.3)
    assert isinstance(ticket, Ticket)
    ticket.abandon()  # cancelled: locked until the lease ends
    busy = await begin(idem, remaining=0.3)
    assert isinstance(busy, IdempotentAnswer) and busy.status == 409
    await asyncio.sleep(0.6)
    retry = await begin(idem, remaining=5.0)
    assert isinstance(retry, Ticket)
    await ticket.complete(200, [], b"late")  # the first run's lease is gone: not stored
    await retry.complete(200, [], b"retry")
    replay = await begin(idem)
    assert isinstance(replay, IdempotentAnswer) and replay.body == b"retry"


async def test_redis_outage_fails_closed_or_open() -> None:
    client = redis_asyncio.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    store = RedisIdempotencyStore(client, timeout=0.5)
    closed = await begin(Idempotency(store))
    assert isinstance(closed, IdempotentAnswer) and closed.status == 503
    assert json.loads(closed.body)["reason"] == "dependency_unavailable"
    assert await begin(Idempotency(store, on_outage="open")) is None
    await client.aclose()


async def test_postgres_store_decides_like_memory(pg_store: PostgresIdempotencyStore) -> None:
    await states(Idempotency(pg_store))


async def pay(idem: Idempotency, store: PostgresIdempotencyStore, key: str, fail: bool) -> Any:
    """One request: write the effect through the store's transaction, then answer."""
    result = await begin(idem, key=key, body=b'{"amount": 5}')
    if not isinstance(result, Ticket):
        return result
    try:
        await transaction().execute(f"INSERT INTO {store.table}_effects VALUES ($1, 5)", key)
        await asyncio.sleep(0.05)
        if fail:
            raise RuntimeError("crashed after writing its effect")
    except BaseException:
        await result.release()
        raise
    await result.complete(200, [], b"paid")
    return "ran"


async def test_postgres_exactly_once_under_concurrent_and_retried_requests(
    pg_store: PostgresIdempotencyStore, pg_pool: Any
) -> None:
    idem = Idempotency(pg_store)
    # a crash after the write rolls the write back with the key: the retry runs at once
    with pytest.raises(RuntimeError):
        await pay(idem, pg_store, "once", fail=True)
    count = f"SELECT count(*) FROM {pg_store.table}_effects WHERE key = 'once'"
    assert await pg_pool.fetchval(count) == 0
    results = await asyncio.gather(*(pay(idem, pg_store, "once", False) for _ in range(8)))
    ran = [r for r in results if r == "ran"]
    busy = [r for r in results if isinstance(r, IdempotentAnswer) and r.status == 409]
    assert len(ran) == 1 and len(ran) + len(busy) == 8
    for _ in range(3):  # retries after it committed get the stored answer
        replay = await pay(idem, pg_store, "once", False)
        assert isinstance(replay, IdempotentAnswer) and replay.body == b"paid"
    assert await pg_pool.fetchval(count) == 1


async def test_postgres_cancelled_handler_rolls_back_and_frees_the_key(
    pg_store: PostgresIdempotencyStore, pg_pool: Any
) -> None:
    idem = Idempotency(pg_store)
    ticket = await begin(idem, key="cancelled")
    assert isinstance(ticket, Ticket)
    await ticket.connection.execute(f"INSERT INTO {pg_store.table}_effects VALUES ('c', 1)")
    ticket.abandon()
    for _ in range(50):
        retry = await begin(idem, key="cancelled")
        if isinstance(retry, Ticket):
            break
        await asyncio.sleep(0.02)
    assert isinstance(retry, Ticket)
    await retry.release()
    assert await pg_pool.fetchval(f"SELECT count(*) FROM {pg_store.table}_effects") == 0


async def test_redis_store_decides_like_memory_on_a_redis_cluster(
    redis_cluster: list[tuple[str, int]],
) -> None:
    """Each decision's keys share one hash slot: the scripts run on a real three-node cluster
    (a cross-slot script fails there with "keys in request don't hash to the same slot")."""
    host, port = redis_cluster[0]
    client = redis_asyncio.RedisCluster(host=host, port=port)
    try:
        store = RedisIdempotencyStore(client, prefix=f"test:idem:{uuid.uuid4().hex[:8]}:")
        for i in range(12):  # keys land on every node of the cluster
            idem = Idempotency(store)
            first = await begin(idem, key=f"cluster-{i}")
            assert isinstance(first, Ticket)
            await first.complete(201, [], b"paid")
            replay = await begin(idem, key=f"cluster-{i}")
            assert isinstance(replay, IdempotentAnswer) and replay.body == b"paid"
        await states(Idempotency(store))
    finally:
        await client.aclose()
