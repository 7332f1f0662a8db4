"""``brownout queue`` as a user runs it (``python -m brownout queue ...`` in a subprocess)
against the parked messages of a real Redis Streams queue and a real RabbitMQ queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from tests import services

from brownout.durable import Message

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def brownout_queue(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run ``python -m brownout queue ARGS`` and return (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "brownout",
        "queue",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin or b""), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.05)


async def failing(message: Message) -> None:
    raise ValueError(f"cannot handle {message.body!r}")


# -- one fixture per broker: a queue with three parked messages ----------------------------


@contextlib.asynccontextmanager
async def redis_parked() -> AsyncIterator[tuple[list[str], Callable[[], Awaitable[int]]]]:
    redis_asyncio = pytest.importorskip("redis.asyncio")
    from brownout.integrations.redis_streams import Consumer, ParkedStream, Producer, stream_keys

    server = services.require(services.REDIS)
    client = redis_asyncio.Redis(host=server.host, port=server.port, socket_timeout=5)
    name = f"test-cli-{uuid.uuid4().hex[:10]}"
    try:
        producer = Producer(client, name)
        for i in range(3):
            await producer.publish(b"order-%d" % i)
        consumer = Consumer(client, name, "workers", failing, block=0.1)
        task = asyncio.create_task(consumer.run())
        parked = ParkedStream(client, name)
        await until(lambda: _count(parked, 3))
        await consumer.stop()
        await task

        async def in_stream() -> int:
            return int(await client.xlen(stream_keys(name).stream))

        yield ["--redis", f"redis://{server.address}/0", "--queue", name], in_stream
    finally:
        keys = stream_keys(name)
        await client.delete(keys.stream, keys.retry, keys.parked)
        await client.aclose()


@contextlib.asynccontextmanager
async def rabbit_parked() -> AsyncIterator[tuple[list[str], Callable[[], Awaitable[int]]]]:
    aio_pika = pytest.importorskip("aio_pika")
    from brownout.integrations.aio_pika import Consumer, ParkedQueue, Producer, declare

    url = f"amqp://guest:guest@{services.require(services.RABBITMQ).address}/"
    connection = await aio_pika.connect(url, timeout=5)
    name = f"test-cli-{uuid.uuid4().hex[:10]}"
    try:
        channel = await connection.channel(publisher_confirms=True)
        await declare(channel, name)
        producer = Producer(channel, name)
        for i in range(3):
            await producer.publish(b"order-%d" % i)
        consumer = Consumer(await connection.channel(publisher_confirms=True), name, failing)
        task = asyncio.create_task(consumer.run())
        parked = ParkedQueue(await connection.channel(publisher_confirms=True), name)
        await until(lambda: _count(parked, 3))
        await consumer.stop()
        await task

        async def in_queue() -> int:
            q = await channel.declare_queue(name, passive=True)
            return int(q.declaration_result.message_count or 0)

        yield ["--amqp", url, "--queue", name], in_queue
    finally:
        with contextlib.suppress(Exception):
            cleanup = await connection.channel()
            for q in (name, f"{name}.parked"):
                await cleanup.queue_delete(q)
        await connection.close()


async def _count(store: Any, n: int) -> bool:
    return len(await store.list(limit=100)) >= n


BROKERS = {"redis": redis_parked, "rabbitmq": rabbit_parked}


@pytest.mark.parametrize("broker", sorted(BROKERS))
async def test_list_show_replay_and_purge_parked_messages(broker: str) -> None:
    async with BROKERS[broker]() as (where, in_queue):
        code, out, err = await brownout_queue("list", *where)
        assert code == 0, err
        assert out.splitlines()[0] == "3 parked message(s): failed 3"
        assert "ValueError: cannot handle b'order-" in out

        code, out, _ = await brownout_queue("list", *where, "--json")
        rows = [json.loads(line) for line in out.splitlines()]
        assert sorted(r["body"] for r in rows) == ["order-0", "order-1", "order-2"]
        assert {r["reason"] for r in rows} == {"failed"} and all(r["attempt"] == 1 for r in rows)
        first, second, third = (r["id"] for r in rows)

        code, out, _ = await brownout_queue("show", *where, first)
        assert code == 0 and "reason:      failed" in out and "parked" in out
        code, _, err = await brownout_queue("show", *where, "no-such-id")
        assert code == 2 and "no parked message" in err

        # changes need a confirmation: none possible without a terminal, so nothing happens
        code, _, err = await brownout_queue("purge", *where, "--all")
        assert code == 2 and "--yes" in err
        assert len((await brownout_queue("list", *where, "--json"))[1].splitlines()) == 3

        code, out, err = await brownout_queue("replay", *where, first, "--ttl", "60", "--yes")
        assert code == 0, err
        assert out.strip() == f"replayed 1 message(s) to {where[-1]!r}"
        assert await in_queue() == 1
        code, out, _ = await brownout_queue("purge", *where, second, "--yes")
        assert code == 0 and "purged 1 message(s)" in out
        code, out, _ = await brownout_queue("list", *where, "--json")
        assert [json.loads(line)["id"] for line in out.splitlines()] == [third]


async def test_bad_usage_and_an_unreachable_broker_have_their_own_exit_status() -> None:
    where = ["--redis", "redis://127.0.0.1:1/0", "--queue", "q"]
    code, _, err = await brownout_queue("replay", *where)
    assert code == 2 and "needs message ids or --all" in err
    code, _, err = await brownout_queue("purge", *where, "a", "--all")
    assert code == 2 and "not both" in err
    code, _, err = await brownout_queue("list", *where, "--timeout", "1")
    assert code == 3 and "Redis at redis://127.0.0.1:1/0 did not answer" in err
    code, _, err = await brownout_queue(
        "list", "--amqp", "amqp://guest:guest@127.0.0.1:1/", "--queue", "q", "--timeout", "1"
    )
    assert code == 3 and "RabbitMQ" in err and "did not answer" in err
