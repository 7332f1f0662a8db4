"""The embedded demo system: a dependency with a known capacity and a front service calling it.

- **backend** (the dependency): ``GET /work`` holds one of ``concurrency`` slots for ``latency``
  seconds (8 x 40 ms by default: about 200 requests/s); beyond that, requests queue, unbounded,
  like most real dependencies. ``POST /admin`` changes latency and concurrency mid-run (the
  slow-dependency and capacity-loss scenarios: the dependency's own capacity);
  ``GET /admin/stats`` reports what it did, including the requests that reached it per 100 ms
  (retry amplification, thundering herds). With ``--proxy`` the same process also serves
  `brownout proxy` (`brownout._lab.proxy.FaultProxy`, http mode) in front of it: the front
  calls the proxy, and the network's faults (error responses in partial errors, resets in the
  outage) are set on the proxy's control endpoint; the arrivals are then counted at the proxy.
- **front** (the service under test): ``GET /api/interactive`` and ``GET /api/batch`` call the
  backend through a pooled aiohttp client, passing the remaining budget with
  `brownout.wire.outbound_headers`; ``GET /healthz`` answers directly. The same handler
  code runs in every configuration: ``unprotected``, ``fixed`` and ``adaptive`` (the latter two
  add brownout's ASGI middleware through the public API, nothing else, plus
  ``GET /lab/bulkhead`` showing the limit, in-flight count and queue depth), and uvicorn's
  own ``--limit-concurrency`` on the unprotected app.
  ``GET /api/outbound`` calls the dependency with retries: 3 naive attempts unprotected,
  brownout's `Dependency` (budget, breaker, marker) protected. ``GET /api/recommendations``
  calls it too; protected, it is served from a stale cache while the declared degraded mode
  ``recommendations`` is on (entered when the dependency gets slow, or by ``--drill``).

Run one with ``python -m brownout._lab.demo backend|front ...``: it binds 127.0.0.1 on an
ephemeral port, prints ``PORT <n>`` and serves with uvicorn until terminated. ``sync-front``
serves the same front's ramp endpoints as a Flask app under gunicorn instead
(`brownout._lab.sync_front`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any, Literal

from .fds import fit_fd_limit

__all__ = ["Backend", "create_front", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FRONT_MODES = ("unprotected", "fixed", "adaptive")
NORMAL_TIMEOUT = 10.0
"""The front's own timeout for the dependency call when nothing shorter is known."""


ARRIVAL_BIN = 0.1
"""Seconds per bin of the backend's arrival counts (bins are ``time.monotonic()`` slices,
the same clock the generator's process uses, so the runner can align them to its steps)."""
MAX_ARRIVAL_BINS = 3000
ARRIVAL_READ = 0.01
"""Seconds between reads of a proxy's request counter (`_count_proxy_arrivals`)."""


class Backend:
    """A raw ASGI dependency with ``concurrency`` slots of ``latency`` seconds each.

    Every request that reaches ``/work`` is counted per `ARRIVAL_BIN`, unless
    ``counts_arrivals`` is off because a proxy in front of it counts them (`count_arrivals`).
    Failures other than its own slowness are the proxy's (``--proxy``).
    """

    def __init__(self, concurrency: int = 8, latency: float = 0.040) -> None:
        self.concurrency = concurrency
        self.latency = latency
        self.counts_arrivals = True
        self.active = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.served = 0
        self.max_waiting = 0
        self.with_budget = 0
        self.arrivals: dict[int, int] = {}

    def count_arrivals(self, key: int, n: int = 1) -> None:
        """``n`` more attempts in bin ``key`` (``int(time.monotonic() / ARRIVAL_BIN)``)."""
        if n <= 0:
            return
        arrivals = self.arrivals
        arrivals[key] = arrivals.get(key, 0) + n
        if len(arrivals) > MAX_ARRIVAL_BINS:
            del arrivals[next(iter(arrivals))]  # oldest first: dicts keep insertion order

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
            if self.counts_arrivals:
                self.count_arrivals(int(time.monotonic() / ARRIVAL_BIN))
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
            "arrival_bin": ARRIVAL_BIN,
            "arrivals": sorted(self.arrivals.items()),
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


