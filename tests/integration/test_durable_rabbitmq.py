"""Durable queues on a real RabbitMQ (127.0.0.1:5672 or ``BROWNOUT_TEST_RABBITMQ``) through
`brownout.integrations.aio_pika`: every message published is completed, parked (by reason) or
still queued; a consumer killed mid-handler loses nothing; the producer is refused over its
bound; malformed messages are parked and the consumer keeps going.

Each test uses queues of its own (a random name), deleted at teardown.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

aio_pika = pytest.importorskip("aio_pika")

from tests import services  # noqa: E402

from brownout import Bulkhead, Priority, Reason, Rejected  # noqa: E402
from brownout.durable import BacklogBound, Message, MessagePolicy, ParkReason  # noqa: E402
from brownout.integrations.aio_pika import (  # noqa: E402
    RETRY_DELAYS,
    Consumer,
    NotConfirmed,
    ParkedQueue,
    Producer,
    declare,
    retry_queue,
)
from brownout.limits import FixedLimit  # noqa: E402
from brownout.testing import ManualClock  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("rabbitmq_server")]

URL = f"amqp://guest:guest@{services.RABBITMQ.address}/"
HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def fast_policy(**kw: object) -> MessagePolicy:
    from brownout._retry import ExponentialBackoff

    return MessagePolicy(backoff=ExponentialBackoff(0.05, cap=0.1), **kw)  # type: ignore[arg-type]


@pytest.fixture
async def channel() -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(URL)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"bo-test-{secrets.token_hex(4)}"
    yield name
    connection = await aio_pika.connect(URL)
    try:
        ch = await connection.channel()
        names = [name, f"{name}.parked", *(retry_queue(name, d)[0] for d in RETRY_DELAYS)]
        for n in names:
            await ch.queue_delete(n)
    finally:
        await connection.close()


async def depth(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def until(check: Callable[[], Awaitable[bool] | bool], timeout: float) -> None:
    stop = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < stop, "timed out waiting"
        await asyncio.sleep(0.05)


async def test_every_message_is_completed_parked_or_queued(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    await declare(channel, queue)  # idempotent
    producer = Producer(channel, queue, ttl=1.5)
    n = 40
    keys = [f"m{i}" for i in range(n)]
    for key in keys:
        await producer.publish(key.encode(), idempotency_key=key, headers={"x-mine": "kept"})
    assert await depth(channel, queue) == n

    completed: list[tuple[str, int]] = []

    async def handle(message: Message) -> None:
        i = int(message.body[1:])
        assert message.headers.get("x-mine") in ("kept", b"kept")
        if i % 4 == 1 and message.attempt == 1:
            raise ConnectionError("transient")
        if i % 4 == 2:
            raise ValueError("permanent")
        if i % 4 == 3:
            await asyncio.sleep(30)  # past the 1.5 s deadline: cut and parked
        completed.append((message.body.decode(), message.attempt))

    consumer = Consumer(
        channel, queue, handle, policy=fast_policy(), bulkhead=Bulkhead("consumer", FixedLimit(20))
    )
    running = asyncio.ensure_future(consumer.run())
    parked = ParkedQueue(channel, queue)
    await until(lambda: len(completed) == n // 2, 20)
    await until(async_count_is(channel, f"{queue}.parked", n // 2), 20)
    await consumer.stop()
    await asyncio.wait_for(running, 15)

    done = {k for k, _ in completed}
    assert done == {k for k in keys if int(k[1:]) % 4 in (0, 1)}
    assert {a for k, a in completed if int(k[1:]) % 4 == 1} == {2}  # the retry, attempt 2
    listed = await parked.list(limit=1000)
    by_reason = Counter(p.reason for p in listed)
    assert by_reason == {ParkReason.FAILED.value: n // 4, ParkReason.EXPIRED.value: n // 4}
    assert all(p.headers.get("x-mine") == "kept" for p in listed)
    assert all(p.envelope is not None and p.parked_at is not None for p in listed)
    # published = completed + parked + still queued
    assert len(done) + len(listed) + await depth(channel, queue) == n
    # listing kept them (a passive declare's count lags a moment behind a nack-requeue)
    await until(async_count_is(channel, f"{queue}.parked", n // 2), 5)
    assert len(await parked.list(limit=1000)) == n // 2


def async_count_is(
    channel: aio_pika.abc.AbstractChannel, name: str, n: int
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await depth(channel, name) == n

    return check


async def test_a_consumer_killed_twice_mid_handler_loses_nothing(
    channel: aio_pika.abc.AbstractChannel, queue: str, tmp_path: Path
) -> None:
    await declare(channel, queue)
    producer = Producer(channel, queue, ttl=600)
    n = 300
    log = tmp_path / "completed.log"
    log.touch()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def lines() -> list[str]:
        return log.read_text().splitlines()

    async def flow() -> None:  # messages keep arriving while consumers die
        for i in range(n):
            await producer.publish(f"m{i}".encode(), idempotency_key=f"m{i}")
            await asyncio.sleep(0.002)

    async def spawn() -> asyncio.subprocess.Process:
        script = str(HERE / "rabbit_consumer.py")
        return await asyncio.create_subprocess_exec(
            sys.executable, script, queue, str(log), env=env
        )

    feeding = asyncio.ensure_future(flow())
    for kill_after in (40, 110):
        proc = await spawn()
        try:
            await until(lambda k=kill_after: len(lines()) >= k, 60)
        finally:
            proc.send_signal(signal.SIGKILL)  # mid-handler: 4 messages in flight
            await asyncio.wait_for(proc.wait(), 10)
    await feeding

    proc = await spawn()
    try:
        await until(lambda: len({x.split()[0] for x in lines()}) >= n, 90)
        await until(async_count_is(channel, queue, 0), 10)
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)

    entries = [x.split() for x in lines()]
    completed = {k for k, _ in entries}
    parked = await depth(channel, f"{queue}.parked")
    assert len(completed) + parked == n and parked == 0  # zero lost
    # at-least-once: what a killed consumer ran again is visible by key and attempt
    assert any(int(a) > 1 for _, a in entries), "the kills left no message to redeliver"
    twice = [k for k, c in Counter(k for k, _ in entries).items() if c > 1]
    assert all(max(int(a) for kk, a in entries if kk == k) > 1 for k in twice), (
        "a duplicate must carry a later attempt number"
    )


async def test_the_producer_is_refused_over_its_depth_bound_unless_exempt(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    clock = ManualClock()
    bound = BacklogBound(max_depth=5, exempt=Priority.CRITICAL_PLUS)
    producer = Producer(channel, queue, bound=bound, refresh=1.0, clock=clock)
    for i in range(5):
        clock.advance(2)  # a fresh reading each time
        await producer.publish(f"m{i}".encode(), priority=Priority.CRITICAL)
    clock.advance(2)
    with pytest.raises(Rejected) as refused:
        await producer.publish(b"one too many", priority=Priority.CRITICAL)
    assert refused.value.reason is Reason.BACKLOG_FULL
    assert await depth(channel, queue) == 5
    await producer.publish(b"health", priority=Priority.CRITICAL_PLUS)
    assert await depth(channel, queue) == 6
    assert await producer.backlog() == (6, None)  # RabbitMQ gives no oldest age


async def test_malformed_messages_are_parked_and_the_consumer_keeps_going(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    ex = channel.default_exchange
    await ex.publish(aio_pika.Message(b"no envelope"), routing_key=queue)
    await ex.publish(
        aio_pika.Message(
            b"garbage",
            headers={"brownout-enqueued-at": "yesterday", "brownout-attempt": "-3", "n": 7},
        ),
        routing_key=queue,
    )
    await ex.publish(
        aio_pika.Message(b"binary", headers={"brownout-enqueued-at": bytearray(b"\xff\xfe")}),
        routing_key=queue,
    )
    await Producer(channel, queue).publish(b"good")
    ran: list[bytes] = []

    async def handle(message: Message) -> None:
        ran.append(message.body)

    consumer = Consumer(channel, queue, handle)
    running = asyncio.ensure_future(consumer.run())
    await until(async_count_is(channel, f"{queue}.parked", 3), 10)
    await until(lambda: ran == [b"good"], 10)
    await consumer.stop()
    await asyncio.wait_for(running, 10)
    listed = await ParkedQueue(channel, queue).list()
    assert sorted(p.body for p in listed) == [b"binary", b"garbage", b"no envelope"]
    assert {p.reason for p in listed} == {"malformed"}
    garbage = next(p for p in listed if p.body == b"garbage")
    assert "brownout-enqueued-at" in garbage.detail and garbage.envelope is None
    assert consumer.failures == 0


async def test_parked_messages_can_be_listed_shown_replayed_and_purged(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    producer = Producer(channel, queue, ttl=60)
    for i in range(4):
        await producer.publish(f"m{i}".encode(), idempotency_key=f"k{i}", headers={"tenant": "t1"})
    fail = True
    done: list[Message] = []

    async def handle(message: Message) -> None:
        if fail:
            raise ValueError("bad input")
        done.append(message)

    consumer = Consumer(channel, queue, handle)
    running = asyncio.ensure_future(consumer.run())
    await until(async_count_is(channel, f"{queue}.parked", 4), 10)

    parked = ParkedQueue(channel, queue)
    listed = await parked.list()
    assert [p.body for p in listed] == [b"m0", b"m1", b"m2", b"m3"]  # order kept
    assert await parked.list(reason="expired") == []
    assert len(await parked.list(limit=2)) == 2
    one = await parked.get(listed[1].id)
    assert one is not None and one.body == b"m1" and "ValueError" in one.detail
    assert await parked.get("no-such-id") is None

    fail = False
    assert await parked.replay([listed[1].id], ttl=30) == 1
    await until(lambda: len(done) == 1, 10)
    again = done[0]
    assert again.body == b"m1" and again.attempt == 1 and again.idempotency_key == "k1"
    assert again.headers.get("tenant") in ("t1", b"t1")  # the user's headers kept
    assert not any(k.startswith("brownout-park") for k in again.headers)
    assert [h.event for h in again.envelope.history][-2:] == ["parked", "replayed"]
    assert again.envelope.valid_until is not None
    assert again.envelope.valid_until - again.envelope.enqueued_at == pytest.approx(30)

    assert await parked.purge([listed[0].id]) == 1
    assert [p.body for p in await parked.list()] == [b"m2", b"m3"]
    assert await parked.purge(None) == 2
    assert await parked.list() == []
    await consumer.stop()
    await asyncio.wait_for(running, 10)


async def test_stop_lets_running_handlers_finish_and_acks_them(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    producer = Producer(channel, queue)
    for i in range(3):
        await producer.publish(f"m{i}".encode())
    started, finished = asyncio.Event(), []

    async def handle(message: Message) -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.append(message.body)

    consumer = Consumer(channel, queue, handle, bulkhead=Bulkhead("consumer", FixedLimit(3)))
    running = asyncio.ensure_future(consumer.run())
    await asyncio.wait_for(started.wait(), 10)
    assert consumer.prefetch == 3
    await consumer.stop()
    await asyncio.wait_for(running, 10)
    assert sorted(finished) == [b"m0", b"m1", b"m2"]
    await channel.close()
    connection = await aio_pika.connect(URL)
    try:
        assert await depth(await connection.channel(), queue) == 0  # all acked
    finally:
        await connection.close()


async def test_a_handler_cut_by_stop_goes_back_to_the_queue(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    await Producer(channel, queue).publish(b"stuck")
    started = asyncio.Event()

    async def handle(message: Message) -> None:
        started.set()
        await asyncio.sleep(60)

    consumer = Consumer(channel, queue, handle, stop_timeout=0.2)
    running = asyncio.ensure_future(consumer.run())
    await asyncio.wait_for(started.wait(), 10)
    await consumer.stop()
    await asyncio.wait_for(running, 10)
    await until(async_count_is(channel, queue, 1), 10)


async def test_an_unroutable_publish_is_not_confirmed(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    with pytest.raises(NotConfirmed, match="unroutable"):
        await Producer(channel, queue).publish(b"nowhere")
    connection = await aio_pika.connect(URL)
    ch = await connection.channel()
    await connection.close()
    with pytest.raises(NotConfirmed):
        await Producer(ch, queue).publish(b"closed")


async def test_prefetch_follows_an_adaptive_limit(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)

    class Moving:  # an adaptive limit whose next value the test sets
        adaptive = True
        value = 2

        @property
        def limit(self) -> int:
            return self.value

        def on_sample(self, start: float, rtt: float, in_flight: int, dropped: bool) -> int:
            return self.value

    limit = Moving()
    bulkhead = Bulkhead("consumer", limit)
    producer = Producer(channel, queue)
    seen: list[int] = []

    async def handle(message: Message) -> None:
        seen.append(bulkhead.in_flight)
        await asyncio.sleep(0.05)

    consumer = Consumer(channel, queue, handle, bulkhead=bulkhead, follow_every=0.0)
    running = asyncio.ensure_future(consumer.run())
    await producer.publish(b"first")
    await until(lambda: consumer.prefetch == 2 and len(seen) == 1, 10)
    limit.value = 5  # the bulkhead takes it from the next sample
    for i in range(10):
        await producer.publish(f"m{i}".encode())
    await until(lambda: consumer.prefetch == 5, 10)
    await until(lambda: len(seen) == 11, 10)
    assert bulkhead.limit == 5
    await consumer.stop()
    await asyncio.wait_for(running, 10)


def rabbit_doc_blocks() -> str:
    """docs/queues.md's ```python blocks of the section "RabbitMQ (aio-pika)", the
    broker-bound ones (marked not to run by the unit docs test) included."""
    text = (HERE.parents[1] / "docs" / "queues.md").read_text()
    start = text.index("## RabbitMQ (aio-pika)")
    following = text.find("\n## ", start + 1)
    text = text[start:] if following < 0 else text[start:following]
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) >= 3
    return "\n".join(blocks)


async def test_the_docs_examples_run_against_rabbitmq(queue: str) -> None:
    script = (
        rabbit_doc_blocks()
        .replace('"emails"', repr(queue))
        .replace("amqp://guest:guest@127.0.0.1:5672/", URL)
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"sending b'welcome:42' attempt 1" in out
    assert b"replayed 0" in out


async def test_run_raises_when_its_channel_closes(queue: str) -> None:
    connection = await aio_pika.connect(URL)
    ch = await connection.channel()
    await declare(ch, queue)
    consumer = Consumer(ch, queue, lambda m: asyncio.sleep(0))
    running = asyncio.ensure_future(consumer.run())
    await until(lambda: consumer.prefetch > 0, 10)
    await connection.close()
    with pytest.raises(ConnectionError, match="closed"):
        await asyncio.wait_for(running, 10)


async def test_stop_before_run_makes_run_return(
    channel: aio_pika.abc.AbstractChannel, queue: str
) -> None:
    await declare(channel, queue)
    consumer = Consumer(channel, queue, lambda m: asyncio.sleep(0))
    await consumer.stop()
    await asyncio.wait_for(consumer.run(), 10)


@pytest.mark.parametrize("quorum", [False, True], ids=["classic", "quorum"])
async def test_a_delivery_whose_consumer_died_comes_back_as_the_next_attempt(
    channel: aio_pika.abc.AbstractChannel, queue: str, quorum: bool
) -> None:
    await declare(channel, queue, quorum=quorum)
    await Producer(channel, queue).publish(b"poison", idempotency_key="p")
    attempts: list[int] = []
    for _ in range(2):  # a consumer whose connection dies mid-handler, twice
        connection = await aio_pika.connect(URL)
        started = asyncio.Event()

        async def hang(message: Message, started: asyncio.Event = started) -> None:
            attempts.append(message.attempt)
            started.set()
            await asyncio.sleep(60)

        consumer = Consumer(await connection.channel(), queue, hang, stop_timeout=0.1)
        running = asyncio.ensure_future(consumer.run())
        await asyncio.wait_for(started.wait(), 10)
        await connection.close()  # no ack, no nack: the broker redelivers
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(running, 10)
    done: list[Message] = []

    async def handle(message: Message) -> None:
        done.append(message)

    consumer = Consumer(channel, queue, handle, policy=MessagePolicy(max_attempts=5))
    running = asyncio.ensure_future(consumer.run())
    await until(lambda: len(done) == 1, 10)
    await consumer.stop()
    await asyncio.wait_for(running, 10)
    assert attempts == [1, 2] and done[0].attempt == 3
    assert done[0].idempotency_key == "p"  # a duplicate the handler can recognise


async def test_acks_go_together_but_never_past_a_message_still_running(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await declare(channel, queue)
        producer = Producer(channel, queue)
        for i in range(40):
            await producer.publish(f"m{i}".encode())
        underlay = await channel.get_underlay_channel()
        sent: list[tuple[int, bool]] = []
        real_ack = underlay.basic_ack

        async def spy(delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
            sent.append((delivery_tag, multiple))
            await real_ack(delivery_tag, multiple=multiple, wait=wait)

        monkeypatch.setattr(underlay, "basic_ack", spy)
        done: list[bytes] = []
        release = asyncio.Event()

        async def handle(message: Message) -> None:
            if message.body == b"m0":  # the first delivery (tag 1) holds on
                await release.wait()
            done.append(message.body)

        consumer = Consumer(channel, queue, handle, bulkhead=Bulkhead("acks", FixedLimit(8)))
        running = asyncio.ensure_future(consumer.run())
        await until(lambda: len(done) == 39, 20)
        # nothing acknowledged tag 1 (m0 runs): no multiple ack yet, each one alone
        assert sent and all(not multiple for _, multiple in sent) and 1 not in dict(sent)
        release.set()
        await until(lambda: len(done) == 40, 20)
        await consumer.stop()
        await asyncio.wait_for(running, 10)
        acked = {tag for tag, multiple in sent if not multiple}
        top = max((tag for tag, multiple in sent if multiple), default=0)
        assert acked | set(range(1, top + 1)) == set(range(1, 41))
    finally:
        await connection.close()  # an unacknowledged message would be back in the queue
    check = await aio_pika.connect(URL)
    try:
        assert await depth(await check.channel(), queue) == 0
    finally:
        await check.close()


async def test_acks_of_one_loop_turn_go_as_one(queue: str, monkeypatch: pytest.MonkeyPatch) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await declare(channel, queue)
        producer = Producer(channel, queue)
        for i in range(200):
            await producer.publish(f"m{i}".encode())
        underlay = await channel.get_underlay_channel()
        sent: list[tuple[int, bool]] = []
        real_ack = underlay.basic_ack

        async def spy(delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
            sent.append((delivery_tag, multiple))
            await real_ack(delivery_tag, multiple=multiple, wait=wait)

        monkeypatch.setattr(underlay, "basic_ack", spy)
        done: list[bytes] = []

        async def handle(message: Message) -> None:
            done.append(message.body)

        consumer = Consumer(channel, queue, handle, bulkhead=Bulkhead("acks", FixedLimit(16)))
        running = asyncio.ensure_future(consumer.run())
        await until(lambda: len(done) == 200, 20)
        await consumer.stop()
        await asyncio.wait_for(running, 10)
        assert len(sent) < 200 and any(multiple for _, multiple in sent)
        assert max(tag for tag, _ in sent) == 200
    finally:
        await connection.close()
    check = await aio_pika.connect(URL)
    try:
        assert await depth(await check.channel(), queue) == 0
    finally:
        await check.close()
