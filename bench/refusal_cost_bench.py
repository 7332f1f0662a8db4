"""Refusal cost: server CPU per refused request, brownout's 503 against uvicorn's own.

Starts, in the same run, three uvicorn servers (uvloop, httptools, as the lab's demo front
runs them), each pinned to core 0 while this process, the client, runs on core 1:

- ``brownout``: a Starlette app behind `BrownoutMiddleware` with the lab's fixed policy
  (`brownout._lab.protect`: a fixed limit of 10 and a FIFO queue of 10, trusted priority
  headers, the demo's degraded modes), except that the queue's age bound is long so that the
  held requests stay queued. The client first serves a few thousand requests (the latency
  estimator learns the route, so refusals carry ``Retry-After``), then holds the limit and the
  queue with long ``/hold`` requests: every request of the flood is an immediate
  ``queue_full`` 503 on a kept-alive connection;
- ``uvicorn``: the same app, unprotected, under ``--limit-concurrency`` held full the same way:
  uvicorn answers its own 503 with ``connection: close``, and the client reconnects for the
  next request (accept and a new protocol object are part of that refusal as the server sees
  it);
- ``bare``: the same app, unprotected, unlimited: CPU per *served* request, for context.

Each flood is a bounded number of requests from ``CONNS`` raw asyncio connections. Server
CPU is read from ``/proc/<pid>/task/*/schedstat`` around each flood and divided by the 503s
the client counted (every answer is checked). Rounds alternate the two servers; the bench
prints us per refusal for each, the ratio brownout/uvicorn (target < 1.0) per round, median
and best, and the host facts. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/refusal_cost_bench.py

``--profile OUT [N]`` instead profiles the brownout server over one flood of N refusals
(py-spy attached to it, raw collapsed stacks written to OUT): for the breakdown, not for
figures (sampling slows the server).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

ROUNDS = 5
N = 4_000
SERVED_N = 4_000
CONNS = 16
LIMIT = 10
QUEUE = 10
SERVER_CPU, CLIENT_CPU = 0, 1

REQUEST = b"GET /api/interactive HTTP/1.1\r\nhost: bench\r\n\r\n"
HOLD = b"GET /hold HTTP/1.1\r\nhost: bench\r\n\r\n"


# -- the servers (child processes) ---------------------------------------------------------------


def app(kind: str) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route as StarletteRoute

    async def interactive(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def hold(request: Request) -> Response:
        await asyncio.sleep(600)  # held until the bench ends
        return Response(b"")

    app = Starlette(
        routes=[StarletteRoute("/api/interactive", interactive), StarletteRoute("/hold", hold)]
    )
    if kind == "brownout":
        from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Priority, Route, Trust
        from brownout._lab.demo import LatencySignal
        from brownout._lab.protect import degraded_modes
        from brownout.integrations.asgi import BrownoutMiddleware
        from brownout.limits import FixedLimit
        from brownout.queues import FifoQueue

        # `brownout._lab.protect.protect(app, "fixed")`, with a queue that keeps its holders.
        policy = EdgePolicy(
            bulkhead=Bulkhead(
                "front", FixedLimit(LIMIT), FifoQueue(max_size=QUEUE, max_wait=600.0)
            ),
            deadline=InboundDeadlinePolicy(default=1.0, maximum=10.0),
            trust=Trust.TRUSTED,
            health_paths=("/healthz", "/lab/bulkhead"),
            routes={
                "/api/interactive": Route(priority=Priority.CRITICAL),
                "/hold": Route(priority=Priority.CRITICAL, default=600.0, maximum=600.0),
            },
            degraded=degraded_modes(LatencySignal()),
        )
        app.add_middleware(BrownoutMiddleware, policy=policy)
    return app


def serve(kind: str) -> None:
    import socket

    import uvicorn

    os.sched_setaffinity(0, {SERVER_CPU})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        app(kind),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level="error",  # uvicorn logs every refused connection at warning level
        access_log=False,
        timeout_keep_alive=60,
        limit_concurrency=LIMIT if kind == "uvicorn" else None,
    )
    uvicorn.Server(config).run(sockets=[sock])


# -- the client ----------------------------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` (``schedstat``: nanoseconds)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


class Tally:
    """Requests left to send, answers by status, and a future done once all are answered."""

    __slots__ = ("done", "left", "sample", "statuses", "waiting")

    def __init__(self, n: int, done: asyncio.Future[None]) -> None:
        self.left = self.waiting = n
        self.statuses: dict[int, int] = {}
        self.done = done
        self.sample = b""

    def count(self, head: bytes) -> None:
        status = int(head[9:12])
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if not self.sample:
            self.sample = head
        self.waiting -= 1
        if not self.waiting:
            self.done.set_result(None)


def _content_length(head: bytes) -> int:
    i = head.lower().find(b"\r\ncontent-length:")
    if i < 0:
        return 0
    j = head.find(b"\r\n", i + 2)
    return int(head[i + 17 : j if j >= 0 else len(head)])


class KeepAlive(asyncio.Protocol):
    """Requests one after another on one connection while the tally has some left."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.next()

    def next(self) -> None:
        tally = self.tally
        if tally.left > 0:
            tally.left -= 1
            self.transport.write(REQUEST)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[: end + 2]
            size = end + 4 + _content_length(head)
            if len(buf) < size:
                break
            buf = buf[size:]
            self.tally.count(head)
            self.next()
        self.buf = buf


