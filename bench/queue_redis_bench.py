"""Consumer throughput on Redis Streams: brownout's `Consumer` vs a plain redis-py consumer
(issue 26; target: brownout's time per message <= 1.10x the plain one's).

Both consume the same entries (a body plus brownout's envelope fields), with the same trivial
handler, at most 16 handlers at once, reading with XREADGROUP only as many entries as they
can start, and acknowledging each entry as it finishes. The plain consumer acknowledges with
a bare XACK, as most do; a second baseline does what brownout does by default (XACK + XDEL in
one script, so the stream holds only the backlog). Rounds alternate between the consumers;
medians are printed.

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/queue_redis_bench.py [--n 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import redis.asyncio as redis_asyncio

from brownout import Bulkhead
from brownout.durable import Envelope, Message
from brownout.integrations.redis_streams import Consumer, stream_keys
from brownout.limits import FixedLimit

CONCURRENCY = 16
ACK_AND_DELETE = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"""


async def fill(client: Any, stream: str, n: int) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for i in range(n):
            fields = {"body": b"payload-%d" % i, **Envelope.stamp(time.time(), ttl=600).encode()}
            pipe.xadd(stream, fields)
        await pipe.execute()


async def plain(client: Any, stream: str, n: int, delete: bool) -> float:
    """A redis-py consumer without brownout: seconds to handle and acknowledge ``n``."""
    await client.xgroup_create(stream, "g", id="0", mkstream=True)
    done = 0
    all_done = asyncio.Event()
    slot = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        nonlocal done
        await asyncio.sleep(0)  # the trivial handler
        if delete:  # the same script brownout runs (one command)
            await client.eval(ACK_AND_DELETE, 1, stream, "g", entry_id)
        else:
            await client.xack(stream, "g", entry_id)
        done += 1
        if done >= n:
            all_done.set()

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        slot.set()

    async def read() -> None:
        while True:
            free = CONCURRENCY - len(tasks)
            if free <= 0:
                slot.clear()
                await slot.wait()
                continue
            reply = await client.xreadgroup("g", "plain", {stream: ">"}, count=free, block=100)
            for _name, items in reply or ():
                for entry_id, fields in items:
                    task = asyncio.create_task(handle(entry_id, fields))
                    tasks.add(task)
                    task.add_done_callback(finished)

    started = time.perf_counter()
    reader = asyncio.create_task(read())
    await all_done.wait()
    elapsed = time.perf_counter() - started
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return elapsed


class CountingConsumer(Consumer):
    """Counts acknowledgements, so the clock stops when the last entry is acknowledged."""

    def __init__(self, *args: Any, n: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.n = n
        self.acked = 0
        self.all_acked = asyncio.Event()

    async def ack(self, delivery: Any) -> None:
        await super().ack(delivery)
        self.acked += 1
        if self.acked >= self.n:
            self.all_acked.set()


async def with_brownout(client: Any, name: str, n: int, bulkhead: bool) -> float:
    """brownout's `Consumer` on the same entries: seconds to handle and acknowledge ``n``."""

    async def handle(message: Message) -> None:
        await asyncio.sleep(0)  # the trivial handler

    consumer = CountingConsumer(
        client,
        name,
        "g",
        handle,
        n=n,
        concurrency=CONCURRENCY,
        bulkhead=Bulkhead("bench", FixedLimit(CONCURRENCY)) if bulkhead else None,
        block=0.1,
    )
    started = time.perf_counter()
    task = asyncio.create_task(consumer.run())
    await consumer.all_acked.wait()
    elapsed = time.perf_counter() - started
    await consumer.stop()
    await task
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis-port", type=int, default=6379)
    args = parser.parse_args()
    client = redis_asyncio.Redis(host="127.0.0.1", port=args.redis_port, socket_timeout=10)
    rates: dict[str, list[float]] = {
        "plain (XACK)": [],
        "plain (XACK+XDEL script)": [],
        "brownout Consumer": [],
        "brownout Consumer + Bulkhead": [],
    }
    try:
        for _ in range(args.rounds):
            for label in rates:
                name = f"bench-queue-{uuid.uuid4().hex[:8]}"
                keys = stream_keys(name)
                await fill(client, keys.stream, args.n)
                try:
                    if label.startswith("plain"):
                        seconds = await plain(client, keys.stream, args.n, "XDEL" in label)
                    else:
                        seconds = await with_brownout(client, name, args.n, "Bulkhead" in label)
                finally:
                    await client.delete(keys.stream, keys.retry, keys.parked)
                rates[label].append(args.n / seconds)
    finally:
        await client.aclose()
    base = statistics.median(rates["plain (XACK)"])
    print(f"{args.n} messages x {args.rounds} rounds, {CONCURRENCY} handlers at once")
    for label, values in rates.items():
        median = statistics.median(values)
        print(
            f"{label:30s} {median:8.0f} msg/s  "
            f"(min {min(values):.0f}, max {max(values):.0f})  "
            f"time per message {base / median:.3f}x plain (XACK)"
        )


if __name__ == "__main__":
    asyncio.run(main())
