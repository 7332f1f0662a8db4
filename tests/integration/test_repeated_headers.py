"""Repeated brownout headers through every server edge (issue 24): uvicorn + Starlette, aiohttp
and grpc.aio, over loopback, written by a raw HTTP/1.1 client (httpx and aiohttp's client
would merge repeated names) and a real grpcio client.

The rule (docs/deadlines.md, "Repeated headers"): of several budgets (plain, Envoy's, signed,
or one folded into a comma-separated list) the shortest valid one wins; a priority claim with
differing values is ignored (the route's priority applies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.edge_inputs import (
    MAX_CLAIMED,
    ROUTE_PRIORITY,
    SIGNER,
    aiohttp_edge,
    edge_policy,
    starlette_edge,
)
from tests.integration.servers import serve, serve_aiohttp, serve_grpc

import brownout
from brownout import Priority, Trust
from brownout._lab.http1 import ResponseParser, encode_request
from brownout.integrations.grpc_server import BrownoutServerInterceptor

pytestmark = pytest.mark.integration

Pairs = tuple[tuple[str, str], ...]
METHOD = "/test.Repeated/Echo"

CASES: list[tuple[Trust, Pairs, float, Priority]] = [
    # (trust, headers, at most this budget, priority the handler must see)
    (
        Trust.TRUSTED,
        (("brownout-budget-ms", "3000"), ("brownout-budget-ms", "1000")),
        1.0,
        ROUTE_PRIORITY,
    ),
    (
        Trust.TRUSTED,
        (("brownout-budget-ms", "1000"), ("brownout-budget-ms", "3000")),
        1.0,
        ROUTE_PRIORITY,
    ),
    (Trust.TRUSTED, (("brownout-budget-ms", "3000, 800"),), 0.8, ROUTE_PRIORITY),
    (
        Trust.UNTRUSTED,
        (("brownout-budget-ms", "3000"), ("brownout-budget-ms", "900")),
        0.9,
        ROUTE_PRIORITY,
    ),
    (
        Trust.SIGNED,
        (
            ("brownout-signed-budget", "sign:3.0"),
            ("brownout-signed-budget", "sign:1.0"),
        ),
        1.0,
        ROUTE_PRIORITY,
    ),
    (
        Trust.TRUSTED,
        (("brownout-priority", "critical"), ("brownout-priority", "sheddable")),
        1.5,
        ROUTE_PRIORITY,
    ),
    (
        Trust.TRUSTED,
        (("brownout-priority", "critical"), ("brownout-priority", "critical")),
        1.5,
        MAX_CLAIMED,
    ),
]


def on_the_wire(pairs: Pairs) -> Pairs:
    """Signed now (a signature is refused outside the signer's skew tolerance)."""
    return tuple(
        (k, SIGNER.sign(float(v.removeprefix("sign:"))) if v.startswith("sign:") else v)
        for k, v in pairs
    )


IDS = [f"{trust.value}-{'+'.join(v for _, v in pairs)[:30]}" for trust, pairs, _, _ in CASES]


async def raw_get(base: str, path: str, pairs: Pairs) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(encode_request("GET", path, "edge", pairs))
        parser = ResponseParser()
        while True:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the server closed the connection"
            got = parser.feed(data)
            if got:
                return got[0].status, got[0].body
    finally:
        writer.close()


def judge(seen: list[tuple[float | None, Priority]], at_most: float, priority: Priority) -> None:
    assert len(seen) == 1
    remaining, got = seen[0]
    assert remaining is not None and at_most - 0.5 < remaining <= at_most, (remaining, at_most)
    assert got is priority


@pytest.mark.parametrize(("trust", "pairs", "at_most", "priority"), CASES, ids=IDS)
async def test_uvicorn(trust: Trust, pairs: Pairs, at_most: float, priority: Priority) -> None:
    edge = starlette_edge(edge_policy(trust, True, True))
    async with serve(edge.app) as base:
        status, _ = await raw_get(base, "/items/1", on_the_wire(pairs))
    assert status == 200
    judge(edge.seen, at_most, priority)


@pytest.mark.parametrize(("trust", "pairs", "at_most", "priority"), CASES, ids=IDS)
async def test_aiohttp(trust: Trust, pairs: Pairs, at_most: float, priority: Priority) -> None:
    edge = aiohttp_edge(edge_policy(trust, True, True))
    async with serve_aiohttp(edge.app) as base:
        status, _ = await raw_get(base, "/items/1", on_the_wire(pairs))
    assert status == 200
    judge(edge.seen, at_most, priority)


@contextlib.asynccontextmanager
async def grpc_edge(trust: Trust) -> AsyncIterator[grpc.aio.Channel]:
    policy = edge_policy(trust, True, True, template=METHOD)

    async def echo(request: bytes, context: Any) -> bytes:
        ctx = brownout.current()
        return json.dumps([ctx.remaining(), int(ctx.priority)]).encode()

    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Repeated", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        yield channel


@pytest.mark.parametrize(("trust", "pairs", "at_most", "priority"), CASES, ids=IDS)
async def test_grpc(trust: Trust, pairs: Pairs, at_most: float, priority: Priority) -> None:
    async with grpc_edge(trust) as channel:
        # No timeout: the budget comes from the metadata, as the HTTP edges read it.
        answer = await channel.unary_unary(METHOD)(b"", metadata=on_the_wire(pairs))
    remaining, got = json.loads(answer)
    judge([(remaining, Priority(got))], at_most, priority)
