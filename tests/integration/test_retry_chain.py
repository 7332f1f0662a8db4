"""One retry layer (R1, R3, T3): a chain of three real services where the bottom one fails.

driver -> A -> B -> C, each a uvicorn server on loopback with brownout's ASGI edge; C answers
every request with 503. The same chain is driven twice, counting requests *at C*:

- **naive**: every calling layer (driver, A, B) retries with tenacity, 3 attempts, no budget,
  and a hop that gives up answers a plain 503. Each layer multiplies by 3: C sees exactly
  3 x 3 x 3 = 27 requests per original.
- **brownout**: every calling layer uses a `Dependency` with the same 3 attempts through
  `BrownoutTransport`, plus a `RetryBudget(ratio, min_per_second, window)`. B gives up on C
  (attempts or budget) and raises `RetriesExhausted`; B's edge answers 503 with
  ``brownout-retry: never``; A's client does not retry that, and A's edge passes the marker on
  to the driver, which does not retry either. So only B retries, and within its budget: C sees
  at most (1 + ratio) x originals + min_per_second x window.

The same brownout chain over gRPC (grpc.aio servers with the edge interceptor, clients with
`brownout_interceptors`) shows the gRPC marker, ``grpc-retry-pushback-ms: -1``, doing the same.

Counts, not time: the test is deterministic apart from scheduling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
import tenacity
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.integration.servers import serve

import brownout
from brownout import (
    Dependency,
    EdgePolicy,
    ExponentialBackoff,
    Reason,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    StopReason,
    Trust,
)
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.grpc_client import brownout_interceptors
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration

ORIGINALS = 20
ATTEMPTS = 3  # per calling layer, the original included
RATIO = 0.1
WINDOW = 60.0  # longer than the test: the window never slides during it
MIN_PER_SECOND = 1 / WINDOW  # a reserve of one retry per window


def with_edge(routes: list[Route]) -> Starlette:
    app = Starlette(routes=routes)
    app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(trust=Trust.TRUSTED))
    return app


def brownout_dependency(name: str) -> Dependency:
    return Dependency(
        name,
        timeout=2.0,
        retry=RetryPolicy(
            ATTEMPTS,
            budget=RetryBudget(ratio=RATIO, min_per_second=MIN_PER_SECOND, window=WINDOW),
            backoff=ExponentialBackoff(0.001, cap=0.002),
        ),
    )


async def naive_get(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """Retry 503 up to ATTEMPTS attempts in total, no budget, no marker: the usual setup."""
    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(ATTEMPTS),
        retry=tenacity.retry_if_result(lambda r: r.status_code >= 500),
        wait=tenacity.wait_none(),
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )
    response: httpx.Response = await retrying(client.get, path)
    return response


class Hop:
    """A middle service: ``/brownout`` calls downstream through a Dependency, ``/naive``
    through tenacity, both answering what they got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: Counter[str] = Counter()
        self.brownout_client: httpx.AsyncClient | None = None
        self.naive_client: httpx.AsyncClient | None = None

    def connect(self, downstream: str) -> None:
        transport = BrownoutTransport(
            httpx.AsyncHTTPTransport(), dependency=brownout_dependency(f"{self.name}->down")
        )
        self.brownout_client = httpx.AsyncClient(base_url=downstream, transport=transport)
        self.naive_client = httpx.AsyncClient(base_url=downstream)

    def app(self) -> Starlette:
        async def with_brownout(request: Request) -> Response:
            self.received["brownout"] += 1
            assert self.brownout_client is not None
            # RetriesExhausted propagates: the edge answers 503 + brownout-retry: never.
            r = await self.brownout_client.get("/brownout")
            return Response(r.content, status_code=r.status_code)

        async def naive(request: Request) -> Response:
            self.received["naive"] += 1
            assert self.naive_client is not None
            r = await naive_get(self.naive_client, "/naive")
            return Response(r.content, status_code=r.status_code)

        return with_edge([Route("/brownout", with_brownout), Route("/naive", naive)])

    async def close(self) -> None:
        for c in (self.brownout_client, self.naive_client):
            if c is not None:
                await c.aclose()


def failing_bottom(received: Counter[str]) -> Starlette:
    def handler(kind: str) -> Callable[[Request], Awaitable[Response]]:
        async def fail(request: Request) -> Response:
            received[kind] += 1
            received[f"{kind}-budget-header"] += "brownout-budget-ms" in request.headers
            return JSONResponse({"error": "unavailable"}, status_code=503)

        return fail

    return with_edge([Route("/brownout", handler("brownout")), Route("/naive", handler("naive"))])