class OneShot(asyncio.Protocol):
    """One request on a new connection, read to the server's close; then the next one."""

    def __init__(self, tally: Tally, port: int) -> None:
        self.tally = tally
        self.port = port
        self.buf = b""

    def connection_made(self, transport: Any) -> None:
        transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        self.buf += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.tally.count(self.buf)
        start_one_shot(self.tally, self.port)


def start_one_shot(tally: Tally, port: int) -> None:
    if tally.left <= 0:
        return
    tally.left -= 1
    loop = asyncio.get_running_loop()
    task = loop.create_task(loop.create_connection(lambda: OneShot(tally, port), "127.0.0.1", port))
    task.add_done_callback(_check_connected)


def _check_connected(task: asyncio.Task[Any]) -> None:
    if task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def flood_keepalive(port: int, n: int) -> Tally:
    loop = asyncio.get_running_loop()
    tally = Tally(n, loop.create_future())
    for _ in range(CONNS):
        await loop.create_connection(lambda: KeepAlive(tally), "127.0.0.1", port)
    await tally.done
    return tally


async def flood_reconnect(port: int, n: int) -> Tally:
    loop = asyncio.get_running_loop()
    tally = Tally(n, loop.create_future())
    for _ in range(CONNS):
        start_one_shot(tally, port)
    await tally.done
    return tally


async def hold(port: int, count: int) -> list[Any]:
    loop = asyncio.get_running_loop()
    held = []
    for _ in range(count):
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        transport.write(HOLD)
        held.append(transport)
    await asyncio.sleep(0.3)
    return held


