"""Durable queues on a real Redis Streams (``BROWNOUT_TEST_REDIS``, 127.0.0.1:6379): nothing
lost, bounded producers, parking you can work with, and Redis failures that never hang (issue 26).

Each test uses its own stream (a unique name) and deletes its keys at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from tests import services

from brownout import Bulkhead, ExponentialBackoff, Priority, Reason, Rejected, UnknownOutcome
from brownout.durable import BacklogBound, Message, MessagePolicy
from brownout.limits import FixedLimit

redis_asyncio = pytest.importorskip("redis.asyncio")
ClusterNode = pytest.importorskip("redis.asyncio.cluster").ClusterNode

from brownout.integrations.redis_streams import (  # noqa: E402
    BODY_FIELD,
    Consumer,
    ParkedStream,
    Producer,
    StreamUnavailable,
    stream_keys,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("streams_worker.py")
FAST = ExponentialBackoff(0.02, cap=0.05)


@pytest.fixture
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A client of the shared Redis, or (``on_both`` tests) of the session's Redis Cluster."""
    client: Any
    if getattr(request, "param", "single") == "single":
        server: services.Service = request.getfixturevalue("redis_server")
        client = redis_asyncio.Redis(host=server.host, port=server.port, socket_timeout=5)
    else:
        nodes: list[tuple[str, int]] = request.getfixturevalue("redis_cluster")
        client = redis_asyncio.RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes], socket_timeout=5
        )
    yield client
    await client.aclose()


on_both = pytest.mark.parametrize("redis", ["single", "cluster"], indirect=True)
"""Run a test on one Redis and on a three-node Redis Cluster: each script's keys (stream,
retry set, parked stream) share the queue's hash tag, so each touches one slot."""


@pytest.fixture
async def name(redis: Any) -> AsyncIterator[str]:
    stream = f"test-streams-{uuid.uuid4().hex[:12]}"
    yield stream
    keys = stream_keys(stream)
    await redis.delete(keys.stream, keys.retry, keys.parked, f"{stream}:done", f"{stream}:att")


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.05)


async def queued(redis: Any, name: str) -> int:
    keys = stream_keys(name)
    return int(await redis.xlen(keys.stream)) + int(await redis.zcard(keys.retry))


async def parked_by_reason(redis: Any, name: str) -> Counter[str]:
    parked = await ParkedStream(redis, name).list(limit=100_000)
    return Counter(p.reason for p in parked)


@contextlib.asynccontextmanager
async def running(consumer: Consumer) -> AsyncIterator[Consumer]:
    task = asyncio.create_task(consumer.run())
    try:
        yield consumer
    finally:
        await asyncio.wait_for(consumer.stop(grace=5.0), 15)
        await asyncio.wait_for(task, 5)


# -- nothing lost --------------------------------------------------------------------------------


@on_both
async def test_every_message_is_completed_parked_or_still_queued(redis: Any, name: str) -> None:
    n = 200
    producer = Producer(redis, name)
    for i in range(n):
        slow = i % 10 == 3
        await producer.publish(b"m", headers={"n": str(i)}, ttl=0.5 if slow else 60)
    completed: list[int] = []

    async def handle(message: Message) -> None:
        i = int(message.headers["n"])
        await asyncio.sleep(0.001)
        if i % 10 == 1 and message.attempt == 1:
            raise ConnectionError("flaky dependency")  # transient: retried, then done
        if i % 10 == 2:
            raise ValueError("cannot be processed")  # permanent: parked failed
        if i % 10 == 3:
            await asyncio.sleep(5)  # past its 0.5 s deadline: cut, parked expired
        if i % 10 == 4:
            raise ConnectionError("always down")  # out of attempts
        completed.append(i)

    policy = MessagePolicy(max_attempts=3, backoff=FAST)
    consumer = Consumer(redis, name, "workers", handle, policy=policy, concurrency=32, block=0.1)
    async with running(consumer):
        await until(lambda: _at_least(completed, 40))
    # stopped midway: every message is somewhere, none twice
    parked = await parked_by_reason(redis, name)
    assert len(completed) + sum(parked.values()) + await queued(redis, name) == n
    assert len(set(completed)) == len(completed)

    async with running(Consumer(redis, name, "workers", handle, policy=policy, block=0.1)):

        async def all_settled() -> bool:
            settled = len(completed) + sum((await parked_by_reason(redis, name)).values())
            return settled == n

        await until(all_settled, 60)
    assert await queued(redis, name) == 0  # acknowledged entries are deleted
    parked = await parked_by_reason(redis, name)
    assert parked == Counter({"failed": 20, "expired": 20, "attempts": 20})
    assert sorted(completed) == [i for i in range(n) if i % 10 not in (2, 3, 4)]


