"""Generated inbound headers through the edge over loopback: aiohttp and uvicorn (D3, S2, S4).

The requests of ``tests/unit/test_edge_inputs.py`` as they arrive on the wire: header names in
any letter case, repeated or not, values of visible ASCII, written by a raw HTTP/1.1 client
(the lab's request encoder and response parser, on one kept-alive connection; httpx and
aiohttp's client would merge repeated names before sending) to a real aiohttp server running
`brownout_middleware` and to uvicorn running a Starlette app behind `BrownoutMiddleware`, for
every trust level, with and without a bulkhead. aiohttp looks headers up case-insensitively
and keeps their case, uvicorn lower-cases them, and each edge has an express path that reads
the raw pairs: this is where a case or repetition mismatch between the paths would show.

Each answer is judged against the reference parsers (``tests/edge_inputs.py``): one answer,
on a connection that stays open; a deadline never past the route maximum and equal to what
`InboundDeadlinePolicy.resolve` gives for its values (the shortest budget of a repeated
header; a repeated priority claim with differing values ignored); a priority claim honoured
only from a trusted source; no bulkhead slot left taken.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from tests.edge_inputs import (
    CONFIGS,
    Answer,
    Edge,
    Headers,
    aiohttp_edge,
    edge_policy,
    examples,
    header_lists,
    judge,
    starlette_edge,
    url_paths,
)
from tests.integration.servers import LoopThread, serve

from brownout import Trust
from brownout._lab.http1 import Response, ResponseParser, encode_request

pytestmark = pytest.mark.integration

Case = tuple[str, Headers]
ANSWER_WITHIN = 10.0


async def exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    parser: ResponseParser,
    path: str,
    headers: Headers,
) -> Response:
    pairs = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
    writer.write(encode_request("GET", path, "edge", pairs))
    while True:
        data = await reader.read(65536)
        assert data, "the server closed the connection"
        got = parser.feed(data)
        if got:
            assert len(got) == 1
            return got[0]


async def run_cases(edge: Edge, trust: Trust, port: int, cases: list[Case]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    parser = ResponseParser()
    try:
        for path, headers in cases:
            before = len(edge.seen)
            r = await asyncio.wait_for(
                exchange(reader, writer, parser, path, headers), ANSWER_WITHIN
            )
            assert r.keep_alive  # refusals included: the connection stays open
            answer = Answer(
                status=r.status,
                content_type=r.headers.get("content-type", "").split(";")[0],
                body=r.body,
                ran=len(edge.seen) > before,
            )
            if answer.ran:
                answer.remaining, answer.priority = edge.seen[-1]
            judge(edge.policy, trust, path, headers, answer)
            if edge.bulkhead is not None:
                for _ in range(100):  # settled just after the last byte was written
                    if edge.bulkhead.in_flight == 0:
                        break
                    await asyncio.sleep(0.01)
                assert edge.bulkhead.in_flight == 0
    finally:
        writer.close()
        await writer.wait_closed()


Running = dict[tuple[str, Trust, bool, bool], tuple[Edge, int]]


async def start_servers(stack: contextlib.AsyncExitStack) -> Running:
    """Both servers for every trust level, with and without a bulkhead and a listener."""
    running: Running = {}
    for key in CONFIGS:
        edge = aiohttp_edge(edge_policy(*key))
        runner = web.AppRunner(edge.app)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        running["aiohttp", *key] = (edge, runner.addresses[0][1])
        edge = starlette_edge(edge_policy(*key))
        base = await stack.enter_async_context(serve(edge.app))
        running["uvicorn", *key] = (edge, int(base.rsplit(":", 1)[1]))
    return running


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LoopThread, Running]]:
    with LoopThread() as thread:
        yield thread, thread.run(start_servers(thread.stack))


case_lists = st.lists(st.tuples(url_paths, header_lists(wire=True)), min_size=1, max_size=8)


@pytest.mark.parametrize("trust", list(Trust))
@pytest.mark.parametrize("server", ["aiohttp", "uvicorn"])
def test_the_edge_on_any_headers_over_loopback(
    servers: tuple[LoopThread, Running], server: str, trust: Trust
) -> None:
    thread, running = servers

    # The servers are started once; hypothesis's examples run against them (an inner
    # function, since hypothesis does not mix with a function-scoped fixture's state).
    @examples(150)
    @given(with_bulkhead=st.booleans(), listening=st.booleans(), cases=case_lists)
    def any_headers(with_bulkhead: bool, listening: bool, cases: list[Case]) -> None:
        edge, port = running[server, trust, with_bulkhead, listening]
        thread.run(run_cases(edge, trust, port, cases))

    any_headers()
