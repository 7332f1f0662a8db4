"""Request bodies through the ASGI edge while it watches for disconnects (D5, O1).

Once a request is older than the policy's ``sweep_period`` and its body has been read, the
middleware listens for ``http.disconnect`` itself, while the application may still call
``receive`` (Starlette's ``request.is_disconnected()``, a streaming response's disconnect
listener). Every message must reach the application exactly once, in order, whoever was
waiting when it arrived. Over loopback, a raw client sends chunked bodies slowly to uvicorn
running a FastAPI app behind `BrownoutMiddleware` (a 20 ms sweep, so every request here is
old): the app must get every byte; an app that polls ``is_disconnected()`` after reading must
see the client go away; a client that goes away in the middle of its body is counted
abandoned and its handler cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from tests.integration.servers import serve, serve_hypercorn

from brownout import Bulkhead, EdgePolicy, Stats
from brownout.events import EventHub
from brownout.integrations._asgi_exchange import WATCH_READ_AHEAD
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

pytestmark = pytest.mark.integration


class App:
    def __init__(self) -> None:
        hub = EventHub()
        self.stats = Stats()
        hub.subscribe(self.stats)
        self.bulkhead = Bulkhead("api", FixedLimit(8), events=hub)
        self.received: list[bytes] = []
        self.saw_disconnect: list[bool] = []
        self.cancelled: list[str] = []
        app = FastAPI()

        @app.post("/upload")
        async def upload(request: Request) -> PlainTextResponse:
            try:
                body = b""
                async for chunk in request.stream():
                    body += chunk
                self.received.append(body)
                return PlainTextResponse(str(len(body)))
            except asyncio.CancelledError:
                self.cancelled.append("upload")
                raise

        @app.post("/then-wait")
        async def then_wait(request: Request) -> PlainTextResponse:
            self.received.append(await request.body())
            for _ in range(200):  # up to 4 s: long enough for the client to go away
                if await request.is_disconnected():
                    self.saw_disconnect.append(True)
                    return PlainTextResponse("gone")
                await asyncio.sleep(0.02)
            self.saw_disconnect.append(False)
            return PlainTextResponse("still here")

        @app.post("/stream-later")
        async def stream_later(request: Request) -> StreamingResponse:
            self.received.append(await request.body())
            await asyncio.sleep(0.15)  # old by now, body read: the edge listens first

            async def ticks() -> AsyncIterator[bytes]:
                try:
                    for i in range(40):
                        yield f"{i}\n".encode()
                        await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    self.cancelled.append("stream")
                    raise

            # Starlette's streaming response also calls receive() to hear a disconnect,
            # while the edge's listener holds the server's receive: a handover.
            return StreamingResponse(ticks(), media_type="text/plain")

        policy = EdgePolicy(bulkhead=self.bulkhead, sweep_period=0.02, events=hub)
        app.add_middleware(BrownoutMiddleware, policy=policy)
        self.app = app


@pytest.fixture
async def running() -> AsyncIterator[tuple[App, int]]:
    app = App()
    async with serve(app.app) as base:
        yield app, int(base.rsplit(":", 1)[1])


async def send_chunked(
    port: int, path: str, chunks: list[bytes], pause: float, hang_up_after: int | None = None
) -> bytes:
    """POST ``chunks`` with chunked transfer encoding, ``pause`` seconds apart; hang up after
    ``hang_up_after`` chunks (without finishing the body), else read the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode())
    try:
        for i, chunk in enumerate(chunks):
            if hang_up_after is not None and i == hang_up_after:
                return b""
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
            await asyncio.sleep(pause)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
        await writer.wait_closed()


async def settle(app: App) -> None:
    for _ in range(100):
        if app.bulkhead.in_flight == 0:
            return
        await asyncio.sleep(0.02)


async def test_a_slow_body_reaches_the_app_whole(running: tuple[App, int]) -> None:
    app, port = running
    chunks = [bytes([65 + i]) * (1000 + i) for i in range(8)]
    answer = await send_chunked(port, "/upload", chunks, pause=0.05)
    assert answer.startswith(b"HTTP/1.1 200")
    assert app.received == [b"".join(chunks)]  # every byte, in order, once
    await settle(app)
    assert app.stats.count("completed") == 1
    assert app.bulkhead.in_flight == 0


async def test_the_app_still_hears_the_client_go_away(running: tuple[App, int]) -> None:
    """The app polls ``is_disconnected()`` after the body while the edge also listens: the
    disconnect cancels the handler (D5) and counts it abandoned, not a success (O1)."""
    app, port = running
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /then-wait HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
    await writer.drain()
    await asyncio.sleep(0.3)  # old, body read: both the app and the edge are listening
    writer.close()
    await writer.wait_closed()
    await settle(app)
    await asyncio.sleep(0.1)
    assert app.received == [b"hello"]
    assert app.saw_disconnect in ([], [True])  # cancelled first, or saw it itself
    assert app.stats.count("abandoned") == 1
    assert app.stats.count("completed") == 0
    assert app.bulkhead.in_flight == 0