async def _at_least(items: list[int], count: int) -> bool:
    return len(items) >= count


async def test_consumers_killed_mid_handler_lose_nothing(redis: Any, name: str) -> None:
    n = 400
    producer = Producer(redis, name)
    for i in range(n):
        await producer.publish(b"m", headers={"n": str(i)}, ttl=120)
    done_key, attempts_key = f"{name}:done", f"{name}:att"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}

    async def done() -> int:
        return int(await redis.scard(done_key))

    for round_ in range(2):
        before = await done()
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            name,
            "workers",
            f"doomed-{round_}",
            done_key,
            attempts_key,
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert worker.stdout is not None
            await asyncio.wait_for(worker.stdout.readline(), 30)

            async def progressed(start: int = before) -> bool:
                return await done() >= start + 60

            await until(progressed, 60)
        finally:
            worker.send_signal(signal.SIGKILL)  # mid-handler: 8 entries in flight
            await worker.wait()
    assert await done() < n
    summary = await redis.xpending(stream_keys(name).stream, "workers")
    assert summary["pending"] > 0  # the killed consumers held entries

    async def handle(message: Message) -> None:
        await redis.rpush(attempts_key, f"{message.headers['n']}:{message.attempt}")
        await redis.sadd(done_key, message.headers["n"])

    survivor = Consumer(
        redis, name, "workers", handle, policy=MessagePolicy(max_attempts=10), claim_idle=1.0
    )
    async with running(survivor):

        async def finished() -> bool:
            return await done() == n and await queued(redis, name) == 0

        await until(finished, 90)
    assert await redis.xlen(stream_keys(name).parked) == 0  # published = completed, none lost
    attempts = [a.decode().split(":") for a in await redis.lrange(attempts_key, 0, -1)]
    assert {int(i) for i, _ in attempts} == set(range(n))
    # claimed entries carry their earlier deliveries as attempts (XPENDING times delivered)
    assert max(int(a) for _, a in attempts) >= 2


async def test_a_dead_consumers_entries_are_claimed_with_their_deliveries(
    redis: Any, name: str
) -> None:
    producer = Producer(redis, name)
    for i in range(3):
        await producer.publish(b"m", headers={"n": str(i)})
    stream = stream_keys(name).stream
    await redis.xgroup_create(stream, "workers", id="0")
    taken = await redis.xreadgroup("workers", "dead", {stream: ">"}, count=3)
    assert len(taken[0][1]) == 3  # delivered to a consumer that then died
    seen: list[tuple[str, int, int]] = []

    async def handle(message: Message) -> None:
        seen.append((message.headers["n"], message.attempt, message.delivery.redeliveries))

    async with running(Consumer(redis, name, "workers", handle, claim_idle=0.3, block=0.1)):
        await until(lambda: _at_least(seen, 3), 10)  # type: ignore[arg-type]
    assert sorted(seen) == [("0", 2, 1), ("1", 2, 1), ("2", 2, 1)]
    assert (await redis.xpending(stream, "workers"))["pending"] == 0


# -- reads in step with the bulkhead -------------------------------------------------------------


async def test_a_consumer_never_reads_more_than_its_bulkhead_can_start(
    redis: Any, name: str
) -> None:
    producer = Producer(redis, name)
    for i in range(10):
        await producer.publish(b"m", headers={"n": str(i)})
    release = asyncio.Event()
    started: list[str] = []

    async def handle(message: Message) -> None:
        started.append(message.headers["n"])
        await release.wait()

    bulkhead = Bulkhead("stream-workers", FixedLimit(3))
    consumer = Consumer(redis, name, "workers", handle, bulkhead=bulkhead, block=0.1)
    async with running(consumer):
        await until(lambda: _at_least(started, 3), 10)  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # several read loops while full
        summary = await redis.xpending(stream_keys(name).stream, "workers")
        assert summary["pending"] == 3 and len(started) == 3
        release.set()
        await until(lambda: _at_least(started, 10), 10)  # type: ignore[arg-type]


# -- the producer's bound ------------------------------------------------------------------------


