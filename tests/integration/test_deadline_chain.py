"""One deadline across four hops and three protocols (D1, D2, D3, D4, D5).

driver --httpx--> A --aiohttp--> B --grpc--> C, each a real server on loopback behind
brownout's edge (A: FastAPI under uvicorn, B: aiohttp, C: grpc.aio), each calling the next
through brownout's client adapter with a `Dependency` that keeps a reserve for its own
answer. The driver sets one deadline. Every hop must see *less* time than the hop before it
had when it called (never a fresh or longer timeout, whatever the protocol's encoding does
to it; the reserve comes off at each call), and when the deadline passes while C is still
working, the work stops at every hop: C's handler is cancelled, each hop answers or gives
up, and the driver's call ends within its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import grpc.aio
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from tests.integration.servers import serve

import brownout
from brownout import Dependency, EdgePolicy, InboundDeadlinePolicy, Trust
from brownout.integrations.aiohttp_client import BrownoutClientMiddleware
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.grpc_client import brownout_interceptors
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration

RESERVE = 0.05
"""Each hop keeps this much of its time for its own answer when it calls the next."""
EXPIRY_RESERVE = 0.25
"""The reserve when the deadline expires along the chain: each hop must write its answer in
it after the call below it was cut, which 50 ms did not always cover on a loaded 2-core
machine (the driver's own deadline then passed first)."""


@dataclass
class Chain:
    url: str
    seen: dict[str, list[float]] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    c_work: float = 0.0

    def saw(self, hop: str) -> None:
        remaining = brownout.remaining()
        assert remaining is not None
        self.seen.setdefault(hop, []).append(remaining)


def edge(hop: str) -> EdgePolicy:
    # Inside the platform: budgets are honoured up to a generous maximum.
    return EdgePolicy(
        deadline=InboundDeadlinePolicy(default=30.0, maximum=60.0),
        trust=Trust.TRUSTED,
        name=hop,
    )


@contextlib.asynccontextmanager
async def chain(reserve: float = RESERVE) -> AsyncIterator[Chain]:
    c = Chain("")
    async with contextlib.AsyncExitStack() as stack:
        # C: grpc.aio
        async def work(request: bytes, context: Any) -> bytes:
            c.saw("C")
            try:
                await asyncio.sleep(c.c_work)
            except asyncio.CancelledError:
                c.cancelled.append("C")
                raise
            return b"done"

        server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(edge("C"))])
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "chain.C", {"Work": grpc.unary_unary_rpc_method_handler(work)}
                ),
            )
        )
        c_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stack.push_async_callback(server.stop, None)
        channel = await stack.enter_async_context(
            grpc.aio.insecure_channel(
                f"127.0.0.1:{c_port}",
                interceptors=brownout_interceptors(
                    Dependency("C", reserve=reserve), idempotent_methods={"/chain.C/Work"}
                ),
            )
        )

        # B: aiohttp, calls C over gRPC
        async def b_handler(request: web.Request) -> web.Response:
            c.saw("B")
            try:
                reply = await channel.unary_unary("/chain.C/Work")(b"")
            except asyncio.CancelledError:
                c.cancelled.append("B")
                raise
            return web.Response(body=reply)

        b_app = web.Application(middlewares=[brownout_middleware(edge("B"))])
        b_app.router.add_get("/b", b_handler)
        runner = web.AppRunner(b_app)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        b_url = f"http://127.0.0.1:{runner.addresses[0][1]}/b"
        b_session = await stack.enter_async_context(
            aiohttp.ClientSession(
                middlewares=(BrownoutClientMiddleware(Dependency("B", reserve=reserve)),)
            )
        )

        # A: FastAPI, calls B over aiohttp
        a_app = FastAPI()

        @a_app.get("/a")
        async def a_handler() -> dict[str, str]:
            c.saw("A")
            async with b_session.get(b_url) as r:
                return {"status": str(r.status), "body": (await r.read()).decode()}

        a_app.add_middleware(BrownoutMiddleware, policy=edge("A"))
        c.url = (await stack.enter_async_context(serve(a_app))) + "/a"
        yield c


@pytest.mark.parametrize("deadline", [0.9, 1.2345, 5.5, 12.3456])
async def test_every_hop_sees_less_time_than_the_hop_before(deadline: float) -> None:
    async with chain() as c:
        transport = BrownoutTransport(
            httpx.AsyncHTTPTransport(), dependency=Dependency("A", reserve=RESERVE)
        )
        async with httpx.AsyncClient(transport=transport) as client:
            async with brownout.request(deadline=deadline):
                r = await client.get(c.url)
    assert r.status_code == 200 and r.json() == {"status": "200", "body": "done"}
    a, b, cc = c.seen["A"][0], c.seen["B"][0], c.seen["C"][0]
    # Each hop: at most what its caller had left, less the caller's reserve (D1, D4) ...
    assert a <= deadline - RESERVE
    assert b <= a - RESERVE
    assert cc <= b - RESERVE
    # ... and not much less: the time the call itself took (generous: a shared machine).
    assert cc > deadline - 3 * RESERVE - 1.0


async def test_an_expired_deadline_stops_the_work_at_every_hop() -> None:
    """D5: C works for 10 s; the driver's 1.5 s deadline ends everything well before. The
    first hop's edge, whose deadline (the driver's less its reserve) passes first, answers
    504; below it each hop's call was cancelled with its deadline."""
    async with chain(EXPIRY_RESERVE) as c:
        c.c_work = 10.0
        transport = BrownoutTransport(
            httpx.AsyncHTTPTransport(), dependency=Dependency("A", reserve=EXPIRY_RESERVE)
        )
        async with httpx.AsyncClient(transport=transport) as client:
            t0 = time.monotonic()
            async with brownout.request(deadline=1.5):
                r = await client.get(c.url)
            took = time.monotonic() - t0
        # A relays what B answered: B's edge answered 504 when its call to C was cut at the
        # deadline (its own, less its reserve), as any hop does, whatever the protocol.
        assert r.status_code == 200
        assert r.json()["status"] == "504"
        for _ in range(100):  # the hops below settle just after the driver gives up
            if "C" in c.cancelled:
                break
            await asyncio.sleep(0.02)
    assert took < 1.5 + 1.5  # generous: a shared machine
    assert "C" in c.cancelled  # the work at the bottom stopped, not left running (D5)
