"""Repeated pushback headers in a dependency's answer, through every bundled client (issue 24,
"the same class of defect elsewhere"): a real uvicorn server sends the header lines, httpx
(which joins repeated names with ", ") and aiohttp (whose ``get`` returns the first) read them.
gRPC has no such case: grpc-core keeps only the last ``grpc-retry-pushback-ms`` of a call's
trailers and turns a malformed one into a negative one (do not retry) before the client sees
it.

The rule (docs/retries.md, "Pushback"): ``brownout-retry: never`` on any line, or in any
element of a comma-separated list, means do not retry; of several ``Retry-After`` or
``grpc-retry-pushback-ms`` values the longest wait wins, and a malformed or negative pushback
among them means do not retry, as one alone does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tests.integration.servers import serve

from brownout import Dependency, ExponentialBackoff, RetriesExhausted, RetryPolicy, StopReason
from brownout.integrations.aiohttp_client import BrownoutClientMiddleware
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration

Pairs = list[tuple[str, str]]


class Script:
    def __init__(self) -> None:
        self.answers: list[Pairs | None] = []  # None: 200
        self.times: list[float] = []


def _app(script: Script) -> Starlette:
    async def echo(request: Request) -> Response:
        script.times.append(time.monotonic())
        pairs = script.answers.pop(0) if script.answers else None
        if pairs is None:
            return Response(b"ok")
        response = Response(b"busy", status_code=503)
        response.raw_headers.extend((k.encode(), v.encode()) for k, v in pairs)
        return response

    return Starlette(routes=[Route("/echo", echo)])


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Script]]:
    script = Script()
    async with serve(_app(script)) as base:
        yield base, script


def _dependency() -> Dependency:
    fast = RetryPolicy(3, backoff=ExponentialBackoff(0.001, cap=0.005), max_pushback=5.0)
    return Dependency("echo", retry=fast)


async def _get_httpx(base: str) -> None:
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=_dependency())
    async with httpx.AsyncClient(base_url=base, transport=transport) as http:
        (await http.get("/echo")).raise_for_status()


async def _get_aiohttp(base: str) -> None:
    middleware = BrownoutClientMiddleware(_dependency())
    async with (
        aiohttp.ClientSession(base, middlewares=(middleware,)) as http,
        http.get("/echo") as r,
    ):
        r.raise_for_status()


CLIENTS = {"httpx": _get_httpx, "aiohttp": _get_aiohttp}

NEVER: list[Pairs] = [
    [("brownout-retry", "never"), ("brownout-retry", "never")],
    [("brownout-retry", "later"), ("brownout-retry", "never")],
    [("brownout-retry", "later, never")],
    [("retry-after", "0"), ("brownout-retry", "never")],
]


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize("pairs", NEVER, ids=lambda p: "+".join(v for _, v in p))
async def test_a_never_marker_on_any_line_stops_retries(
    server: tuple[str, Script], client: str, pairs: Pairs
) -> None:
    base, script = server
    script.answers = [pairs, None]
    with pytest.raises(RetriesExhausted) as info:
        await CLIENTS[client](base)
    assert info.value.stopped_by is StopReason.DO_NOT_RETRY
    assert len(script.times) == 1


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize("order", [("0", "1"), ("1", "0")])
async def test_the_longest_retry_after_wins(
    server: tuple[str, Script], client: str, order: tuple[str, str]
) -> None:
    base, script = server
    script.answers = [[("retry-after", order[0]), ("retry-after", order[1])], None]
    await CLIENTS[client](base)
    assert len(script.times) == 2
    assert script.times[1] - script.times[0] >= 0.95
