"""A consumer process of the backlog scenario (`brownout._lab.backlog`): naive or brownout.

Both consume the same Redis stream and call the same simulated dependency: ``concurrency``
calls at a time of ``latency`` s each, down (failing after ``fail_after`` s) between two
wall-clock times given on the command line, so a restarted process keeps the schedule. Each
completed message is logged in Redis (``seq published completed``) before it is acknowledged,
so a process killed mid-handler loses no record of what it finished.

Usage: python -m brownout._lab.backlog_worker KIND URL STREAM GROUP NAME LOG DOWN_FROM DOWN_UNTIL
LATENCY CONCURRENCY FAIL_AFTER CLAIM_IDLE (KIND: naive or brownout). SIGTERM stops it after the
handlers running finish.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis_asyncio

from brownout.durable import Message, MessagePolicy
from brownout.integrations.redis_streams import BODY_FIELD, Consumer

__all__ = ["Dependency", "main"]


class Dependency:
    """The consumer's dependency: bounded concurrency, fixed latency, down for a window."""

    def __init__(
        self, down_from: float, down_until: float, latency: float, concurrency: int, fail: float
    ) -> None:
        self.down_from = down_from
        self.down_until = down_until
        self.latency = latency
        self.fail_after = fail
        self.slots = asyncio.Semaphore(concurrency)

    async def call(self) -> None:
        if self.down_from <= time.time() < self.down_until:
            await asyncio.sleep(self.fail_after)  # a dead host: the connect attempt times out
            raise ConnectionError("dependency down")
        async with self.slots:
            await asyncio.sleep(self.latency)


def _published(body: bytes) -> tuple[str, str]:
    seq, published = body.decode().split()
    return seq, published


async def _naive(
    client: Any,
    stream: str,
    group: str,
    name: str,
    concurrency: int,
    handle: Callable[[bytes], Awaitable[None]],
    stop: asyncio.Event,
) -> None:
    """What most consumers look like: FIFO, no deadline check, a failure requeued at once."""

    async def worker() -> None:
        while not stop.is_set():
            reply = await client.xreadgroup(group, name, {stream: ">"}, count=1, block=200)
            for _key, entries in reply or ():
                for entry_id, fields in entries:
                    try:
                        await handle(fields[BODY_FIELD.encode()])
                    except ConnectionError:
                        async with client.pipeline(transaction=True) as pipe:
                            pipe.xadd(stream, fields)  # back of the queue, to retry at once
                            pipe.xack(stream, group, entry_id)
                            pipe.xdel(stream, entry_id)
                            await pipe.execute()
                        continue
                    async with client.pipeline(transaction=True) as pipe:
                        pipe.xack(stream, group, entry_id)
                        pipe.xdel(stream, entry_id)
                        await pipe.execute()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def main(argv: list[str]) -> None:
    kind, url, stream, group, name, log = argv[:6]
    down_from, down_until, latency = (float(v) for v in argv[6:9])
    concurrency = int(argv[9])
    fail_after, claim_idle = float(argv[10]), float(argv[11])
    client = redis_asyncio.Redis.from_url(url, socket_timeout=5)
    dependency = Dependency(down_from, down_until, latency, concurrency, fail_after)

    async def handle_body(body: bytes) -> None:
        seq, published = _published(body)
        await dependency.call()
        await client.rpush(log, f"{seq} {published} {time.time():.6f}")

    async def handle(message: Message) -> None:
        await handle_body(message.body)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await client.ping()
    print("ready", flush=True)
    if kind == "naive":
        await _naive(client, stream, group, name, concurrency, handle_body, stop)
    else:
        consumer = Consumer(
            client,
            stream,
            group,
            handle,
            consumer_name=name,
            policy=MessagePolicy(),  # the library's defaults: nothing tuned for the lab
            concurrency=concurrency,
            claim_idle=claim_idle,
            block=0.2,
        )
        running = asyncio.create_task(consumer.run())
        await stop.wait()
        await consumer.stop(grace=2.0)
        await running
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