NAIVE_RETRY_STATUSES = frozenset({429, 502, 503, 504})
FALLBACK_RECOMMENDATIONS = b"popular items"
"""What the degraded front serves when its cache is empty: a local default (G3)."""


class LatencySignal:
    """Is the dependency slow? An EWMA of call latency against the lowest EWMA seen.

    Slow when the average exceeds ``enter`` x the baseline; no longer slow below ``leave`` x
    (the gap is the hysteresis). Used by the demo's ``recommendations`` degraded mode.
    """

    def __init__(self, alpha: float = 0.2, enter: float = 2.5, leave: float = 1.5) -> None:
        self.alpha = alpha
        self.enter = enter
        self.leave = leave
        self.ewma: float | None = None
        self.baseline = float("inf")
        self.samples = 0
        self.slow = False

    def observe(self, seconds: float) -> None:
        self.samples += 1
        self.ewma = seconds if self.ewma is None else self.ewma + self.alpha * (seconds - self.ewma)
        if self.samples >= 20:
            self.baseline = min(self.baseline, self.ewma)
        if self.ewma > self.enter * self.baseline:
            self.slow = True
        elif self.ewma < self.leave * self.baseline:
            self.slow = False

    def __call__(self) -> bool:
        return self.slow


def create_front(backend_url: str, mode: str = "unprotected", drill: str | None = None) -> Any:
    """The front service as a Starlette app; ``mode`` adds brownout's middleware or not.

    ``drill`` forces that declared degraded mode on for the life of the process (protected
    modes only: the unprotected front declares none).
    """
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route as StarletteRoute

    from brownout import Rejected, StaleCache, call_budget
    from brownout.testing import drill as start_drill
    from brownout.wire import outbound_headers, stale_headers

    from .protect import DEMO_MODES, OUTBOUND_ATTEMPTS, degraded_modes, outbound_session

    if mode not in FRONT_MODES:
        raise ValueError(f"mode must be one of {FRONT_MODES}")
    if drill is not None and drill not in DEMO_MODES:
        raise ValueError(f"--drill must name a declared mode: {', '.join(DEMO_MODES)}")
    protected = mode != "unprotected"
    holder: dict[str, aiohttp.ClientSession] = {}
    work_url = backend_url.rstrip("/") + "/work"
    slow = LatencySignal()
    modes = degraded_modes(slow) if protected else None
    cache: StaleCache[str, bytes] = StaleCache(
        max_entries=16, fresh_for=0.1, max_staleness=60.0, name="recommendations"
    )

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # aiohttp's default pool: up to 100 connections to the dependency, waiters beyond.
        connector = aiohttp.TCPConnector(limit=100, force_close=False)
        holder["session"] = aiohttp.ClientSession(connector=connector)
        if protected:
            holder["outbound"] = outbound_session()
        if drill is not None and modes is not None:
            with start_drill(modes, drill):
                yield
        else:
            yield
        for session in holder.values():
            await session.close()

    async def call_backend() -> tuple[int, bytes]:
        """One plain call to the dependency within the request's budget."""
        budget = call_budget(NORMAL_TIMEOUT, reserve=0.005)
        async with holder["session"].get(
            work_url,
            headers=outbound_headers(reserve=0.005),
            timeout=aiohttp.ClientTimeout(total=budget),
        ) as upstream:
            return upstream.status, await upstream.read()

    async def work(request: Request) -> Response:
        try:
            status, body = await call_backend()
        except Rejected:
            return PlainTextResponse("deadline exceeded", status_code=504)
        except TimeoutError:
            return PlainTextResponse("dependency timed out", status_code=504)
        except aiohttp.ClientError:
            return PlainTextResponse("dependency failed", status_code=502)
        return Response(body, status_code=200 if status == 200 else 502, media_type="text/plain")

    async def outbound_naive(request: Request) -> Response:
        # What most services ship: retry any failure at once, no budget, no marker.
        answer: Response = PlainTextResponse("dependency failed", status_code=502)
        for _ in range(OUTBOUND_ATTEMPTS):
            answer = await work(request)
            if answer.status_code == 200 or answer.status_code not in NAIVE_RETRY_STATUSES:
                return answer
        return answer

    async def outbound_protected(request: Request) -> Response:
        # Retries, budget, breaker and deadline come from the Dependency; giving up raises
        # RetriesExhausted (a Rejected), which the edge answers 503 + brownout-retry: never.
        try:
            async with holder["outbound"].get(work_url) as upstream:
                body = await upstream.read()
                status = upstream.status
        except aiohttp.ClientError:
            return PlainTextResponse("dependency failed", status_code=502)
        return Response(body, status_code=200 if status == 200 else 502, media_type="text/plain")

    async def fresh_recommendations(request: Request) -> Response:
        started = asyncio.get_running_loop().time()
        try:
            status, body = await call_backend()
        except Rejected:
            return PlainTextResponse("deadline exceeded", status_code=504)
        except TimeoutError:
            slow.observe(asyncio.get_running_loop().time() - started)
            return PlainTextResponse("dependency timed out", status_code=504)
        except aiohttp.ClientError:
            return PlainTextResponse("dependency failed", status_code=502)
        slow.observe(asyncio.get_running_loop().time() - started)
        if status != 200:
            return PlainTextResponse("dependency failed", status_code=502)
        if "recs" not in cache:

            async def known() -> bytes:
                return body

            await cache.get("recs", known)
        return Response(body, media_type="text/plain")

    async def refresh() -> bytes:
        # Background revalidation (one in flight): also keeps the latency signal current,
        # so the mode leaves once the dependency is fast again.
        started = asyncio.get_running_loop().time()
        async with holder["session"].get(
            work_url, timeout=aiohttp.ClientTimeout(total=NORMAL_TIMEOUT)
        ) as upstream:
            body = await upstream.read()
        slow.observe(asyncio.get_running_loop().time() - started)
        if upstream.status != 200:
            raise RuntimeError(f"dependency answered {upstream.status}")
        return body

    async def cached_recommendations(request: Request) -> Response:
        served = cache.peek("recs")
        if served is None:
            return Response(FALLBACK_RECOMMENDATIONS, media_type="text/plain")
        # Serves what the cache holds now; a stale entry starts one background refresh.
        served = await cache.get("recs", refresh)
        return Response(served.value, media_type="text/plain", headers=stale_headers(served.age))

    recommendations = (
        modes.fallback("recommendations", cached_recommendations)(fresh_recommendations)
        if modes is not None
        else fresh_recommendations
    )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[
            StarletteRoute("/api/interactive", work),
            StarletteRoute("/api/batch", work),
            StarletteRoute("/api/outbound", outbound_protected if protected else outbound_naive),
            StarletteRoute("/api/recommendations", recommendations),
            StarletteRoute("/healthz", health),
        ],
        lifespan=lifespan,
    )
    if protected:
        from starlette.responses import JSONResponse

        from .protect import protect

        bulkhead = protect(app, mode, degraded=modes)
        algorithm = bulkhead.limit_algorithm

        from brownout._admission.loop_lag import loop_lag

        async def bulkhead_state(request: Request) -> Response:
            lag = loop_lag()  # the probe the bulkhead reads
            return JSONResponse(
                {
                    "limit": bulkhead.limit,
                    "in_flight": bulkhead.in_flight,
                    "queue_depth": bulkhead.queue_depth,
                    "degraded": list(modes.active_names()) if modes is not None else [],
                    # What an adaptive limit believes (None for a fixed one): the lab's
                    # window into why the limit moved.
                    "short_rtt": getattr(algorithm, "short_rtt", None),
                    "no_load_rtt": getattr(algorithm, "no_load_rtt", None),
                    "probing": getattr(algorithm, "probing", False),
                    "queue_bound": getattr(bulkhead.queue, "short_bound", None),
                    "loop_lag": {"mean": lag.mean, "peak": lag.peak},
                }
            )

        app.add_route("/lab/bulkhead", bulkhead_state)
    return app