async def test_a_client_that_goes_away_mid_body_is_abandoned(running: tuple[App, int]) -> None:
    app, port = running
    chunks = [b"x" * 1000] * 8
    await send_chunked(port, "/upload", chunks, pause=0.05, hang_up_after=4)
    await settle(app)
    await asyncio.sleep(0.1)
    assert app.received == []  # the body never completed
    assert app.stats.count("completed") == 0
    assert app.stats.count("abandoned") + app.stats.count("failed") == 1
    assert app.bulkhead.in_flight == 0


async def test_many_slow_bodies_at_once(running: tuple[App, int]) -> None:
    app, port = running
    bodies = [[bytes([97 + n]) * 500] * 5 for n in range(6)]
    answers = await asyncio.gather(
        *(send_chunked(port, "/upload", chunks, pause=0.03) for chunks in bodies)
    )
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
    assert sorted(app.received) == sorted(b"".join(c) for c in bodies)
    await settle(app)
    assert app.stats.count("completed") == 6


async def test_a_stream_hears_its_client_go_away_through_the_edge(
    running: tuple[App, int],
) -> None:
    """The edge listens for the disconnect before the streaming response starts its own
    listener: the message is handed to whoever waits, the stream stops, and the request is
    abandoned (O1)."""
    app, port = running
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /stream-later HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"0\n"), 5)  # the first tick
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()
    await settle(app)
    await asyncio.sleep(0.2)
    assert app.received == [b"hi"]
    assert app.cancelled == ["stream"]  # stopped, not run to its 40th tick
    assert app.stats.count("abandoned") == 1
    assert app.stats.count("completed") == 0
    assert app.bulkhead.in_flight == 0


async def test_a_stream_whose_client_stays_completes(running: tuple[App, int]) -> None:
    app, port = running
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /stream-later HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await writer.drain()
    got = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)  # the last chunk
    assert b"HTTP/1.1 200" in got and b"39\n" in got
    writer.close()
    await writer.wait_closed()
    await settle(app)
    assert app.cancelled == []
    assert app.stats.count("completed") == 1


# -- HTTP/2: a body nobody declared ----------------------------------------------------------------


class Uploads:
    """A raw ASGI app behind `BrownoutMiddleware` (20 ms sweep), under a layer that notes
    every message the server hands out and when, to see what the edge reads ahead."""

    def __init__(self) -> None:
        hub = EventHub()
        self.stats = Stats()
        hub.subscribe(self.stats)
        self.bulkhead = Bulkhead("api", FixedLimit(8), events=hub)
        policy = EdgePolicy(bulkhead=self.bulkhead, sweep_period=0.02, events=hub)
        self.edge = BrownoutMiddleware(self.handler, policy)
        self.server_reads: list[tuple[float, int]] = []
        self.app_reads_from = 0.0
        self.received = 0
        self.cancelled = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan: nothing to start
        assert scope["http_version"] == "2"

        async def noted() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.server_reads.append((time.monotonic(), len(message.get("body", b""))))
            return message

        await self.edge(scope, noted, send)

    async def handler(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(0.3)  # old long before it reads its body
            self.app_reads_from = time.monotonic()
            while True:
                message = await receive()
                self.received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            if scope["path"] == "/wait":
                await asyncio.sleep(10)  # until its client goes away
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": str(self.received).encode()})
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def chunks(n: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield b"x" * size
        await asyncio.sleep(0)


async def test_an_undeclared_http2_body_is_not_read_ahead_of_the_app() -> None:
    # HTTP/2 needs no content-length, so a request without one may still have a body. The
    # edge took such a request for bodiless and its disconnect watch read the whole upload
    # into memory while the application was not reading (4 MiB in 323 messages here, with
    # no backpressure). It now reads ahead at most `WATCH_READ_AHEAD` bytes (so that a
    # handler that never reads its body still hears its client leave), and resumes watching
    # once the application has caught up.
    app = Uploads()
    async with (
        serve_hypercorn(app) as base,
        httpx.AsyncClient(base_url=base, http1=False, http2=True, timeout=10) as client,
    ):
        r = await client.post("/upload", content=chunks(64, 65536))
        assert r.http_version == "HTTP/2"
        assert r.status_code == 200 and r.text == str(64 * 65536)
        ahead = [size for at, size in app.server_reads if at < app.app_reads_from]
        assert sum(ahead[:-1]) < WATCH_READ_AHEAD, f"{sum(ahead)} bytes read before the app asked"

        # Body read, the watch resumed: a client that goes away now is heard (D5, O1).
        app.received = 0
        leaving = httpx.AsyncClient(base_url=base, http1=False, http2=True, timeout=10)
        waiting = asyncio.create_task(leaving.post("/wait", content=chunks(3, 1024)))
        for _ in range(200):
            if app.received == 3 * 1024:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the handler waits; the watch has resumed
        waiting.cancel()
        await leaving.aclose()  # the connection goes, and the stream with it
        for _ in range(100):
            if app.cancelled:
                break
            await asyncio.sleep(0.02)
        assert app.cancelled, "the handler kept running after its client went away"
    assert app.stats.count("abandoned") == 1
    assert app.stats.count("completed") == 1
    assert app.bulkhead.in_flight == 0
