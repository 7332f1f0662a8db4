"""The aiohttp edge's express path and `EdgePolicy.serve` give the same answers and counts.

As ``tests/unit/test_edge_paths_agree.py`` does for the ASGI middleware, over loopback: a real
aiohttp server running `brownout_middleware` (aiohttp's default runner, without
``handler_cancellation``, so a client that goes away is noticed by the edge's own sweep) and a
real aiohttp client (a raw socket for the clients that hang up). For every way a handler can
end, a plain request (the express path) and the same request with a priority claim from an
untrusted source (`serve`, which ignores the claim) must get the same status and problem
reason, the same lifecycle counts and reasons, the same samples for the adaptive limit, and
free the slot (O1).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tests.integration.servers import send_then_hang_up
from tests.outcomes import LONG, OUTCOMES, SHORT, Observed, observed

from brownout import (
    EdgePolicy,
    Reason,
    Rejected,
    Route,
    UnknownOutcome,
)
from brownout.integrations.aiohttp_server import announce_degraded, brownout_middleware

pytestmark = pytest.mark.integration


def build() -> tuple[web.Application, Observed]:
    o = observed("aio", personal="personal", default="default")
    cancelled = o.cancelled

    async def handler(request: web.Request) -> web.StreamResponse:
        outcome = request.match_info["outcome"]
        try:
            return await respond(request, outcome)
        except asyncio.CancelledError:
            cancelled.append(outcome)
            if outcome == "swallows_disconnect":
                return web.Response(text="answered anyway")
            raise

    async def respond(request: web.Request, outcome: str) -> web.StreamResponse:
        if outcome == "ok":
            return web.Response(text="ok")
        if outcome == "status_500":
            return web.json_response({"oops": True}, status=500)
        if outcome == "raises":
            raise RuntimeError("boom")
        if outcome == "http_404":
            raise web.HTTPNotFound()
        if outcome == "rejected":
            raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")
        if outcome == "unknown":
            raise UnknownOutcome("key-1")
        if outcome in ("expires", "disconnect", "swallows_disconnect"):
            await asyncio.sleep(5)
        if outcome in ("stream", "expires_mid_stream"):
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"first\n")
            if outcome == "expires_mid_stream":
                await asyncio.sleep(5)
            await response.write(b"second\n")
            await response.write_eof()
            return response
        if outcome == "fallback":
            return web.Response(text=await o.recommendations())
        raise AssertionError(outcome)

    policy = EdgePolicy(
        bulkhead=o.bulkhead,
        routes={
            "/short/{outcome}": Route(default=SHORT, maximum=SHORT),
            "/{outcome}": Route(default=LONG, maximum=LONG),
        },
        degraded=o.modes,
        sweep_period=0.02,
        events=o.hub,
    )
    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get("/short/{outcome}", handler)
    app.router.add_get("/{outcome}", handler)
    return app, o


async def ask(base: str, path: str, headers: dict[str, str]) -> Any:
    async with aiohttp.ClientSession(base) as session, session.get(path, headers=headers) as r:
        reason = None
        body = b""
        try:
            body = await r.read()
        except aiohttp.ClientPayloadError:
            body = b"<truncated>"
        if r.headers.get("content-type", "").startswith("application/problem+json"):
            reason = (await r.json(content_type=None))["reason"]
        return r.status, reason, body == b"<truncated>", r.headers.get("brownout-degraded")


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_express_and_serve_agree_on_aiohttp(outcome: str) -> None:
    seen = {}
    for path_taken, headers in (("express", {}), ("serve", {"brownout-priority": "sheddable"})):
        app, o = build()
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        path = f"/short/{outcome}" if outcome.startswith("expires") else f"/{outcome}"
        try:
            if outcome in ("disconnect", "swallows_disconnect"):
                raw = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
                await send_then_hang_up(base, path, raw, after=0.2)
                answer = None
                await asyncio.sleep(0.3)  # the sweep notices, the handler ends
            else:
                answer = await ask(base, path, headers)
            await asyncio.sleep(0.05)  # anything the edge settles after the last byte
            assert o.bulkhead.express == (1 if path_taken == "express" else 0), path_taken
            assert o.bulkhead.in_flight == 0, path_taken
            seen[path_taken] = (answer, o.seen())
        finally:
            await runner.cleanup()
    assert seen["express"] == seen["serve"]


@pytest.mark.parametrize("signal", [True, False])
async def test_degraded_modes_are_named_on_every_response(
    signal: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """G2 on aiohttp: while a mode is active, ``brownout-degraded`` is on every answer, on
    both paths: a returned response, an HTTP error the handler raises, a refusal, and a
    streamed response when `announce_degraded` is on ``app.on_response_prepare`` (without it
    the stream's head has left before the middleware sees it: a warning says so, once)."""
    caplog.set_level(logging.WARNING, logger="brownout.edge")  # whatever the root's level
    app, _ = build()
    if signal:
        policy = app.middlewares[0].policy  # type: ignore[attr-defined]
        app.on_response_prepare.append(announce_degraded(policy))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        for headers in ({}, {"brownout-priority": "sheddable"}):
            for outcome in ("ok", "http_404", "rejected", "fallback", "stream", "stream"):
                status, _, _, degraded = await ask(base, f"/{outcome}", headers)
                expected = "recs" if signal or outcome != "stream" else None
                assert degraded == expected, (outcome, headers, status)
    finally:
        await runner.cleanup()
    warnings = [r for r in caplog.records if "announce_degraded" in r.getMessage()]
    assert len(warnings) == (0 if signal else 1)
