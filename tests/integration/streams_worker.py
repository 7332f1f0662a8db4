"""A Redis Streams consumer process for the crash test: records each handled message in
Redis (a set of done numbers, a list of ``number:attempt``) and runs until killed.

Usage: python streams_worker.py STREAM GROUP NAME DONE_KEY ATTEMPTS_KEY
"""

from __future__ import annotations

import asyncio
import os
import sys

import redis.asyncio as redis_asyncio

from brownout.durable import Message, MessagePolicy
from brownout.integrations.redis_streams import Consumer


async def main(stream: str, group: str, name: str, done_key: str, attempts_key: str) -> None:
    host, _, port = os.environ.get("BROWNOUT_TEST_REDIS", "127.0.0.1:6379").rpartition(":")
    client = redis_asyncio.Redis(host=host, port=int(port))

    async def handle(message: Message) -> None:
        number = message.headers["n"]
        await client.rpush(attempts_key, f"{number}:{message.attempt}")
        await asyncio.sleep(0.03)  # long enough that a kill lands mid-handler
        await client.sadd(done_key, number)

    consumer = Consumer(
        client,
        stream,
        group,
        handle,
        consumer_name=name,
        policy=MessagePolicy(max_attempts=10),
        concurrency=8,
        claim_idle=1.0,
        block=0.2,
    )
    print("ready", flush=True)
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
