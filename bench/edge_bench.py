"""Edge benchmark: ASGI middleware overhead, and server CPU of a refusal vs a success.

Prints, in one run:

1. overhead per request of `BrownoutMiddleware` on a trivial FastAPI endpoint against the bare
   app (target <= 1.15x), calling the ASGI app in-process with a synthetic scope, so the
   figure is the middleware's, not the network's; also against a bare Starlette endpoint and,
   as a diagnostic, around a no-op ASGI app (the middleware's own cost, without a framework);
2. the same trivial endpoint served over loopback, as a service runs it: server CPU per
   request (all threads, ``/proc/<pid>/task/*/schedstat``) with the middleware against
   without, for FastAPI under uvicorn (uvloop, httptools) and for aiohttp's own server with
   `brownout_middleware`, each pair of servers driven alternately by 8 keep-alive clients;
   the same for a unary grpc.aio method with and without `BrownoutServerInterceptor`;
3. server CPU (``time.process_time``) per refused request vs per served request of the lab's
   demo front endpoint (``/api/interactive`` behind a fixed limit of 10 and a queue of 5, its
   dependency in a subprocess so its CPU is not counted), target ratio < 0.2. Refusals are
   measured with the limit and queue held, so each is an immediate ``queue_full``.

Each figure is the best of several interleaved repetitions, so a noisy shared machine
inflates all sides alike. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/edge_bench.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute

from brownout import Bulkhead, EdgePolicy
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

REPS = 5
N = 5_000
CPU_N = 2_000

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


def scope_for(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers or [(b"host", b"bench")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


_REQUEST = {"type": "http.request", "body": b"", "more_body": False}


async def receive() -> Message:
    # The body; a real server would then block until the client goes away.
    return _REQUEST


class Sink:
    __slots__ = ("status",)

    def __init__(self) -> None:
        self.status = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


async def per_request(app: App, path: str, n: int) -> float:
    sink = Sink()
    t = time.perf_counter()
    for i in range(n):
        await app(scope_for(path), receive, sink)
        if i % 50 == 0:
            # Let the loop turn now and then, as a server's does between requests (it also
            # sweeps cancelled timers, which a loop that never turns would pile up).
            await asyncio.sleep(0)
    took = (time.perf_counter() - t) / n
    assert sink.status == 200, sink.status
    return took


def fastapi_app(protected: bool) -> FastAPI:
    app = FastAPI()

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    if protected:
        app.add_middleware(
            BrownoutMiddleware, policy=EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
        )
    return app


def starlette_app(protected: bool) -> Starlette:
    async def hello(request: Any) -> JSONResponse:
        return JSONResponse({"hello": "world"})

    app = Starlette(routes=[StarletteRoute("/hello", hello)])
    if protected:
        app.add_middleware(
            BrownoutMiddleware, policy=EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
        )
    return app


_START = {"type": "http.response.start", "status": 200, "headers": []}
_BODY = {"type": "http.response.body", "body": b'{"hello":"world"}'}


async def noop_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    await send(_START)
    await send(_BODY)


def noop_pair() -> tuple[App, App]:
    policy = EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
    return noop_app, BrownoutMiddleware(noop_app, policy=policy)


async def overhead() -> None:
    pairs: dict[str, tuple[App, App]] = {
        "FastAPI": (fastapi_app(False), fastapi_app(True)),
        "Starlette": (starlette_app(False), starlette_app(True)),
        "no-op app": noop_pair(),
    }
    for bare, protected in pairs.values():  # warm up (middleware stacks are built lazily)
        await per_request(bare, "/hello", 200)
        await per_request(protected, "/hello", 200)
    for name, (bare, protected) in pairs.items():
        best_bare = best_mw = float("inf")
        ratios = []
        for _ in range(REPS):
            b = await per_request(bare, "/hello", N)
            m = await per_request(protected, "/hello", N)
            best_bare, best_mw = min(best_bare, b), min(best_mw, m)
            ratios.append(m / b)
        ratios.sort()
        what = "(diagnostic: no framework)" if name == "no-op app" else "(target <= 1.15x)"
        print(
            f"{name:9s} trivial endpoint: bare {best_bare * 1e6:6.1f} us, with middleware "
            f"{best_mw * 1e6:6.1f} us (+{(best_mw - best_bare) * 1e6:.1f} us): best/best "
            f"{best_mw / best_bare:.3f}x, median round {ratios[len(ratios) // 2]:.3f}x {what}"
        )


# -- CPU of a refusal vs a success on the lab's demo front --------------------------------------


async def lifespan_start(app: App) -> Callable[[], Awaitable[None]]:
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def recv() -> Message:
        return await inbox.get()

    async def send(m: Message) -> None:
        await outbox.put(m)

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, recv, send))
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started

    async def stop() -> None:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task

    return stop


async def start_backend() -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "brownout._lab.demo",
        "backend",
        "--latency",
        "0.0",
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    assert line.startswith("PORT "), line
    return proc, int(line.split()[1])


async def set_backend_latency(port: int, latency: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"latency": latency}).encode()
    writer.write(
        b"POST /admin HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await reader.read()
    writer.close()


async def cpu_per_request(app: App, n: int, expect: int) -> float:
    sink = Sink()
    scope = scope_for("/api/interactive")
    c = time.process_time()
    for _ in range(n):
        await app(dict(scope), receive, sink)
    took = (time.process_time() - c) / n
    assert sink.status == expect, (sink.status, expect)
    return took


LIMIT, QUEUE = 10, 5


async def refusal_cost() -> None:
    from brownout._lab.demo import create_front
    from brownout.queues import FifoQueue

    backend, port = await start_backend()
    try:
        # The demo front as the lab's "fixed" configuration protects it, except that queued
        # requests wait long enough for the queue to stay full while refusals are measured.
        app: Any = create_front(f"http://127.0.0.1:{port}", "unprotected")
        app.add_middleware(
            BrownoutMiddleware,
            policy=EdgePolicy(
                bulkhead=Bulkhead(
                    "front", FixedLimit(LIMIT), FifoQueue(max_size=QUEUE, max_wait=60.0)
                ),
                health_paths=("/healthz",),
            ),
        )
        stop = await lifespan_start(app)
        try:
            await cpu_per_request(app, 200, 200)  # warm up: connections, caches
            best_served = best_refused = float("inf")
            for _ in range(REPS):
                await set_backend_latency(port, 0.0)
                best_served = min(best_served, await cpu_per_request(app, CPU_N // 4, 200))
                # Saturate: slow dependency, limit + queue held by in-flight requests. Held
                # 2 s, far longer than the refusals take to measure (~20 ms); the dependency's
                # connections stay busy that long after the holders are cancelled, and the
                # next round's served requests wait for them (30 s made the bench take 3 min).
                await set_backend_latency(port, 2.0)
                holders = [
                    asyncio.create_task(app(scope_for("/api/interactive"), receive, Sink()))
                    for _ in range(LIMIT + QUEUE)
                ]
                await asyncio.sleep(0.2)
                best_refused = min(best_refused, await cpu_per_request(app, CPU_N, 503))
                for h in holders:
                    h.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
            ratio = best_refused / best_served
            print(
                f"demo /api/interactive CPU: served {best_served * 1e6:6.1f} us, refused "
                f"{best_refused * 1e6:6.1f} us: refused/served = {ratio:.3f} (target < 0.2)"
            )
        finally:
            await stop()
    finally:
        backend.terminate()
        await backend.wait()


# -- served: uvicorn over loopback, server CPU per request ---------------------------------------


SERVED_N = 6_000
SERVED_REPS = 9
SERVED_CONCURRENCY = 8


def serve(framework: str, kind: str) -> None:
    """Child process: the trivial endpoint on an ephemeral port, bare or protected. FastAPI
    under uvicorn (its defaults pick uvloop and httptools when installed, as
    ``uvicorn[standard]`` does), or aiohttp's own server (its default asyncio loop)."""
    import socket

    if framework == "grpc":
        asyncio.run(_serve_grpc(kind))
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)  # connections made before the server is up wait instead of being refused
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    if framework == "aiohttp":
        from aiohttp import web

        from brownout.integrations.aiohttp_server import brownout_middleware

        async def hello(request: web.Request) -> web.Response:
            return web.json_response({"hello": "world"})

        policy = EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
        app = web.Application(
            middlewares=[brownout_middleware(policy)] if kind == "protected" else []
        )
        app.router.add_get("/hello", hello)
        web.run_app(app, sock=sock, print=None, access_log=None)
        return
    import uvicorn

    config = uvicorn.Config(
        fastapi_app(kind == "protected"), log_level="warning", access_log=False, lifespan="off"
    )
    uvicorn.Server(config).run(sockets=[sock])


