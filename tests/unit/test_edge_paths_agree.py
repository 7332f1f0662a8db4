"""The ASGI edge's express path and `EdgePolicy.serve` give the same answers and counts (O1).

A plain request at an uncontended bulkhead is served inline by `BrownoutMiddleware` (the
express path); the same request with a header the edge must judge (here a priority claim from
an untrusted source, which is then ignored) goes through `EdgePolicy.serve`. For every way a
handler can end (an answer, a 5xx, an exception, an HTTP error the framework answers, a
refusal from a dependency, an unknown outcome, expiry before and after the response started,
a client that goes away, a handler that swallows that cancellation, a stream, a degraded
mode's fallback), both paths must give the client the same status and problem reason, count
the same lifecycle events with the same reasons, teach the adaptive limit the same samples
(a fallback's answer or a refusal teaches nothing) and free the slot.

The requests are made in-process against a real Starlette app (no socket), so each outcome
runs in milliseconds; the loopback express tests (``tests/integration/test_*_express.py``)
cover the servers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route as StarletteRoute
from tests.edge_inputs import asgi_scope
from tests.outcomes import LONG, OUTCOMES, SHORT, Observed, observed

from brownout import (
    EdgePolicy,
    Reason,
    Rejected,
    Route,
    UnknownOutcome,
)
from brownout.integrations.asgi import BrownoutMiddleware

Message = MutableMapping[str, Any]


def build() -> tuple[Starlette, Observed]:
    o = observed("api", personal="personal", default="default")
    cancelled = o.cancelled

    async def handler(request: Request) -> Response:
        outcome = request.path_params["outcome"]
        try:
            return await respond(outcome)
        except asyncio.CancelledError:
            cancelled.append(outcome)
            if outcome == "swallows_disconnect":
                return PlainTextResponse("answered anyway")
            raise

    async def respond(outcome: str) -> Response:
        if outcome == "ok":
            return PlainTextResponse("ok")
        if outcome == "status_500":
            return JSONResponse({"oops": True}, status_code=500)
        if outcome == "raises":
            raise RuntimeError("boom")
        if outcome == "http_404":
            raise HTTPException(404, "no such thing")
        if outcome == "rejected":
            raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")
        if outcome == "unknown":
            raise UnknownOutcome("key-1")
        if outcome in ("expires", "disconnect", "swallows_disconnect"):
            await asyncio.sleep(5)
        if outcome == "stream":

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(3):
                    yield f"{i}\n".encode()

            return StreamingResponse(chunks())
        if outcome == "expires_mid_stream":

            async def slow() -> AsyncIterator[bytes]:
                yield b"first\n"
                await asyncio.sleep(5)
                yield b"never\n"

            return StreamingResponse(slow())
        if outcome == "fallback":
            return PlainTextResponse(await o.recommendations())
        raise AssertionError(outcome)

    app = Starlette(
        routes=[StarletteRoute("/short/{outcome}", handler), StarletteRoute("/{outcome}", handler)]
    )
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
    app.add_middleware(BrownoutMiddleware, policy=policy)
    return app, o


async def request(app: Any, path: str, headers: list[tuple[bytes, bytes]], gone: bool) -> Any:
    """One request, as a server makes it; ``gone``: the client hangs up after 0.2 s."""
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if gone:
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    scope = asgi_scope(path, headers)
    raised = None
    try:
        await asyncio.wait_for(app(scope, receive, send), 10)
    except Exception as e:  # Starlette's ServerErrorMiddleware answers 500, then re-raises
        raised = type(e).__name__
    starts = [m for m in sent if m["type"] == "http.response.start"]
    status = starts[0]["status"] if starts else None
    head = dict(starts[0]["headers"]) if starts else {}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    complete = any(
        m["type"] == "http.response.body" and not m.get("more_body", False) for m in sent
    )
    reason = None
    if head.get(b"content-type") == b"application/problem+json":
        reason = json.loads(body)["reason"]
    return status, reason, complete, raised, head.get(b"brownout-degraded")


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_express_and_serve_agree(outcome: str) -> None:
    seen = {}
    for path_taken, headers in (
        ("express", []),
        ("serve", [(b"brownout-priority", b"sheddable")]),
    ):
        app, o = build()
        gone = outcome in ("disconnect", "swallows_disconnect")
        path = f"/short/{outcome}" if outcome.startswith("expires") else f"/{outcome}"
        answer = await request(app, path, headers, gone)
        await asyncio.sleep(0.05)  # anything the edge settles after the last byte
        assert o.bulkhead.express == (1 if path_taken == "express" else 0), path_taken
        assert o.bulkhead.in_flight == 0, path_taken
        seen[path_taken] = (answer, o.seen())
    assert seen["express"] == seen["serve"]
