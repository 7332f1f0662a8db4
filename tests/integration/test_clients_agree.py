"""The httpx transport and the aiohttp client middleware behave alike (D4, D6, R1, R2, R5, S2).

Both HTTP client adapters document the same behaviour; this holds them to it. The same
scripted server (a real aiohttp server on loopback; each attempt takes the next action of the
script: an answer with a status and headers, a hang past the attempt's budget, or a dropped
connection) is called through `BrownoutTransport` on a real httpx client and through
`BrownoutClientMiddleware` on a real aiohttp client, each with its own fresh `Dependency`
(three attempts, fast backoff, a 1 s attempt timeout), for a safe method and a mutation. The
two must send the same attempts (the attempt numbers, one idempotency key for every attempt
of a mutation, a budget that fits the attempt timeout), end the same way (the same response
status, or the same brownout error with the same reason), and report the same events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from tests.integration.servers import serve_aiohttp

import brownout
from brownout import (
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    Rejected,
    RetriesExhausted,
    RetryPolicy,
    Stats,
    UnknownOutcome,
)
from brownout.events import EventHub
from brownout.integrations.aiohttp_client import BrownoutClientMiddleware
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration

Action = tuple[Any, ...]
"""``("answer", status, headers)``, ``("hang",)`` or ``("drop",)``."""

ATTEMPT_TIMEOUT = 1.0
DEADLINE = 8.0
"""The caller's deadline (each scenario runs inside a request)."""


@dataclass
class Script:
    actions: list[Action] = field(default_factory=list)
    attempts: list[dict[str, str]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def scripted_server(script: Script) -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        script.attempts.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        action = script.actions.pop(0) if script.actions else ("answer", 200, {})
        if action[0] == "hang":
            await asyncio.sleep(5)
        if action[0] == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            raise asyncio.CancelledError
        return web.json_response({"status": action[1]}, status=action[1], headers=action[2])

    app = web.Application()
    app.router.add_route("*", "/thing", handle)
    async with serve_aiohttp(app, handler_cancellation=True) as url:
        yield url


class Kinds:
    """The kinds of event a dependency emits, in order."""

    accepts_tallies = False

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def emit(self, event: Any) -> None:
        self.kinds.append(type(event).__name__)


def dependency(stats: Stats, kinds: Kinds) -> Dependency:
    hub = EventHub()
    hub.subscribe(stats)
    hub.subscribe(kinds)
    return Dependency(
        "things",
        timeout=ATTEMPT_TIMEOUT,
        retry=RetryPolicy(3, backoff=ExponentialBackoff(0.001, cap=0.005), events=hub),
        ledger=InMemoryOutcomeLedger(),
        events=hub,
    )


def ending(e: BaseException) -> tuple[str, ...]:
    if isinstance(e, RetriesExhausted):
        return ("raised", "RetriesExhausted", e.stopped_by.value, str(e.attempts))
    if isinstance(e, UnknownOutcome):
        return ("raised", "UnknownOutcome")
    if isinstance(e, Rejected):
        return ("raised", "Rejected", e.reason.value)
    # The library's own error (a connection failure this layer does not retry): its type
    # differs between the libraries, what matters is that it is not a brownout error.
    return ("raised", "library error", type(e).__name__)


async def with_httpx(base: str, method: str, stats: Stats, kinds: Kinds) -> tuple[str, ...]:
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=dependency(stats, kinds))
    async with httpx.AsyncClient(base_url=base, transport=transport) as client:
        try:
            r = await client.request(method, "/thing", content=b"x" if method == "POST" else None)
        except Exception as e:
            return ending(e)
        return ("answered", str(r.status_code))


async def with_aiohttp(base: str, method: str, stats: Stats, kinds: Kinds) -> tuple[str, ...]:
    middleware = BrownoutClientMiddleware(dependency(stats, kinds))
    async with aiohttp.ClientSession(base, middlewares=(middleware,)) as session:
        try:
            data = b"x" if method == "POST" else None
            async with session.request(method, "/thing", data=data) as r:
                await r.read()
                return ("answered", str(r.status))
        except Exception as e:
            return ending(e)


def sent(attempts: list[dict[str, str]]) -> list[tuple[str | None, ...]]:
    """What matters of each attempt's headers: its number, whether it carried a key, and
    whether its budget fits the attempt timeout."""
    out = []
    for h in attempts:
        budget = h.get("brownout-budget-ms")
        fits = budget is not None and 0 < int(budget) <= ATTEMPT_TIMEOUT * 1000
        out.append((h.get("brownout-attempt"), str("idempotency-key" in h), str(fits)))
    return out


SCRIPTS: dict[str, list[Action]] = {
    "answered": [("answer", 200, {})],
    "503 then answered": [("answer", 503, {"Retry-After": "0"}), ("answer", 200, {})],
    "429 until exhausted": [("answer", 429, {"Retry-After": "0"})] * 3,
    "500 is an answer": [("answer", 500, {})],
    "404 is an answer": [("answer", 404, {})],
    "do not retry": [("answer", 503, {"brownout-retry": "never"})],
    "retry-after past the deadline": [("answer", 503, {"Retry-After": "120"})],
    "hang then answered": [("hang",), ("answer", 200, {})],
    "dropped then answered": [("drop",), ("answer", 200, {})],
}


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("name", list(SCRIPTS))
async def test_httpx_and_aiohttp_clients_agree(name: str, method: str) -> None:
    seen = {}
    for client in (with_httpx, with_aiohttp):
        script = Script(actions=list(SCRIPTS[name]))
        stats = Stats()
        kinds = Kinds()
        async with scripted_server(script) as base, brownout.request(deadline=DEADLINE):
            end = await client(base, method, stats, kinds)
        keys = {h.get("idempotency-key") for h in script.attempts}
        if method == "POST":
            assert len(keys) == 1 and None not in keys  # one key for every attempt (R5)
        seen[client.__name__] = (end, sent(script.attempts), dict(stats.counters), kinds.kinds)
    assert seen["with_httpx"] == seen["with_aiohttp"]
