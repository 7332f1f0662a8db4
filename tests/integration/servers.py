"""Real servers on loopback for integration tests: one way to run an ASGI app in-process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run ``app`` under uvicorn on an ephemeral 127.0.0.1 port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True
        await asyncio.wait_for(task, 10)


async def send_then_hang_up(
    base: str, target: str, headers: bytes = b"", after: float = 0.2
) -> None:
    """A client that sends ``GET target`` to ``base`` (``http://host:port``) over a raw
    connection and goes away ``after`` seconds, without reading an answer (D5, O1)."""
    host, port = base.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {target} HTTP/1.1\r\nhost: x\r\n".encode() + headers + b"\r\n")
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()
    await writer.wait_closed()