async def test_only_one_layer_retries_within_budget_vs_naive_27x() -> None:
    at_c: Counter[str] = Counter()
    a, b = Hop("A"), Hop("B")
    async with (
        serve(failing_bottom(at_c)) as c_url,
        serve(b.app()) as b_url,
        serve(a.app()) as a_url,
    ):
        b.connect(c_url)
        a.connect(b_url)
        driver_transport = BrownoutTransport(
            httpx.AsyncHTTPTransport(), dependency=brownout_dependency("driver->A")
        )
        try:
            async with (
                httpx.AsyncClient(base_url=a_url, transport=driver_transport) as driver,
                httpx.AsyncClient(base_url=a_url) as naive_driver,
            ):
                gave_up: Counter[tuple[StopReason, int]] = Counter()
                for _ in range(ORIGINALS):
                    async with brownout.deadline(5.0):
                        with pytest.raises(RetriesExhausted) as info:
                            await driver.get("/brownout")
                    gave_up[(info.value.stopped_by, info.value.attempts)] += 1
                    response = info.value.response
                    assert isinstance(response, httpx.Response)
                    assert response.headers["brownout-retry"] == "never"
                    assert response.status_code == 503
                    assert info.value.reason is Reason.DO_NOT_RETRY

                for _ in range(ORIGINALS):
                    r = await naive_get(naive_driver, "/naive")
                    assert r.status_code == 503
        finally:
            await a.close()
            await b.close()

    # brownout: the driver and A never retried (the marker), B retried within its budget.
    assert gave_up == Counter({(StopReason.DO_NOT_RETRY, 1): ORIGINALS})
    assert a.received["brownout"] == ORIGINALS
    assert b.received["brownout"] == ORIGINALS
    bound = (1 + RATIO) * ORIGINALS + MIN_PER_SECOND * WINDOW
    assert ORIGINALS < at_c["brownout"] <= bound, at_c
    assert at_c["brownout-budget-header"] == at_c["brownout"]  # the deadline travelled (D2)

    # naive: every layer multiplies by ATTEMPTS.
    assert a.received["naive"] == ORIGINALS * ATTEMPTS
    assert b.received["naive"] == ORIGINALS * ATTEMPTS**2
    assert at_c["naive"] == ORIGINALS * ATTEMPTS**3  # 27x
    print(
        f"\nrequests reaching C for {ORIGINALS} originals: naive {at_c['naive']} "
        f"({at_c['naive'] / ORIGINALS:.0f}x), brownout {at_c['brownout']} "
        f"({at_c['brownout'] / ORIGINALS:.2f}x, bound {bound:.0f})"
    )


# -- the same chain over gRPC: the marker is grpc-retry-pushback-ms: -1 -------------------------
CALL = "/chain.Hop/Call"


def _ident(b: bytes) -> bytes:
    return b


async def grpc_server(
    behavior: Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]],
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(EdgePolicy())])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "chain.Hop", {"Call": grpc.unary_unary_rpc_method_handler(behavior, _ident, _ident)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def grpc_channel(target: str, name: str) -> grpc.aio.Channel:
    interceptors = brownout_interceptors(brownout_dependency(name), idempotent_methods={CALL})
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


async def test_grpc_chain_only_one_layer_retries_within_budget() -> None:
    received: Counter[str] = Counter()
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def bottom(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        received["C"] += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        raise AssertionError("unreachable")

    def hop(name: str, downstream: grpc.aio.Channel) -> Any:
        stub = downstream.unary_unary(CALL)

        async def forward(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            received[name] += 1
            reply: bytes = await stub(request)  # RetriesExhausted -> UNAVAILABLE + pushback -1
            return reply

        return forward

    try:
        c_server, c_target = await grpc_server(bottom)
        servers.append(c_server)
        channels.append(grpc_channel(c_target, "B->C"))
        b_server, b_target = await grpc_server(hop("B", channels[-1]))
        servers.append(b_server)
        channels.append(grpc_channel(b_target, "A->B"))
        a_server, a_target = await grpc_server(hop("A", channels[-1]))
        servers.append(a_server)
        channels.append(grpc_channel(a_target, "driver->A"))
        driver = channels[-1].unary_unary(CALL)
        for _ in range(ORIGINALS):
            async with brownout.deadline(5.0):
                with pytest.raises(RetriesExhausted) as info:
                    await driver(b"x")
            assert info.value.stopped_by is StopReason.DO_NOT_RETRY and info.value.attempts == 1
            error = info.value.response
            assert isinstance(error, grpc.aio.AioRpcError)
            assert error.code() is grpc.StatusCode.UNAVAILABLE
            assert ("grpc-retry-pushback-ms", "-1") in tuple(error.trailing_metadata() or ())
    finally:
        for ch in channels:
            await ch.close()
        for s in servers:
            await s.stop(0)
    assert received["A"] == ORIGINALS and received["B"] == ORIGINALS
    assert ORIGINALS < received["C"] <= (1 + RATIO) * ORIGINALS + MIN_PER_SECOND * WINDOW
