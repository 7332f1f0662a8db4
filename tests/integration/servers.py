"""Real servers on loopback for integration tests, in-process: an ASGI app under uvicorn (or
Hypercorn, for HTTP/2), an aiohttp app under aiohttp's own server, a grpc.aio server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import httpx
import uvicorn

T = TypeVar("T")


CLIENT_KEEPALIVE = 1.0
"""How long test clients keep an idle pooled connection (seconds): well under uvicorn's
keep-alive timeout (5 s, and aiohttp's 75 s), so the client always gives up an idle
connection first and never sends a request on one the server is closing (`Ask.reset` in
test_edge_accounting.py). httpx's default (5 s) equals uvicorn's, and the client times it
from a later instant."""


def client_limits(concurrency: int) -> httpx.Limits:
    """httpx pool limits for ``concurrency`` connections with `CLIENT_KEEPALIVE`."""
    return httpx.Limits(
        max_connections=concurrency,
        max_keepalive_connections=concurrency,
        keepalive_expiry=CLIENT_KEEPALIVE,
    )


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


@contextlib.asynccontextmanager
async def serve_aiohttp(app: Any, **runner_options: Any) -> AsyncIterator[str]:
    """Run the aiohttp ``app`` on an ephemeral 127.0.0.1 port; yields its base URL.
    ``runner_options`` go to ``web.AppRunner`` (``handler_cancellation=True``, ...)."""
    from aiohttp import web

    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serve_hypercorn(app: Any) -> AsyncIterator[str]:
    """Run the ASGI ``app`` under Hypercorn (HTTP/1.1 and HTTP/2 over cleartext: clients with
    prior knowledge speak h2c) on an ephemeral 127.0.0.1 port; yields its base URL."""
    import socket

    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = config.errorlog = None
    stop = asyncio.Event()
    task = asyncio.create_task(hypercorn_serve(app, config, shutdown_trigger=stop.wait))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        sock.detach()  # Hypercorn closed the descriptor it served


@contextlib.asynccontextmanager
async def serve_grpc(server: Any) -> AsyncIterator[str]:
    """Start the grpc.aio ``server`` (handlers added) on an ephemeral 127.0.0.1 port; yields
    its target (``host:port``) and stops it, cancelling calls still running."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


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


class LoopThread:
    """An event loop in a background thread, for servers that outlive one test example:
    hypothesis runs its examples synchronously, so a test starts its servers here once
    (entering their contexts on `stack`) and runs each example's client with `run`."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = contextlib.AsyncExitStack()
        self.timeout = timeout

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def __enter__(self) -> LoopThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
