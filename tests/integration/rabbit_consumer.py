"""A consumer process for the crash test: ``python rabbit_consumer.py QUEUE LOG``.

Runs `brownout.integrations.aio_pika.Consumer` on QUEUE; its handler sleeps a little, then
appends ``<key> <attempt>`` to LOG (flushed and fsynced) before returning, so the parent can
kill the process at any moment and still know what completed.
"""

from __future__ import annotations

import asyncio
import os
import sys

import aio_pika

from brownout import Bulkhead
from brownout.durable import Message, MessagePolicy
from brownout.integrations.aio_pika import Consumer
from brownout.limits import FixedLimit

URL = f"amqp://guest:guest@{os.environ.get('BROWNOUT_TEST_RABBITMQ', '127.0.0.1:5672')}/"


async def main(queue: str, log: str) -> None:
    connection = await aio_pika.connect(URL)
    channel = await connection.channel()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def handle(message: Message) -> None:
        await asyncio.sleep(0.02)
        os.write(fd, f"{message.idempotency_key} {message.attempt}\n".encode())
        os.fsync(fd)

    consumer = Consumer(
        channel,
        queue,
        handle,
        policy=MessagePolicy(max_attempts=10),
        bulkhead=Bulkhead("consumer", FixedLimit(4)),
    )
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
