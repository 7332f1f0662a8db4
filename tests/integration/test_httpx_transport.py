"""`BrownoutTransport` against a real uvicorn server with a real httpx client.

Requirements: D2 (remaining budget travels as a duration), D4 (min(timeout, remaining -
reserve); refused before sending), D5 (the attempt is cut at its budget), D6 (a sent mutation
that times out is an unknown outcome, with its key), R1 (``brownout-retry: never`` is not
retried; giving up raises RetriesExhausted), R2 (429/502/503/504 and connection failures before
sending are retried; 500 and 4xx are not), R4, R5 (same key, growing attempt number), S2
(Retry-After honoured).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.integration.servers import serve

import brownout
from brownout import (
    BudgetSigner,
    CircuitBreaker,
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
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration


@dataclass
class Seen:
    """What the server received, per request."""

    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    """Answers to give, in order (status, headers); 200 once exhausted."""
    delay: float = 0.0


def build_app(seen: Seen) -> Starlette:
    async def echo(request: Request) -> Response:
        seen.headers.append(dict(request.headers))
        seen.bodies.append(await request.body())
        if seen.delay:
            await asyncio.sleep(seen.delay)
        if seen.script:
            status, headers = seen.script.pop(0)
            return JSONResponse({"status": status}, status_code=status, headers=headers)
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/echo", echo, methods=["GET", "POST", "PUT", "DELETE"])])


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()
    async with serve(build_app(seen)) as base:
        yield base, seen


def fast_retries(attempts: int = 3, **kw: Any) -> RetryPolicy:
    return RetryPolicy(attempts, backoff=ExponentialBackoff(0.001, cap=0.005), **kw)


def client(base: str, dep: Dependency, **kw: Any) -> httpx.AsyncClient:
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=dep, **kw)
    return httpx.AsyncClient(base_url=base, transport=transport)


async def test_sends_budget_priority_key_and_attempt(server: tuple[str, Seen]) -> None:
    base, seen = server
    dep = Dependency("echo", timeout=1.0, reserve=0.1)
    async with client(base, dep) as http:
        async with brownout.request(deadline=2.0, priority=Priority.SHEDDABLE):
            r = await http.get("/echo")
            assert r.status_code == 200 and r.json() == {"ok": True}
        async with brownout.deadline(0.5):
            r = await http.post("/echo", json={"amount": 1})
    get, post = seen.headers
    assert 500 < int(get["brownout-budget-ms"]) <= 1000  # min(timeout 1.0, 2.0 - 0.1) (D4)
    assert get["brownout-priority"] == "sheddable"
    assert "idempotency-key" not in get and "brownout-attempt" not in get
    assert 100 < int(post["brownout-budget-ms"]) <= 400  # min(1.0, 0.5 - 0.1)
    assert post["idempotency-key"]  # a mutation is keyed (R5)
    assert "brownout-priority" not in post  # CRITICAL is the default, not sent


async def test_no_deadline_sends_the_dependency_timeout(server: tuple[str, Seen]) -> None:
    base, seen = server
    async with client(base, Dependency("echo", timeout=0.75)) as http:
        await http.get("/echo")
    assert 400 < int(seen.headers[0]["brownout-budget-ms"]) <= 750


async def test_refuses_before_sending_when_too_little_time_is_left(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    dep = Dependency("echo", timeout=1.0, reserve=0.02, min_useful=0.15)
    async with client(base, dep) as http, brownout.deadline(0.1):
        with pytest.raises(Rejected) as info:
            await http.get("/echo")
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    assert seen.headers == []  # nothing was sent (D4)


async def test_retries_503_with_the_same_key_and_a_growing_attempt(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.script = [(503, {"retry-after": "0"}), (502, {})]
    dep = Dependency("echo", timeout=1.0, retry=fast_retries(3))
    async with client(base, dep) as http:
        r = await http.post("/echo", content=b"charge", headers={"idempotency-key": "k-1"})
    assert r.status_code == 200
    assert [h.get("brownout-attempt", "1") for h in seen.headers] == ["1", "2", "3"]
    assert {h["idempotency-key"] for h in seen.headers} == {"k-1"}  # the caller's key (R5)
    assert seen.bodies == [b"charge"] * 3


async def test_streamed_request_body_is_replayed_on_retry(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(503, {})]

    async def body() -> AsyncIterator[bytes]:
        yield b"part-1,"
        yield b"part-2"

    async with client(base, Dependency("echo", retry=fast_retries(2))) as http:
        r = await http.put("/echo", content=body())
    assert r.status_code == 200
    assert seen.bodies == [b"part-1,part-2"] * 2


async def test_retry_after_is_honoured(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(429, {"retry-after": "1"})]
    times: list[float] = []

    class Clocked(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            times.append(time.monotonic())
            return await super().handle_async_request(request)

    dep = Dependency("echo", retry=fast_retries(2))
    async with httpx.AsyncClient(
        base_url=base, transport=BrownoutTransport(Clocked(), dependency=dep)
    ) as http:
        r = await http.get("/echo")
    assert r.status_code == 200
    assert times[1] - times[0] >= 0.95  # waited for Retry-After, not the 5 ms backoff (S2)


async def test_do_not_retry_marker_stops_retries_and_raises(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(503, {"brownout-retry": "never"})] * 3
    async with client(base, Dependency("echo", retry=fast_retries(3))) as http:
        with pytest.raises(RetriesExhausted) as info:
            await http.get("/echo")
    assert len(seen.headers) == 1  # R1: never retried
    assert info.value.stopped_by is StopReason.DO_NOT_RETRY
    response = info.value.response
    assert isinstance(response, httpx.Response) and response.status_code == 503


async def test_giving_up_raises_retries_exhausted_or_returns_the_last_answer(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.script = [(503, {})] * 6
    async with client(base, Dependency("echo", retry=fast_retries(3))) as http:
        with pytest.raises(RetriesExhausted) as info:
            await http.get("/echo")
    assert info.value.attempts == 3 and info.value.reason is Reason.DO_NOT_RETRY
    async with client(base, Dependency("e", retry=fast_retries(3)), return_exhausted=True) as http:
        r = await http.get("/echo")
    assert r.status_code == 503 and r.json() == {"status": 503}  # body still readable
    assert len(seen.headers) == 6


async def test_non_retryable_answers_are_returned_unretried(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.script = [(500, {}), (404, {}), (503, {})]
    async with client(base, Dependency("echo", retry=fast_retries(3))) as http:
        assert (await http.get("/echo")).status_code == 500
        assert (await http.get("/echo")).status_code == 404
    async with client(base, Dependency("no-retries")) as http:  # not a retry layer
        r = await http.get("/echo")
        assert r.status_code == 503 and r.json() == {"status": 503}
    assert len(seen.headers) == 3


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused_is_transient_and_not_sent() -> None:
    dep = Dependency("down", timeout=1.0, retry=fast_retries(3, idempotency_keys=False))
    async with client(f"http://127.0.0.1:{closed_port()}", dep) as http:
        with pytest.raises(RetriesExhausted) as info:
            await http.post("/echo", content=b"x")  # unkeyed mutation: resent, never left
    assert info.value.attempts == 3
    assert isinstance(info.value.error, TransientError) and info.value.error.sent is False


async def test_attempt_is_cut_at_its_budget(server: tuple[str, Seen]) -> None:
    base, seen = server
    seen.delay = 2.0
    async with client(base, Dependency("slow", timeout=0.2)) as http:
        started = time.monotonic()
        with pytest.raises((TimeoutError, TransientError)):  # DeadlineExceeded or ReadTimeout
            await http.get("/echo")
    assert time.monotonic() - started < 1.0  # D5: not the server's 2 s


async def test_sent_mutation_that_times_out_is_an_unknown_outcome(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.delay = 2.0
    ledger = InMemoryOutcomeLedger()
    dep = Dependency("slow", timeout=0.2, retry=fast_retries(2), ledger=ledger)
    async with client(base, dep) as http:
        with pytest.raises(UnknownOutcome) as info:
            await http.post("/echo", json={"amount": 5})
    key = info.value.idempotency_key
    assert key is not None
    assert [h["idempotency-key"] for h in seen.headers] == [key, key]  # keyed retry, same key
    assert [r.key for r in await ledger.pending()] == [key]  # D6


async def test_request_extension_marks_a_post_idempotent(server: tuple[str, Seen]) -> None:
    base, seen = server
    async with client(base, Dependency("echo")) as http:
        await http.post("/echo", content=b"q", extensions={"brownout.idempotent": True})
    assert "idempotency-key" not in seen.headers[0]


async def test_wraps_any_object_with_handle_async_request(server: tuple[str, Seen]) -> None:
    """Only the transport interface is used: a duck-typed transport (httpx2 style) works."""
    base, seen = server
    calls: list[str] = []

    class Minimal:
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            calls.append(request.method)
            return await self.inner.handle_async_request(request)

    minimal = Minimal()
    transport = BrownoutTransport(minimal, dependency=Dependency("echo", timeout=1.0))
    async with httpx.AsyncClient(base_url=base, transport=transport) as http:
        assert (await http.get("/echo")).status_code == 200
    await minimal.inner.aclose()
    assert calls == ["GET"] and "brownout-budget-ms" in seen.headers[0]


async def test_open_breaker_refuses_without_sending(server: tuple[str, Seen]) -> None:
    """R6 through the adapter: 503s open the dependency's breaker; then nothing is sent."""
    base, seen = server
    seen.script = [(503, {})] * 4
    breaker = CircuitBreaker(failure_rate=0.5, window=4, minimum_calls=4, open_for=60.0)
    async with client(base, Dependency("flaky", breaker=breaker)) as http:
        for _ in range(4):
            assert (await http.get("/echo")).status_code == 503  # no retries: answers returned
        with pytest.raises(Rejected) as info:
            await http.get("/echo")
    assert info.value.reason is Reason.BREAKER_OPEN
    assert len(seen.headers) == 4


