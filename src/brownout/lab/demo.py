"""The embedded demo system: a dependency with a known capacity and a front service calling it.

- **backend** (the dependency): ``GET /work`` holds one of ``concurrency`` slots for ``latency``
  seconds (8 x 20 ms by default: about 400 requests/s); beyond that, requests queue, unbounded,
  like most real dependencies. ``POST /admin`` changes latency and concurrency mid-run (the
  slow-dependency and capacity-loss scenarios); ``GET /admin/stats`` reports what it did.
- **front** (the service under test): ``GET /api/interactive`` and ``GET /api/batch`` call the
  backend through a pooled aiohttp client, passing the remaining budget with
  `brownout.propagation.outbound_headers`; ``GET /healthz`` answers directly. The same handler
  code runs in every configuration: ``unprotected``, ``fixed`` and ``adaptive`` (the latter two
  add brownout's ASGI middleware through the public API, nothing else, plus
  ``GET /lab/bulkhead`` showing the limit, in-flight count and queue depth), and uvicorn's
  own ``--limit-concurrency`` on the unprotected app.

Run one with ``python -m brownout.lab.demo backend|front ...``: it binds 127.0.0.1 on an
ephemeral port, prints ``PORT <n>`` and serves with uvicorn until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any, Literal

__all__ = ["Backend", "create_front", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FRONT_MODES = ("unprotected", "fixed", "adaptive")
NORMAL_TIMEOUT = 10.0
"""The front's own timeout for the dependency call when nothing shorter is known."""


class Backend:
    """A raw ASGI dependency with ``concurrency`` slots of ``latency`` seconds each."""

    def __init__(self, concurrency: int = 8, latency: float = 0.020) -> None:
        self.concurrency = concurrency
        self.latency = latency
        self.active = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.served = 0
        self.max_waiting = 0
        self.with_budget = 0

    async def _acquire(self) -> None:
        if self.active < self.concurrency and not self.waiters:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.max_waiting = max(self.max_waiting, len(self.waiters))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over as we were cancelled
            else:
                self.waiters.remove(fut)
            raise

    def _release(self) -> None:
        self.active -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters and self.active < self.concurrency:
            fut = self.waiters.popleft()
            if not fut.done():
                self.active += 1
                fut.set_result(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/work":
            if any(k == b"brownout-budget-ms" for k, _ in scope["headers"]):
                self.with_budget += 1
            await self._acquire()
            try:
                await asyncio.sleep(self.latency)
            finally:
                self._release()
            self.served += 1
            await _reply(send, 200, b"ok", b"text/plain")
        elif path == "/admin" and scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            change = json.loads(body or b"{}")
            if "latency" in change:
                self.latency = float(change["latency"])
            if "concurrency" in change:
                self.concurrency = max(1, int(change["concurrency"]))
                self._wake()
            await _reply(send, 200, json.dumps(self.stats()).encode(), b"application/json")
        elif path == "/admin/stats":
            await _reply(send, 200, json.dumps(self.stats()).encode(), b"application/json")
        else:
            await _reply(send, 404, b"not found", b"text/plain")

    def stats(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "latency": self.latency,
            "active": self.active,
            "waiting": len(self.waiters),
            "max_waiting": self.max_waiting,
            "served": self.served,
            "with_budget": self.with_budget,
        }


async def _reply(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_front(backend_url: str, mode: str = "unprotected") -> Any:
    """The front service as a Starlette app; ``mode`` adds brownout's middleware or not."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route as StarletteRoute

    from brownout import Rejected, call_budget
    from brownout.propagation import outbound_headers

    if mode not in FRONT_MODES:
        raise ValueError(f"mode must be one of {FRONT_MODES}")
    holder: dict[str, aiohttp.ClientSession] = {}
    work_url = backend_url.rstrip("/") + "/work"

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # aiohttp's default pool: up to 100 connections to the dependency, waiters beyond.
        connector = aiohttp.TCPConnector(limit=100, force_close=False)
        holder["session"] = aiohttp.ClientSession(connector=connector)
        yield
        await holder["session"].close()

    async def work(request: Request) -> Response:
        try:
            budget = call_budget(NORMAL_TIMEOUT, reserve=0.005)
        except Rejected:
            return PlainTextResponse("deadline exceeded", status_code=504)
        try:
            async with holder["session"].get(
                work_url,
                headers=outbound_headers(reserve=0.005),
                timeout=aiohttp.ClientTimeout(total=budget),
            ) as upstream:
                body = await upstream.read()
                status = 200 if upstream.status == 200 else 502
        except TimeoutError:
            return PlainTextResponse("dependency timed out", status_code=504)
        except aiohttp.ClientError:
            return PlainTextResponse("dependency failed", status_code=502)
        return Response(body, status_code=status, media_type="text/plain")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[
            StarletteRoute("/api/interactive", work),
            StarletteRoute("/api/batch", work),
            StarletteRoute("/healthz", health),
        ],
        lifespan=lifespan,
    )
    if mode != "unprotected":
        from starlette.responses import JSONResponse

        from .protect import protect

        bulkhead = protect(app, mode)

        async def bulkhead_state(request: Request) -> Response:
            return JSONResponse(
                {
                    "limit": bulkhead.limit,
                    "in_flight": bulkhead.in_flight,
                    "queue_depth": bulkhead.queue_depth,
                }
            )

        app.add_route("/lab/bulkhead", bulkhead_state)
    return app


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    """``python -m brownout.lab.demo backend|front [options]``: serve one demo process."""
    parser = argparse.ArgumentParser(prog="python -m brownout.lab.demo")
    parser.add_argument("role", choices=("backend", "front"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.020)
    parser.add_argument("--backend-url", default="")
    parser.add_argument("--mode", choices=FRONT_MODES, default="unprotected")
    parser.add_argument("--limit-concurrency", type=int, default=None)
    parser.add_argument("--cpus", default="", help="comma-separated cores to pin to")
    args = parser.parse_args(argv)
    # Bind and announce the port first, so the parent can start the next process while this
    # one is still importing uvicorn and the app.
    sock = _listen()
    print(f"PORT {sock.getsockname()[1]}", flush=True)

    import uvicorn

    from .process import pin_to

    pin_to([int(c) for c in args.cpus.split(",") if c])
    if args.role == "backend":
        app: Any = Backend(args.concurrency, args.latency)
        lifespan: Literal["on", "off"] = "off"
    else:
        app = create_front(args.backend_url, args.mode)
        lifespan = "on"
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="auto",  # httptools when installed (the lab extra brings it): h11 is 3x slower
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=60,
        backlog=4096,
        limit_concurrency=args.limit_concurrency,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