async def _serve_grpc(kind: str) -> None:
    """A grpc.aio server with one unary method (bytes in, bytes out: no protoc), bare or
    behind `BrownoutServerInterceptor`."""
    import grpc
    import grpc.aio

    from brownout.integrations.grpc_server import BrownoutServerInterceptor

    async def hello(request: bytes, context: Any) -> bytes:
        return b"hello"

    policy = EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
    interceptors = [BrownoutServerInterceptor(policy)] if kind == "protected" else []
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Edge", {"Hello": grpc.unary_unary_rpc_method_handler(hello)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of process ``pid``, in nanoseconds' resolution (Linux
    ``/proc/<pid>/task/<tid>/schedstat``; ``/proc/<pid>/stat`` counts 10 ms ticks)."""
    import os

    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


async def served_round(call: Callable[[], Awaitable[None]], pid: int, n: int) -> float:
    """Server CPU per request over ``n`` requests, ``SERVED_CONCURRENCY`` at a time."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await call()

    c = process_cpu(pid)
    await asyncio.gather(*(worker(n // SERVED_CONCURRENCY) for _ in range(SERVED_CONCURRENCY)))
    return (process_cpu(pid) - c) / n


_LABELS = {
    "fastapi": "FastAPI   served by uvicorn",
    "aiohttp": "aiohttp   served by aiohttp",
    "grpc": "grpc.aio  unary call       ",
}


async def served(framework: str = "fastapi") -> None:
    import aiohttp
    import grpc.aio

    servers = {}
    for kind in ("bare", "protected"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve", framework, kind, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("PORT "), line
        servers[kind] = (proc, int(line.split()[1]))
    clients: list[Any] = []
    try:
        calls: dict[str, Callable[[], Awaitable[None]]] = {}
        for kind, (proc, port) in servers.items():
            # One keep-alive pool (or channel) per server; warm up its connections and caches.
            if framework == "grpc":
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                clients.append(channel)
                hello = channel.unary_unary("/bench.Edge/Hello")

                async def call(hello: Any = hello) -> None:
                    assert await hello(b"") == b"hello"

            else:
                session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=SERVED_CONCURRENCY)
                )
                clients.append(session)
                url = f"http://127.0.0.1:{port}/hello"

                async def call(session: Any = session, url: str = url) -> None:
                    async with session.get(url) as r:
                        await r.read()
                        assert r.status == 200, r.status

            calls[kind] = call
            await served_round(call, proc.pid, 800)
        best = {kind: float("inf") for kind in servers}
        ratios = []
        n = SERVED_N // 2 if framework == "grpc" else SERVED_N  # a call costs ~2x a request
        for _ in range(SERVED_REPS):
            got = {}
            for kind, (proc, _) in servers.items():
                got[kind] = await served_round(calls[kind], proc.pid, n)
                best[kind] = min(best[kind], got[kind])
            ratios.append(got["protected"] / got["bare"])
        ratios.sort()
        bare, mw = best["bare"], best["protected"]
        print(
            f"{_LABELS[framework]} over loopback: server CPU per request bare "
            f"{bare * 1e6:6.1f} us, with middleware {mw * 1e6:6.1f} us "
            f"(+{(mw - bare) * 1e6:.1f} us): best/best {mw / bare:.3f}x, median round "
            f"{ratios[len(ratios) // 2]:.3f}x"
            + (" (target <= 1.15x)" if framework == "fastapi" else " (for comparison)")
        )
    finally:
        for client in clients:
            await client.close()
        for proc, _ in servers.values():
            proc.terminate()
            await proc.wait()


async def main() -> None:
    await overhead()
    await served("fastapi")
    await served("aiohttp")
    await served("grpc")
    await refusal_cost()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        asyncio.run(main())