async def test_signed_budget_for_a_callee_outside_the_trust_boundary(
    server: tuple[str, Seen],
) -> None:
    """D3: with a signer, the budget also travels signed, and verifies on the other side."""
    base, seen = server
    signer = BudgetSigner({"k1": b"0123456789abcdef0123"})
    async with client(base, Dependency("partner", timeout=0.6), signer=signer) as http:
        await http.get("/echo")
    signed = signer.verify(seen.headers[0]["brownout-signed-budget"])
    assert 0.3 < signed <= 0.6


async def test_unkeyed_mutation_is_not_resent_after_it_was_sent(server: tuple[str, Seen]) -> None:
    """R2: without an idempotency key, a sent mutation is never resent; its outcome is unknown."""
    base, seen = server
    seen.delay = 2.0
    dep = Dependency("slow", timeout=0.2, retry=fast_retries(3, idempotency_keys=False))
    async with client(base, dep) as http:
        with pytest.raises(UnknownOutcome) as info:
            await http.post("/echo", json={"amount": 5})
    assert info.value.idempotency_key is None
    assert len(seen.headers) == 1 and "idempotency-key" not in seen.headers[0]


ABSURD_PUSHBACK: list[list[tuple[bytes, bytes]]] = [
    [(b"retry-after", b"9" * 400)],
    [(b"retry-after", b"1e999")],
    [(b"retry-after", b"nan")],
    [(b"retry-after", b"-5")],
    [(b"retry-after", b"Mon, 99 Foo 99999 99:99:99 GMT")],
    [(b"retry-after", b"Fri, 31 Dec 9999 23:59:59 GMT")],
    [(b"retry-after", b"\xff\xfe")],
    [(b"retry-after", b"1"), (b"retry-after", b"2")],  # httpx joins them: "1, 2"
    [(b"grpc-retry-pushback-ms", b"9" * 400)],
    [(b"grpc-retry-pushback-ms", b"1e999")],
    [(b"grpc-retry-pushback-ms", b"nan")],
    [(b"grpc-retry-pushback-ms", b"\xff")],
    [(b"grpc-retry-pushback-ms", b"5"), (b"grpc-retry-pushback-ms", b"-1")],
    [(b"brownout-retry", b"\xffnever")],
    [(b"grpc-retry-pushback-ms", b"99999999999"), (b"retry-after", b"9" * 40)],
]