_SERVER_CONNECTIONS = 4096
"""Sockets a demo server makes room for: what it accepts and what it opens, with headroom."""


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    # Listening before the port is announced: a client that connects while uvicorn is still
    # starting waits in the backlog instead of being refused.
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _exit_with_parent(parent: int) -> None:
    """Exit once ``parent`` is no longer this process's parent (it died: no one will stop us)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """``python -m brownout._lab.demo backend|front [options]``: serve one demo process."""
    parser = argparse.ArgumentParser(prog="python -m brownout._lab.demo")
    parser.add_argument("role", choices=("backend", "front", "sync-front"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.040)
    parser.add_argument("--backend-url", default="")
    parser.add_argument("--mode", choices=FRONT_MODES, default="unprotected")
    parser.add_argument("--limit-concurrency", type=int, default=None)
    parser.add_argument("--cpus", default="", help="comma-separated cores to pin to")
    parser.add_argument("--drill", default=None, help="force this degraded mode on (front)")
    parser.add_argument(
        "--metrics", action="store_true", help="serve brownout's metrics at /metrics (front)"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it is gone")
    parser.add_argument("--proxy", action="store_true", help="backend: brownout proxy in front")
    parser.add_argument("--seed", type=int, default=1, help="seed of the proxy's fault draws")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    # Bind and announce the port first, so the parent can start the next process while this
    # one is still importing uvicorn and the app.
    sock = _listen()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    # The generator's pool (1,024 connections) plus this server's own to its dependency: more
    # than a stock soft limit of 1,024, and the front would refuse connections (EMFILE).
    fit_fd_limit(_SERVER_CONNECTIONS)

    from .process import pin_to

    pin_to([int(c) for c in args.cpus.split(",") if c])
    if args.role == "sync-front":
        from .sync_front import serve

        serve(sock, args.backend_url, args.mode)  # gunicorn's worker inherits the pinning
        return 0

    import uvicorn

    backend: Backend | None = None
    if args.role == "backend":
        backend = Backend(args.concurrency, args.latency)
        app: Any = backend
        lifespan: Literal["on", "off"] = "off"
    else:
        app = create_front(args.backend_url, args.mode, args.drill)
        if args.metrics:
            from .protect import expose_metrics

            app = expose_metrics(app)
        lifespan = "on"
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="auto",  # httptools when installed (the lab extra brings it): h11 is slower
        lifespan=lifespan,
        # uvicorn logs each connection its --limit-concurrency refuses at warning level: tens
        # of thousands of lines over the lab's console, for refusals the lab counts anyway.
        log_level="error" if args.limit_concurrency is not None else "warning",
        access_log=False,
        timeout_keep_alive=60,
        backlog=4096,
        limit_concurrency=args.limit_concurrency,
    )
    server = uvicorn.Server(config)
    if backend is not None and args.proxy:
        from .process import new_event_loop

        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(_serve_behind_proxy(server, sock, backend, args.seed))
        return 0
    server.run(sockets=[sock])
    return 0


async def _serve_behind_proxy(
    server: Any, sock: socket.socket, backend: Backend, seed: int
) -> None:
    """Serve ``backend`` with `brownout proxy` in front of it on this process's loop; prints
    ``PROXY <port> <control port>`` once the proxy listens."""
    from .proxy import FaultProxy

    upstream = ("127.0.0.1", sock.getsockname()[1])
    proxy = FaultProxy(upstream, mode="http", control=("127.0.0.1", 0), seed=seed)
    await proxy.start()
    assert proxy.control_address is not None
    print(f"PROXY {proxy.address[1]} {proxy.control_address[1]}", flush=True)
    # The attempts on their way to the dependency, the ones the proxy fails included.
    backend.counts_arrivals = False
    counting = asyncio.create_task(_count_proxy_arrivals(proxy, backend))
    try:
        await server.serve(sockets=[sock])
    finally:
        counting.cancel()
        await proxy.close()


async def _count_proxy_arrivals(proxy: Any, backend: Backend) -> None:
    """Add the requests ``proxy`` received to ``backend``'s arrivals, read from its public
    counters every `ARRIVAL_READ` seconds (no hook in the proxy's request path); the count
    goes to the bin of the middle of the interval read, so a busy loop's late wake-up moves
    it by about half the late time, not by a whole interval."""
    seen = proxy.stats().requests
    last = time.monotonic()
    while True:
        await asyncio.sleep(ARRIVAL_READ)
        now = time.monotonic()
        count = proxy.stats().requests
        backend.count_arrivals(int((last + now) / 2 / ARRIVAL_BIN), count - seen)
        seen, last = count, now


if __name__ == "__main__":
    sys.exit(main())
