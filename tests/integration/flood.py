"""A flood of at least 10x a server's capacity, and a health probe timed meanwhile (S7).

Server, flood and probe run in three processes, so the probe measures the server, not a
client starved by its own flood. The server script prints its port, serves until its stdin
closes, and holds each ``/work`` request 0.5 s (capacity held, CPU left free).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Awaitable, Callable

HTTP_FLOOD = """
import asyncio, json, sys
port, conns, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
counts = {}

async def worker(stop):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not stop.is_set():
        writer.write(b"GET /work HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
        head = await reader.readuntil(b"\\r\\n\\r\\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\\r\\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        counts[status] = counts.get(status, 0) + 1
    writer.close()

async def main():
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker(stop)) for _ in range(conns)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(counts), flush=True)

asyncio.run(main())
"""
"""Closed-loop HTTP/1.1 clients, one keep-alive connection each (a refused request must leave
the connection open, or the worker fails): counts by status code."""

GRPC_FLOOD = """
import asyncio, json, sys
import grpc, grpc.aio
port, conns, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
counts = {}

async def worker(stop, call):
    while not stop.is_set():
        try:
            await call(b"", timeout=5)
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        counts[code] = counts.get(code, 0) + 1

async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/test.Flood/Work", request_serializer=None, response_deserializer=None
        )
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker(stop, call)) for _ in range(conns)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(counts), flush=True)

asyncio.run(main())
"""
"""Closed-loop unary calls to ``/test.Flood/Work`` on one channel: counts by status code."""


@contextlib.asynccontextmanager
async def server_process(script: str) -> AsyncIterator[int]:
    """Run a server script in a child process; yields the port it printed."""
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdin=PIPE, stdout=PIPE
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        yield int(await asyncio.wait_for(server.stdout.readline(), 30))
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            await asyncio.wait_for(server.wait(), 10)
        except TimeoutError:
            server.kill()
            await server.wait()


async def probe_under_flood(
    flood_script: str,
    port: int,
    probe: Callable[[], Awaitable[None]],
    *,
    connections: int = 40,
    seconds: float = 2.5,
    probes: int = 20,
) -> tuple[dict[str, int], list[float]]:
    """Flood ``port`` from a child process, time ``probes`` calls of ``probe`` meanwhile.

    Returns the flood's counts by status and the probe latencies, sorted."""
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-c", flood_script, str(port), str(connections), str(seconds), stdout=PIPE
    )
    await asyncio.sleep(0.8)  # let the flood saturate the bulkhead
    latencies = []
    for _ in range(probes):
        t0 = time.perf_counter()
        await probe()
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.03)
    out, _ = await asyncio.wait_for(flood.communicate(), 30)
    return dict(json.loads(out)), sorted(latencies)


def assert_answered_fast(latencies: list[float]) -> None:
    """The median probe within 50 ms (the issue's figure); the worst but one within 150 ms,
    generous because the machines are shared and noisy."""
    assert latencies[len(latencies) // 2] < 0.05, latencies
    assert latencies[-2] < 0.15, latencies
