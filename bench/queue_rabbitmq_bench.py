"""Consumer overhead on RabbitMQ: brownout's `Consumer` vs a plain aio-pika consumer.

Both drain the same pre-filled queue (messages published by brownout's `Producer`, so both
see the same headers) with a trivial handler, prefetch 16. The plain consumer acknowledges
each message as it finishes; brownout's sends the acks of one loop turn together (one
``basic.ack`` with ``multiple`` for an unbroken run of tags). Brownout adds the envelope,
the policy, a bulkhead (``FixedLimit(16)``), the request context and the events. Rounds
alternate plain / brownout and each side keeps its best, so a noisy shared machine inflates
both alike. Prints each side's messages per second and the
ratio (target <= 1.10x). Needs RabbitMQ at 127.0.0.1:5672. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/queue_rabbitmq_bench.py
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time

import aio_pika

from brownout import Bulkhead
from brownout.durable import Message
from brownout.integrations.aio_pika import (
    RETRY_DELAYS,
    Consumer,
    Producer,
    declare,
    parked_queue,
    retry_queue,
)
from brownout.limits import FixedLimit

URL = "amqp://guest:guest@127.0.0.1:5672/"
N = 4000
ROUNDS = 3
PREFETCH = 16


async def fill(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    producer = Producer(channel, queue, ttl=600)
    for start in range(0, N, 200):
        await asyncio.gather(
            *(producer.publish(b"x" * 64) for _ in range(start, min(N, start + 200)))
        )


async def plain(connection: aio_pika.abc.AbstractConnection, queue: str) -> float:
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=PREFETCH)
    q = await channel.declare_queue(queue, passive=True)
    done = asyncio.Event()
    count = 0

    async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal count
        await asyncio.sleep(0)  # the trivial handler
        await message.ack()
        count += 1
        if count == N:
            done.set()

    t = time.perf_counter()
    tag = await q.consume(handle)
    await done.wait()
    elapsed = time.perf_counter() - t
    await q.cancel(tag)
    await channel.close()
    return N / elapsed


async def brownout(connection: aio_pika.abc.AbstractConnection, queue: str) -> float:
    channel = await connection.channel()
    done = asyncio.Event()
    count = 0

    async def handle(message: Message) -> None:
        nonlocal count
        await asyncio.sleep(0)  # the trivial handler
        count += 1
        if count == N:
            done.set()

    consumer = Consumer(channel, queue, handle, bulkhead=Bulkhead("bench", FixedLimit(PREFETCH)))
    t = time.perf_counter()
    running = asyncio.ensure_future(consumer.run())
    await done.wait()
    if consumer._tasks:  # the last handlers
        await asyncio.wait(set(consumer._tasks))
    await consumer._acks.drain()  # and their acks, sent in batches
    elapsed = time.perf_counter() - t
    await consumer.stop()
    await running
    await channel.close()
    return N / elapsed


async def main() -> None:
    connection = await aio_pika.connect(URL)
    queue = f"bench-{secrets.token_hex(4)}"
    channel = await connection.channel()
    await declare(channel, queue)
    best = {"plain": 0.0, "brownout": 0.0}
    try:
        for _ in range(ROUNDS):
            for name, side in (("plain", plain), ("brownout", brownout)):
                await fill(channel, queue)
                rate = await side(connection, queue)
                best[name] = max(best[name], rate)
                print(f"  {name:9s} {rate:8.0f} msg/s", file=sys.stderr)
    finally:
        for name in (queue, parked_queue(queue), *(retry_queue(queue, d)[0] for d in RETRY_DELAYS)):
            await channel.queue_delete(name)
        await connection.close()
    ratio = best["plain"] / best["brownout"]
    print(f"plain aio-pika consumer: {best['plain']:.0f} msg/s (best of {ROUNDS})")
    print(f"brownout Consumer:       {best['brownout']:.0f} msg/s (best of {ROUNDS})")
    print(f"overhead ratio (plain/brownout throughput): {ratio:.3f}x (target <= 1.10x)")


if __name__ == "__main__":
    asyncio.run(main())
