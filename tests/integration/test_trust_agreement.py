"""HTTP and gRPC edges resolve the same budget to the same deadline at every trust level
(issue 24): a budget sent as ``brownout-budget-ms`` to uvicorn and as the call's own timeout
(``grpc-timeout``) to grpc.aio is honoured, or not, by one rule (docs/deadlines.md)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute
from tests.integration.servers import serve, serve_grpc

import brownout
from brownout import EdgePolicy, InboundDeadlinePolicy, Route, Trust
from brownout.events import EventHub
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.grpc_server import BrownoutServerInterceptor

pytestmark = pytest.mark.integration

DEFAULT, MAXIMUM, BUDGET = 1.5, 5.0, 0.8
METHOD = "/test.Trust/Echo"


def policy(trust: Trust, honour_untrusted: bool, template: str) -> EdgePolicy:
    return EdgePolicy(
        deadline=InboundDeadlinePolicy(honour_untrusted=honour_untrusted, events=EventHub()),
        trust=trust,
        routes={template: Route(default=DEFAULT, maximum=MAXIMUM)},
        events=EventHub(),
    )


async def over_http(trust: Trust, honour_untrusted: bool) -> float:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(brownout.remaining())

    app = Starlette(routes=[StarletteRoute("/echo", echo)])
    app.add_middleware(BrownoutMiddleware, policy=policy(trust, honour_untrusted, "/echo"))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as http:
        r = await http.get("/echo", headers={"brownout-budget-ms": str(int(BUDGET * 1000))})
    return float(r.json())


async def over_grpc(trust: Trust, honour_untrusted: bool) -> float:
    async def echo(request: bytes, context: Any) -> bytes:
        return json.dumps(brownout.remaining()).encode()

    server = grpc.aio.server(
        interceptors=[BrownoutServerInterceptor(policy(trust, honour_untrusted, METHOD))]
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Trust", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        answer = await channel.unary_unary(METHOD)(b"", timeout=BUDGET)
    return float(json.loads(answer))


@pytest.mark.parametrize("honour_untrusted", [True, False])
@pytest.mark.parametrize("trust", list(Trust))
async def test_the_same_budget_gets_the_same_deadline_over_http_and_grpc(
    trust: Trust, honour_untrusted: bool
) -> None:
    honoured = trust is Trust.TRUSTED or (trust is Trust.UNTRUSTED and honour_untrusted)
    expected = BUDGET if honoured else DEFAULT
    http = await over_http(trust, honour_untrusted)
    rpc = await over_grpc(trust, honour_untrusted)
    # Less what the trip to the handler took; grpc core rounds a timeout up by up to 10 ms.
    assert expected - 0.3 < http <= expected, (http, expected)
    assert expected - 0.3 < rpc <= expected + 0.011, (rpc, expected)
