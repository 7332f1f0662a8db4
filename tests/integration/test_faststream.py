"""`brownout.integrations.faststream` on a real RabbitMQ (127.0.0.1:5672, guest/guest): a
FastStream app's publishes are stamped from the request context; its handler runs with the
message's remaining time, or the message is parked (expired, failed, malformed) in the
queue layout of `brownout.integrations.aio_pika`, where `ParkedQueue` reads it; transient
failures come back as later attempts; nothing is acknowledged before its copy is stored.

Each test uses queues of its own (a random name), deleted at teardown.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

faststream_rabbit = pytest.importorskip("faststream.rabbit")
aio_pika = pytest.importorskip("aio_pika")

from faststream.rabbit.annotations import RabbitMessage  # noqa: E402
from tests import services  # noqa: E402

from brownout import Rejected, current, request  # noqa: E402
from brownout._errors import Reason  # noqa: E402
from brownout._retry import ExponentialBackoff  # noqa: E402
from brownout.durable import Envelope, MessagePolicy, ParkReason  # noqa: E402
from brownout.events import (  # noqa: E402
    EventHub,
    MessageCompleted,
    MessageParked,
    MessagePublished,
    MessageRetried,
)
from brownout.integrations.aio_pika import RETRY_DELAYS, ParkedQueue, retry_queue  # noqa: E402
from brownout.integrations.faststream import BrownoutMiddleware  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("rabbitmq_server")]

RabbitBroker = faststream_rabbit.RabbitBroker
RabbitQueue = faststream_rabbit.RabbitQueue


ROOT = Path(__file__).resolve().parents[2]


def url() -> str:
    return f"amqp://guest:guest@{services.RABBITMQ.address}/"


def fast_policy(**kw: Any) -> MessagePolicy:
    return MessagePolicy(backoff=ExponentialBackoff(0.05, cap=0.1), **kw)


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"bo-fs-{secrets.token_hex(4)}"
    yield name
    connection = await aio_pika.connect(url())
    try:
        ch = await connection.channel()
        for n in [name, f"{name}.parked", *(retry_queue(name, d)[0] for d in RETRY_DELAYS)]:
            await ch.queue_delete(n)
    finally:
        await connection.close()


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


class _Seen(list[Any]):
    accepts_tallies = False

    def emit(self, event: Any) -> None:
        self.append(event)


def recorder() -> tuple[EventHub, list[Any]]:
    events = EventHub()
    seen = _Seen()
    events.subscribe(seen)
    return events, seen


async def publish_raw(name: str, body: bytes, headers: dict[str, Any]) -> None:
    """Publish as a producer without brownout would (no middleware to stamp it)."""
    connection = await aio_pika.connect(url())
    try:
        channel = await connection.channel()
        message = aio_pika.Message(body, headers=headers)
        await channel.default_exchange.publish(message, routing_key=name)
    finally:
        await connection.close()


async def parked(name: str) -> list[Any]:
    connection = await aio_pika.connect(url())
    try:
        return await ParkedQueue(await connection.channel(), name).list(limit=100)
    finally:
        await connection.close()


async def test_publish_in_a_request_stamps_and_the_handler_runs_inside_its_budget(
    queue: str,
) -> None:
    events, seen = recorder()
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(BrownoutMiddleware(broker, queues=[queue], events=events, ttl=60))
    got: list[tuple[bytes, float | None, str | None, dict[str, Any]]] = []

    @broker.subscriber(RabbitQueue(queue, durable=True))
    async def handle(body: bytes) -> None:
        ctx = current()
        assert ctx is not None
        got.append((body, ctx.remaining(), ctx.idempotency_key, {"caller": ctx.caller}))

    async with broker:
        await broker.start()
        async with request(deadline=20.0, caller="checkout", idempotency_key="order-7"):
            await broker.publish(b"order-7", queue=queue)
        await until(lambda: bool(got), 10)

    body, remaining, key, extra = got[0]
    assert body == b"order-7" and key == "order-7" and extra["caller"] == "checkout"
    assert remaining is not None and 10 < remaining <= 20  # the request's budget, not ttl=60
    published = [e for e in seen if isinstance(e, MessagePublished)]
    assert len(published) == 1 and published[0].valid_for is not None
    assert published[0].valid_for <= 20
    assert any(isinstance(e, MessageCompleted) for e in seen)


async def test_expired_failed_and_malformed_messages_are_parked_never_run(queue: str) -> None:
    events, seen = recorder()
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(
        BrownoutMiddleware(broker, queues=[queue], events=events, policy=fast_policy())
    )
    ran: list[bytes] = []

    @broker.subscriber(RabbitQueue(queue, durable=True))
    async def handle(body: bytes) -> None:
        ran.append(body)
        if body == b"bad":
            raise ValueError("no such customer")  # permanent: parked as failed

    stale = Envelope(enqueued_at=time.time() - 100, valid_until=time.time() - 50)
    async with broker:
        await broker.start()
        await broker.publish(b"stale", queue=queue, headers=stale.encode())
        await broker.publish(b"bad", queue=queue)
        await publish_raw(queue, b"foreign", {"brownout-enqueued-at": "yesterday"})
        await until(lambda: sum(isinstance(e, MessageParked) for e in seen) == 3, 15)

    assert ran == [b"bad"]  # the stale one and the malformed one never ran
    reasons = sorted(m.reason for m in await parked(queue))
    assert reasons == sorted([ParkReason.EXPIRED, ParkReason.FAILED, ParkReason.MALFORMED])


async def test_a_transient_failure_comes_back_as_the_next_attempt(queue: str) -> None:
    events, seen = recorder()
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(
        BrownoutMiddleware(broker, queues=[queue], events=events, policy=fast_policy())
    )
    attempts: list[tuple[int, str | None]] = []

    @broker.subscriber(RabbitQueue(queue, durable=True))
    async def handle(body: bytes) -> None:
        ctx = current()
        assert ctx is not None
        attempts.append((ctx.attempt, ctx.idempotency_key))
        if len(attempts) == 1:
            raise Rejected(Reason.OVERLOADED, "dependency busy", retry_after=0.1)

    async with broker:
        await broker.start()
        await broker.publish(b"job", queue=queue)
        await until(lambda: any(isinstance(e, MessageCompleted) for e in seen), 15)

    assert [a for a, _ in attempts] == [1, 2]
    assert attempts[0][1] is not None and attempts[0][1] == attempts[1][1]  # same key
    assert sum(isinstance(e, MessageRetried) for e in seen) == 1
    assert await parked(queue) == []


async def test_other_queues_pass_through_untouched(queue: str) -> None:
    events, seen = recorder()
    other = f"{queue}-other"
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(BrownoutMiddleware(broker, queues=[queue], events=events))
    headers: list[dict[str, Any]] = []

    @broker.subscriber(RabbitQueue(other, durable=False, auto_delete=True))
    async def handle(body: bytes, message: RabbitMessage) -> None:
        headers.append(dict(message.headers))

    async with broker:
        await broker.start()
        await broker.publish(b"plain", queue=other)
        await until(lambda: bool(headers), 10)

    assert not any(k.startswith("brownout-") for k in headers[0])
    assert seen == []


def test_queues_must_be_names_not_one_string() -> None:
    broker = RabbitBroker(url())
    with pytest.raises(TypeError):
        BrownoutMiddleware(broker, queues="orders")


def faststream_doc_blocks() -> str:
    """docs/queues.md's ```python blocks of the section "FastStream" (marked not to run by
    the unit docs test: they need a broker)."""
    text = (ROOT / "docs" / "queues.md").read_text()
    start = text.index("## FastStream")
    following = text.find("\n## ", start + 1)
    text = text[start:] if following < 0 else text[start:following]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "no python block in the FastStream section"
    return "\n".join(blocks)


async def test_the_docs_example_runs_against_rabbitmq(queue: str) -> None:
    script = faststream_doc_blocks()
    assert script.count('"invoices"') == 3, "the example's queue name moved"
    script = script.replace('"invoices"', repr(queue)).replace(
        "amqp://guest:guest@127.0.0.1:5672/", url()
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [x for x in out.decode().splitlines() if x.startswith("invoice ")]  # not logs
    assert len(lines) == 1, out.decode()
    assert lines[0].startswith("invoice b'invoice-7' attempt 1 seconds left "), lines
    assert 20 <= int(lines[0].rsplit(" ", 1)[1]) <= 30, lines  # the request's 30 s, not 300


async def test_the_in_memory_test_broker_gets_a_clear_error(queue: str) -> None:
    # TestRabbitBroker has no connection to store copies in: say so instead of an AttributeError
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(BrownoutMiddleware(broker, queues=[queue]))

    @broker.subscriber(RabbitQueue(queue, durable=True))
    async def handle(body: bytes) -> None:
        raise AssertionError("must not run without a broker to park in")

    with pytest.raises(RuntimeError, match="TestRabbitBroker has no connection"):
        async with faststream_rabbit.TestRabbitBroker(broker) as test_broker:
            await test_broker.publish(b"x", queue=queue)


async def test_a_delivery_lost_mid_handler_comes_back_as_the_next_attempt(queue: str) -> None:
    # the subscriber's channel dies while the handler runs: RabbitMQ redelivers the message
    # (classic queue: flagged redelivered), which counts as an attempt, same key
    events, seen = recorder()
    broker = RabbitBroker(url(), logger=None)
    broker.add_middleware(BrownoutMiddleware(broker, queues=[queue], events=events))
    runs: list[tuple[int, str | None]] = []

    @broker.subscriber(RabbitQueue(queue, durable=True))
    async def handle(body: bytes, message: RabbitMessage) -> None:
        ctx = current()
        assert ctx is not None
        runs.append((ctx.attempt, ctx.idempotency_key))
        if len(runs) == 1:
            await message.raw_message.channel.close()  # as if the consumer died here
            raise asyncio.CancelledError

    async with broker:
        await broker.start()
        await broker.publish(b"job", queue=queue)
        await until(lambda: any(isinstance(e, MessageCompleted) for e in seen), 30)

    assert [a for a, _ in runs] == [1, 2]
    assert runs[0][1] == runs[1][1]
    retried = [e for e in seen if isinstance(e, MessageRetried)]
    assert [e.cause for e in retried] == ["redelivered"]