@on_both
async def test_a_producer_over_its_depth_bound_is_refused_but_exempt_work_passes(
    redis: Any, name: str
) -> None:
    bound = BacklogBound(max_depth=5, exempt=Priority.CRITICAL_PLUS)
    producer = Producer(redis, name, group="workers", bound=bound, refresh=0)
    for i in range(5):
        await producer.publish(b"m", headers={"n": str(i)})
    assert (await producer.measure())[0] == 5
    with pytest.raises(Rejected) as refused:
        await producer.publish(b"m")
    assert refused.value.reason is Reason.BACKLOG_FULL
    await producer.publish(b"urgent", priority=Priority.CRITICAL_PLUS)
    assert await redis.xlen(stream_keys(name).stream) == 6


async def test_a_producer_over_its_age_bound_is_refused(redis: Any, name: str) -> None:
    producer = Producer(redis, name, group="workers", bound=BacklogBound(max_age=0.3), refresh=0)
    await producer.publish(b"first")
    await asyncio.sleep(0.4)
    depth, age = await producer.measure()
    assert depth == 1 and age is not None and 0.3 <= age < 5
    with pytest.raises(Rejected) as refused:
        await producer.publish(b"second")
    assert refused.value.reason is Reason.BACKLOG_FULL
    # delivered but not acknowledged still counts: the age is the pending entry's
    stream = stream_keys(name).stream
    await redis.xreadgroup("workers", "slow", {stream: ">"}, count=1)
    depth, age = await producer.measure()
    assert depth == 1 and age is not None and age >= 0.3


# -- bad input -----------------------------------------------------------------------------------


@on_both
async def test_malformed_entries_are_parked_and_the_consumer_keeps_going(
    redis: Any, name: str
) -> None:
    stream = stream_keys(name).stream
    producer = Producer(redis, name)
    await producer.publish(b"good-1", headers={"n": "1"})
    await redis.xadd(stream, {"foreign": b"\xff\xfe", BODY_FIELD: b"raw"})  # no envelope
    await redis.xadd(stream, {"brownout-enqueued-at": "yesterday", BODY_FIELD: b"x"})
    await producer.publish(b"good-2", headers={"n": "2"})
    done: list[bytes] = []

    async def handle(message: Message) -> None:
        done.append(message.body)

    async with running(Consumer(redis, name, "workers", handle, block=0.1)):
        await until(lambda: _at_least(done, 2), 10)  # type: ignore[arg-type]
        await until(lambda: _count_parked(redis, name, 2), 10)
    assert sorted(done) == [b"good-1", b"good-2"]
    parked = sorted(await ParkedStream(redis, name).list(reason="malformed"), key=lambda p: p.body)
    assert [p.body for p in parked] == [b"raw", b"x"]  # (parked concurrently: in any order)
    assert parked[0].envelope is None and parked[0].headers["foreign"] == "\udcff\udcfe"
    assert "brownout-enqueued-at" in parked[1].detail


async def _count_parked(redis: Any, name: str, count: int) -> bool:
    return int(await redis.xlen(stream_keys(name).parked)) >= count


# -- parking you can work with -------------------------------------------------------------------


@on_both
async def test_parked_messages_are_listed_shown_replayed_and_purged(redis: Any, name: str) -> None:
    producer = Producer(redis, name)
    for i in range(4):
        await producer.publish(b"body-%d" % i, headers={"n": str(i)}, idempotency_key=f"k{i}")
    runs: list[tuple[str, int, tuple[str, ...]]] = []

    async def handle(message: Message) -> None:
        runs.append(
            (
                message.headers["n"],
                message.attempt,
                tuple(h.event for h in message.envelope.history),
            )
        )
        if len(message.envelope.history) == 0:
            raise ValueError("no")

    async with running(Consumer(redis, name, "workers", handle, block=0.1)):
        await until(lambda: _count_parked(redis, name, 4), 10)
    parked_stream = ParkedStream(redis, name)
    parked = await parked_stream.list()
    assert [p.reason for p in parked] == ["failed"] * 4
    # Parked in the order their concurrent handlers failed (on a cluster, not publish order).
    parked = sorted(parked, key=lambda p: p.headers["n"])
    first = parked[0]
    assert first.body == b"body-0" and first.headers["n"] == "0"
    assert first.envelope is not None and first.envelope.idempotency_key == "k0"
    assert first.parked_at is not None and abs(first.parked_at - time.time()) < 30
    assert await parked_stream.get(first.id) == first
    assert await parked_stream.get("1-0") is None
    with pytest.raises(ValueError):
        await parked_stream.get("not-an-id")
    listed = await parked_stream.list()
    assert await parked_stream.list(limit=2, reason="failed") == listed[:2]
    assert await parked_stream.list(reason="expired") == []

    assert await parked_stream.replay([first.id, parked[1].id], ttl=30) == 2
    assert await parked_stream.replay([first.id], ttl=30) == 0  # already replayed
    assert await parked_stream.count() == 2
    runs.clear()
    async with running(Consumer(redis, name, "workers", handle, block=0.1)):
        await until(lambda: _at_least(runs, 2), 10)  # type: ignore[arg-type]
    assert sorted(runs) == [
        ("0", 1, ("parked", "replayed")),
        ("1", 1, ("parked", "replayed")),
    ]
    assert await parked_stream.purge([parked[2].id]) == 1
    assert await parked_stream.purge(None) == 1
    assert await parked_stream.list() == []