def start(kind: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("PORT "), line
    return proc, int(line.split()[1])


async def measure(
    flood: Any, pid: int, port: int, n: int, expect: int
) -> tuple[float, float, Tally]:
    """Server CPU per answer with status ``expect`` and answers per second."""
    c, t = process_cpu(pid), time.perf_counter()
    tally = await flood(port, n)
    wall = time.perf_counter() - t
    cpu = process_cpu(pid) - c
    got = tally.statuses.get(expect, 0)
    assert got == n, (tally.statuses, tally.sample)
    assert len(tally.statuses) == 1, (tally.statuses, tally.sample)
    return cpu / got, got / wall, tally


def host_facts() -> str:
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return f"host: {model}, {os.cpu_count()} cores, load {load}, python {sys.version.split()[0]}"


async def main(rounds: int, n: int) -> None:
    import brownout

    print(host_facts())
    print(f"brownout from {os.path.dirname(brownout.__file__)}")
    servers = {kind: start(kind) for kind in ("brownout", "uvicorn", "bare")}
    pids = {kind: proc.pid for kind, (proc, _) in servers.items()}
    held: list[Any] = []
    try:
        b_port, u_port, bare_port = (servers[k][1] for k in ("brownout", "uvicorn", "bare"))
        # Served first: the bare app's CPU per request; brownout's estimator learns the route.
        served = []
        for _ in range(rounds):
            served.append(
                (await measure(flood_keepalive, pids["bare"], bare_port, SERVED_N, 200))[0]
            )
        await measure(flood_keepalive, pids["brownout"], b_port, SERVED_N, 200)
        held += await hold(b_port, LIMIT + QUEUE)
        held += await hold(u_port, LIMIT)
        # Warm up both refusal paths, then alternate.
        _, _, sample_b = await measure(flood_keepalive, pids["brownout"], b_port, 500, 503)
        _, _, sample_u = await measure(flood_reconnect, pids["uvicorn"], u_port, 500, 503)
        print("brownout's refusal head:", sample_b.sample.decode().replace("\r\n", " | "))
        print("uvicorn's refusal head: ", sample_u.sample.decode().replace("\r\n", " | "))
        rows = []
        for r in range(rounds):
            b, b_rate, _ = await measure(flood_keepalive, pids["brownout"], b_port, n, 503)
            u, u_rate, _ = await measure(flood_reconnect, pids["uvicorn"], u_port, n, 503)
            rows.append((b, u))
            print(
                f"round {r + 1}: brownout {b * 1e6:6.1f} us/refusal ({b_rate:6.0f}/s, kept "
                f"alive), uvicorn --limit-concurrency {u * 1e6:6.1f} us/refusal "
                f"({u_rate:6.0f}/s, closed): ratio {b / u:.3f}"
            )
        ratios = sorted(b / u for b, u in rows)
        best_b, best_u = min(b for b, _ in rows), min(u for _, u in rows)
        print(
            f"server CPU per refusal, best: brownout {best_b * 1e6:.1f} us, uvicorn "
            f"{best_u * 1e6:.1f} us; ratio brownout/uvicorn median {ratios[len(ratios) // 2]:.3f}"
            f", best/best {best_b / best_u:.3f} (target < 1.0); {n} refusals x {rounds} rounds, "
            f"{CONNS} connections"
        )
        print(
            f"context: bare app, server CPU per served request {min(served) * 1e6:.1f} us "
            f"(best of {rounds}); refusal/served brownout {best_b / min(served):.3f}, "
            f"uvicorn {best_u / min(served):.3f}"
        )
        print(host_facts())
    finally:
        for t in held:
            t.close()
        for proc, _ in servers.values():
            proc.kill()  # (SIGTERM waits for the held requests: uvicorn's graceful shutdown)
        for proc, _ in servers.values():
            proc.wait()


def start_spy(pid: int, out: str) -> subprocess.Popen[bytes]:
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    cmd = [spy, "record", "--pid", str(pid), "-r", "1000", "-f", "raw", "-o", out]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


async def profile(out: str, n: int) -> None:
    """py-spy on the brownout server over a flood of ``n`` refusals (as `main` sets it up)."""
    proc, port = start("brownout")
    held: list[Any] = []
    try:
        await measure(flood_keepalive, proc.pid, port, SERVED_N, 200)
        held += await hold(port, LIMIT + QUEUE)
        await measure(flood_keepalive, proc.pid, port, 500, 503)
        spy = start_spy(proc.pid, out)
        await asyncio.sleep(1.0)  # py-spy attaches
        per, rate, _ = await measure(flood_keepalive, proc.pid, port, n, 503)
        spy.send_signal(signal.SIGINT)
        spy.wait()
        print(f"profiled {n} refusals: {per * 1e6:.1f} us/refusal under py-spy, {rate:.0f}/s")
    finally:
        for t in held:
            t.close()
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        import uvloop

        os.sched_setaffinity(0, {CLIENT_CPU})
        args = sys.argv[1:]
        if args[:1] == ["--profile"]:
            uvloop.run(profile(args[1], int(args[2]) if len(args) > 2 else 50_000))
            sys.exit()
        rounds = int(args[0]) if args else ROUNDS
        n = int(args[1]) if len(args) > 1 else N
        uvloop.run(main(rounds, n))
