"""Transport overhead: `BrownoutTransport` vs bare httpx, in one run (issue 6).

Two measurements, each the median of interleaved rounds so machine noise hits both sides:

1. **loopback**: sequential GETs to a minimal keep-alive HTTP/1.1 server in this process
   (an asyncio protocol, so the server costs as little as possible and the client dominates),
   bare ``httpx.AsyncHTTPTransport`` vs the same wrapped in `BrownoutTransport` with a
   `Dependency` (timeout, 3-attempt retry policy with a budget), inside a request deadline;
2. **in memory**: the same clients over ``httpx.MockTransport`` (no network at all), which
   isolates the microseconds brownout adds per request.

    flock /tmp/brownout-bench.lock .venv/bin/python bench/transport_bench.py \
        [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx

import brownout
from brownout import Dependency, RetryBudget, RetryPolicy
from brownout.integrations.httpx import BrownoutTransport

_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class _Http(asyncio.Protocol):
    """Answers every GET with 200 ``ok``, keep-alive; enough HTTP for a benchmark."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            assert self.transport is not None
            self.transport.write(_RESPONSE)


Runner = Callable[[int], Awaitable[None]]


def bare(client: httpx.AsyncClient) -> Runner:
    async def run(n: int) -> None:
        get = client.get
        async with brownout.deadline(60.0):
            for _ in range(n):
                await get("/")

    return run


def dependency() -> Dependency:
    return Dependency(
        "bench",
        timeout=5.0,
        reserve=0.01,
        retry=RetryPolicy(3, budget=RetryBudget(ratio=0.1, min_per_second=10)),
    )


async def measure(runners: dict[str, Runner], n: int, rounds: int) -> dict[str, float]:
    """Median seconds per request for each runner, rounds interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        await run(max(50, n // 10))  # warm up: connections, caches
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            await run(n)
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def report(title: str, result: dict[str, float]) -> None:
    base = result["bare httpx"]
    print(f"\n{title}")
    for name, per in result.items():
        extra = ""
        if name != "bare httpx":
            extra = f"  +{(per - base) * 1e6:6.1f} us  x{per / base:.3f}"
        print(f"  {name:<34} {per * 1e6:8.1f} us/request{extra}")


async def main(n: int, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    try:
        async with (
            httpx.AsyncClient(base_url=base_url) as plain,
            httpx.AsyncClient(
                base_url=base_url,
                transport=BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=dependency()),
            ) as wrapped,
        ):
            loopback = await measure(
                {"bare httpx": bare(plain), "BrownoutTransport (Dependency)": bare(wrapped)},
                n,
                rounds,
            )
    finally:
        server.close()
        await server.wait_closed()

    def ok(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"ok")

    async with (
        httpx.AsyncClient(base_url=base_url, transport=httpx.MockTransport(ok)) as plain,
        httpx.AsyncClient(
            base_url=base_url,
            transport=BrownoutTransport(httpx.MockTransport(ok), dependency=dependency()),
        ) as wrapped,
    ):
        in_memory = await measure(
            {"bare httpx": bare(plain), "BrownoutTransport (Dependency)": bare(wrapped)},
            n * 2,
            rounds,
        )
    print(f"transport overhead, {n} sequential GETs x {rounds} interleaved rounds (median)")
    report("loopback server (minimal asyncio HTTP/1.1, keep-alive):", loopback)
    report("in memory (httpx.MockTransport, no network):", in_memory)
    ratio = loopback["BrownoutTransport (Dependency)"] / loopback["bare httpx"]
    print(f"\nratio BrownoutTransport / bare httpx on loopback: {ratio:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
