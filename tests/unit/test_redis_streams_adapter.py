"""The Redis Streams adapter's checks that need no Redis: key names, arguments, ids (the
broker behaviour is in tests/integration/test_durable_redis_streams.py)."""

from __future__ import annotations

import asyncio

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

from brownout.durable import BacklogBound, Message  # noqa: E402
from brownout.integrations.redis_streams import (  # noqa: E402
    Consumer,
    ParkedStream,
    Producer,
    StreamKeys,
    stream_keys,
)


async def nothing(message: Message) -> None:
    return None


def test_a_queues_keys_share_one_hash_tag() -> None:
    assert stream_keys("orders") == StreamKeys("{orders}", "{orders}:retry", "{orders}:parked")
    assert stream_keys("app:{orders}").stream == "app:{orders}"  # already tagged: as given
    assert stream_keys("a{}b").stream == "{a{}b}"  # an empty tag is no tag for Redis Cluster
    # "{}" then a "}" later: Redis reads no tag (the first "}" closes it empty), so the
    # retry and parked keys would hash elsewhere; this was taken as tagged.
    assert stream_keys("a{}b}").stream == "{a{}b}}"
    with pytest.raises(ValueError):
        stream_keys("}x")  # cannot carry a tag
    with pytest.raises(ValueError):
        stream_keys("")


def test_bad_arguments_are_refused_before_any_redis_call() -> None:
    client = redis_asyncio.Redis(host="127.0.0.1", port=1)  # never contacted
    with pytest.raises(ValueError, match="group="):
        Producer(client, "q", bound=BacklogBound(max_depth=1))
    with pytest.raises(ValueError, match="ttl"):
        Producer(client, "q", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        ParkedStream(client, "q", timeout=float("nan"))
    for bad in ({"concurrency": 0}, {"claim_idle": 0}, {"block": 0}, {"parked_maxlen": 0}):
        with pytest.raises(ValueError):
            Consumer(client, "q", "g", nothing, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group"):
        Consumer(client, "q", "", nothing)


async def test_headers_brownout_owns_and_non_bytes_bodies_are_refused() -> None:
    producer = Producer(redis_asyncio.Redis(host="127.0.0.1", port=1), "q")
    for name in ("body", "brownout-attempt", "idempotency-key", "brownout-park-reason"):
        with pytest.raises(ValueError, match=name):
            await producer.publish(b"x", headers={name: "1"})
    with pytest.raises(TypeError):
        await producer.publish("text")  # type: ignore[arg-type]


async def test_a_parked_id_must_look_like_a_stream_id() -> None:
    parked = ParkedStream(redis_asyncio.Redis(host="127.0.0.1", port=1), "q")
    for bad in ("", "1", "1-", "-1", "1-0; DEL x", "+", "-"):
        with pytest.raises(ValueError, match="entry id"):
            await parked.get(bad)
        with pytest.raises(ValueError):
            await parked.purge([bad])
    with pytest.raises(ValueError, match="ttl"):
        await parked.replay(None, ttl=-1)


async def test_a_stop_before_the_run_starts_ends_it_at_once() -> None:
    consumer = Consumer(redis_asyncio.Redis(host="127.0.0.1", port=1), "q", "g", nothing)
    task = asyncio.create_task(consumer.run())
    await consumer.stop()
    await asyncio.wait_for(task, 2)
