"""`BrownoutClientMiddleware` on a real aiohttp client against a real aiohttp server.

Requirements: D2, D4 (budget sent; refused before sending), D5 (attempt cut at its budget),
D6 (sent mutation that times out: UnknownOutcome with its key, in the ledger), R1 (do-not-retry
marker honoured; giving up raises RetriesExhausted), R2 (what is retried), R5 (same key,
growing attempt), S2 (Retry-After honoured).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import brownout
from brownout import (
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    Priority,
    Reason,
    Rejected,
    RetriesExhausted,
    RetryPolicy,
    StopReason,
    TransientError,
    UnknownOutcome,
)
from brownout.integrations.aiohttp_client import BrownoutClientMiddleware

pytestmark = pytest.mark.integration


@dataclass
class Seen:
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    delay: float = 0.0


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def echo(request: web.Request) -> web.Response:
        seen.times.append(time.monotonic())
        seen.headers.append({k.lower(): v for k, v in request.headers.items()})
        seen.bodies.append(await request.read())
        if seen.delay:
            await asyncio.sleep(seen.delay)
        if seen.script:
            status, headers = seen.script.pop(0)
            return web.json_response({"status": status}, status=status, headers=headers)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/echo", echo)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def fast_retries(attempts: int = 3, **kw: Any) -> RetryPolicy:
    return RetryPolicy(attempts, backoff=ExponentialBackoff(0.001, cap=0.005), **kw)


def session(base: str, dep: Dependency, **kw: Any) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base, middlewares=(BrownoutClientMiddleware(dep, **kw),))


async def test_sends_budget_priority_key_and_attempt(server: tuple[str, Seen]) -> None:
    base, seen = server
    async with session(base, Dependency("echo", timeout=1.0, reserve=0.1)) as http:
        async with brownout.request(deadline=2.0, priority=Priority.SHEDDABLE_PLUS):
            async with http.get("/echo") as r:
                assert r.status == 200 and await r.json() == {"ok": True}
        async with brownout.deadline(0.5), http.post("/echo", json={"a": 1}) as r:
            assert r.status == 200
    get, post = seen.headers
    assert 500 < int(get["brownout-budget-ms"]) <= 1000  # min(1.0, 2.0 - 0.1) (D4)
    assert get["brownout-priority"] == "sheddable_plus"
    assert "idempotency-key" not in get and "brownout-attempt" not in get
    assert 100 < int(post["brownout-budget-ms"]) <= 400
    assert post["idempotency-key"]


async def test_refuses_before_sending(server: tuple[str, Seen]) -> None:
    base, seen = server
    dep = Dependency("echo", timeout=1.0, reserve=0.02, min_useful=0.15)
    async with session(base, dep) as http, brownout.deadline(0.1):
        with pytest.raises(Rejected) as info:
            await http.get("/echo")
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    assert seen.headers == []


async def test_retries_with_same_key_growing_attempt_and_retry_after(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.script = [(503, {"retry-after": "1"}), (504, {})]
    async with session(base, Dependency("echo", retry=fast_retries(3))) as http:
        async with http.post("/echo", data=b"charge", headers={"Idempotency-Key": "k-9"}) as r:
            assert r.status == 200
    assert [h.get("brownout-attempt", "1") for h in seen.headers] == ["1", "2", "3"]
    assert {h["idempotency-key"] for h in seen.headers} == {"k-9"}
    assert seen.bodies == [b"charge"] * 3
    assert seen.times[1] - seen.times[0] >= 0.95  # Retry-After: 1 honoured


async def test_do_not_retry_marker_and_giving_up(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(503, {"brownout-retry": "never"}), (503, {}), (503, {}), (503, {})]
    async with session(base, Dependency("echo", retry=fast_retries(3))) as http:
        with pytest.raises(RetriesExhausted) as never:
            await http.get("/echo")
        assert never.value.stopped_by is StopReason.DO_NOT_RETRY
        with pytest.raises(RetriesExhausted) as exhausted:
            await http.get("/echo")
        assert exhausted.value.stopped_by is StopReason.ATTEMPTS
    assert len(seen.headers) == 4  # 1 (never retried) + 3
    response = exhausted.value.response
    assert isinstance(response, aiohttp.ClientResponse) and response.status == 503


async def test_non_retryable_answers_are_returned(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(500, {}), (422, {}), (503, {})]
    async with session(base, Dependency("echo", retry=fast_retries(3))) as http:
        async with http.get("/echo") as r:
            assert r.status == 500 and await r.json() == {"status": 500}
        async with http.post("/echo") as r:
            assert r.status == 422
    async with session(base, Dependency("no-retries")) as http, http.get("/echo") as r:
        assert r.status == 503 and await r.json() == {"status": 503}
    assert len(seen.headers) == 3


async def test_connection_refused_is_not_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dep = Dependency("down", retry=fast_retries(3, idempotency_keys=False))
    async with session(f"http://127.0.0.1:{port}", dep) as http:
        with pytest.raises(RetriesExhausted) as info:
            await http.post("/echo", data=b"x")
    assert info.value.attempts == 3
    assert isinstance(info.value.error, TransientError) and info.value.error.sent is False


async def test_sent_mutation_that_times_out_is_an_unknown_outcome(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.delay = 2.0
    ledger = InMemoryOutcomeLedger()
    dep = Dependency("slow", timeout=0.2, retry=fast_retries(2), ledger=ledger)
    started = time.monotonic()
    async with session(base, dep) as http:
        with pytest.raises(UnknownOutcome) as info:
            await http.post("/echo", json={"amount": 5})
    assert time.monotonic() - started < 1.5  # two attempts of 0.2 s, not the server's 2 s
    key = info.value.idempotency_key
    assert key is not None
    assert [h["idempotency-key"] for h in seen.headers] == [key, key]
    assert [r.key for r in await ledger.pending()] == [key]


async def test_error_answers_stay_readable(server: tuple[str, Seen]) -> None:
    """The middleware reads a 5xx or 429 answer to the end (freeing the connection for a
    retry) before deciding; the caller can still read its body, whether it gets the response
    (a 500 this layer does not retry) or the last one of an exhausted retry."""
    base, seen = server
    seen.script = [(500, {}), (503, {"Retry-After": "0"}), (503, {"Retry-After": "0"})]
    fast = RetryPolicy(2, backoff=ExponentialBackoff(0.001, cap=0.005))
    async with session(base, Dependency("echo", retry=fast), return_exhausted=True) as http:
        async with http.get("/echo") as r:
            assert r.status == 500
            assert await r.read() == b'{"status": 500}'  # read() refuses a released body
            assert await r.json() == {"status": 500}
        async with http.get("/echo") as r:
            assert r.status == 503
            assert await r.read() == b'{"status": 503}'
            assert await r.text() == '{"status": 503}'


async def test_a_failure_reading_an_answers_body_is_transient_and_retried() -> None:
    """The middleware reads a 5xx answer's body itself: a connection lost while reading it is
    a transport failure like one before the headers (retried when safe), not an aiohttp
    error escaping the retry layer."""
    answers = [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nabc",  # then hangs up
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    ]
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.append(1)
        writer.write(answers.pop(0))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        dep = Dependency("cut", timeout=1.0, retry=fast_retries(2))
        async with session(f"http://127.0.0.1:{port}", dep) as http:
            async with http.get("/") as r:
                assert r.status == 200 and await r.text() == "ok"
    finally:
        server.close()
        await server.wait_closed()
    assert len(seen) == 2