@pytest.mark.parametrize("pushback", ABSURD_PUSHBACK, ids=repr)
async def test_an_absurd_pushback_never_loses_the_answer(
    pushback: list[tuple[bytes, bytes]],
) -> None:
    """Classifying an answer is total: whatever a server says in Retry-After and
    grpc-retry-pushback-ms, the caller gets the answer (or the retry layer's verdict on it),
    never an exception out of the classification, and any wait is bounded."""
    answered: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        answered.append(1)
        body = b'{"status":503}'
        headers = [(b"content-type", b"application/json"), *pushback]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serve(app) as base:
        dep = Dependency("absurd", timeout=1.0, retry=fast_retries(2, max_pushback=0.5))
        started = time.monotonic()
        async with client(base, dep, return_exhausted=True) as http:
            async with brownout.deadline(2.0):
                r = await http.get("/")
        assert time.monotonic() - started < 1.5
    assert r.status_code == 503 and r.json() == {"status": 503}
    assert 1 <= len(answered) <= 2


async def test_a_failure_reading_an_answers_body_is_transient_and_retried() -> None:
    """The transport reads a 5xx answer's body itself (to free the connection for the retry):
    a connection lost while reading it is a transport failure like one before the headers
    (retried when safe), not an httpx error escaping the retry layer."""
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
        async with client(
            f"http://127.0.0.1:{port}", Dependency("cut", timeout=1.0, retry=fast_retries(2))
        ) as http:
            r = await http.get("/")
    finally:
        server.close()
        await server.wait_closed()
    assert r.status_code == 200 and r.text == "ok"
    assert len(seen) == 2