@on_both
async def test_a_retry_waits_in_the_retry_set_then_runs_again(redis: Any, name: str) -> None:
    producer = Producer(redis, name)
    await producer.publish(b"m", headers={"n": "0"}, ttl=60)
    keys = stream_keys(name)
    attempts: list[int] = []

    async def handle(message: Message) -> None:
        attempts.append(message.attempt)
        if message.attempt == 1:
            raise ConnectionError("later")

    slow = MessagePolicy(backoff=ExponentialBackoff(0.6, cap=0.6, jitter=False))
    async with running(Consumer(redis, name, "workers", handle, policy=slow, block=0.1)):
        await until(lambda: _at_least(attempts, 1), 10)  # type: ignore[arg-type]
        await until(lambda: _zcard(redis, keys.retry, 1), 5)
        assert await redis.xlen(keys.stream) == 0  # the original was acknowledged with it
        await until(lambda: _at_least(attempts, 2), 10)  # type: ignore[arg-type]
    assert attempts == [1, 2]
    assert await redis.zcard(keys.retry) == 0 and await redis.xlen(keys.stream) == 0


async def _zcard(redis: Any, key: str, count: int) -> bool:
    return int(await redis.zcard(key)) == count


# -- Redis unreachable or stalled ----------------------------------------------------------------


async def test_an_unreachable_redis_is_a_typed_error_quickly() -> None:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # nothing listens on port 1; this client does not retry connecting
    client = redis_asyncio.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    default = redis_asyncio.Redis(host="127.0.0.1", port=1)  # retries for ~3 s
    try:
        started = time.monotonic()
        with pytest.raises(StreamUnavailable):
            await Producer(client, "nowhere", timeout=2.0).publish(b"m")
        with pytest.raises(StreamUnavailable):
            await ParkedStream(client, "nowhere", timeout=2.0).list()
        assert time.monotonic() - started < 2
        started = time.monotonic()
        # its retries outlast the timeout: the XADD's outcome reads as unknown
        with pytest.raises((StreamUnavailable, UnknownOutcome)):
            await Producer(default, "nowhere", timeout=1.0).publish(b"m")
        assert time.monotonic() - started < 3
    finally:
        await client.aclose()
        await default.aclose()


async def test_a_stalled_redis_never_hangs_a_producer_or_a_consumer() -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(4096):
                pass  # accepts and never answers
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = redis_asyncio.Redis(host="127.0.0.1", port=port)
    try:
        producer = Producer(client, "stalled", timeout=0.3)
        started = time.monotonic()
        with pytest.raises(UnknownOutcome) as unknown:
            await producer.publish(b"m", idempotency_key="key-1")
        assert unknown.value.idempotency_key == "key-1"
        bounded = Producer(
            client, "stalled", group="g", bound=BacklogBound(max_depth=1), timeout=0.3
        )
        with pytest.raises(UnknownOutcome):  # the backlog is unknown, the send times out
            await bounded.publish(b"m")
        assert time.monotonic() - started < 5

        async def never(message: Message) -> None:  # pragma: no cover - never delivered
            raise AssertionError("a stalled Redis delivered a message")

        consumer = Consumer(client, "stalled", "g", never, timeout=0.3, block=0.1)
        task = asyncio.create_task(consumer.run())
        await asyncio.sleep(1.0)
        assert not task.done()  # still trying, with backoff
        started = time.monotonic()
        await asyncio.wait_for(consumer.stop(), 10)
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - started < 5
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


def test_a_client_that_decodes_responses_is_refused() -> None:
    client = redis_asyncio.Redis(decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        Producer(client, "x")
