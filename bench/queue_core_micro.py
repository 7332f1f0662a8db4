"""Per-step cost of a durable-queue consumer's path in brownout, without a broker.

Each step runs 20,000 times, best of 7 repeats, in microseconds a message: envelope decode
(AMQP-style bytes headers), `MessagePolicy.before`, `Message` construction, the handler's
request context (`brownout.request`, and the runner's `MessageScope` where it exists), a
bulkhead permit, and `MessageRunner.process` with a trivial handler and a broker that does
nothing. Point PYTHONPATH at another checkout's src to compare commits. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/queue_core_micro.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from brownout import Bulkhead, request
from brownout.durable import Envelope, Message, MessagePolicy, MessageRunner
from brownout.limits import FixedLimit

N = 20_000
REPEATS = 7


class Delivery:
    __slots__ = ("body", "headers", "message", "redeliveries")

    def __init__(self, headers: dict[str, Any]) -> None:
        self.body = b"x" * 64
        self.headers = headers
        self.redeliveries = 0
        self.message = None


class Broker:
    async def ack(self, delivery: Any) -> None:
        pass

    async def retry_later(self, delivery: Any, envelope: Envelope, delay: float) -> None:
        pass

    async def park(self, delivery: Any, envelope: Any, reason: str, detail: str) -> None:
        pass


async def handler(message: Message) -> None:
    pass


async def best(step: Callable[[], Awaitable[None]]) -> float:
    runs = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        await step()
        runs.append(time.perf_counter() - t)
    return min(runs) / N * 1e6


async def main() -> None:
    headers: dict[str, Any] = {
        k: v.encode() for k, v in Envelope.stamp(time.time(), ttl=600).encode().items()
    }
    headers["x-user"] = b"1"  # aiormq hands text header values over as bytes
    delivery = Delivery(headers)
    envelope = Envelope.decode(headers)
    policy = MessagePolicy()
    now = time.time()
    bulkhead = Bulkhead("micro", FixedLimit(16))
    results: dict[str, float] = {}

    async def decode() -> None:
        for _ in range(N):
            Envelope.decode(headers)

    async def before() -> None:
        for _ in range(N):
            policy.before(envelope, now)

    async def message() -> None:
        for _ in range(N):
            Message(delivery.body, envelope, 1, headers, delivery)

    async def request_scope() -> None:
        for _ in range(N):
            async with request(
                deadline=500.0,
                priority=envelope.priority,
                caller=envelope.caller,
                operation=envelope.operation,
                attempt=1,
                idempotency_key=envelope.idempotency_key,
            ):
                pass

    async def admit() -> None:
        for _ in range(N):
            async with bulkhead.admit():
                pass

    results["Envelope.decode"] = await best(decode)
    results["MessagePolicy.before"] = await best(before)
    results["Message()"] = await best(message)
    results["brownout.request scope"] = await best(request_scope)
    try:
        from brownout._durable.scope import MessageScope, MessageSweeper
    except ImportError:  # a commit before MessageScope
        pass
    else:
        sweeper = MessageSweeper()

        async def message_scope() -> None:
            for _ in range(N):
                scope = MessageScope()
                scope.enter(500.0, envelope, 1, sweeper)
                scope.exit(None)

        results["MessageScope"] = await best(message_scope)
    results["bulkhead permit"] = await best(admit)
    for name, guard in (("process, no bulkhead", None), ("process, FixedLimit(16)", bulkhead)):
        runner = MessageRunner(handler, Broker(), queue="micro", bulkhead=guard)

        async def process(runner: MessageRunner = runner) -> None:
            for _ in range(N):
                await runner.process(delivery)

        results[f"MessageRunner.{name}"] = await best(process)
    for name, micros in results.items():
        print(f"{name:40s} {micros:7.2f} us")


if __name__ == "__main__":
    asyncio.run(main())
