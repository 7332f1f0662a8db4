"""`Deadline.origin`: where a request's deadline came from, as the ASGI edge sets it on both
its paths (express and `EdgePolicy.serve`), and as scopes keep it (D2, D3). Traces report it
as ``brownout.deadline.source``. Requests are made in-process against a real Starlette app."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route as StarletteRoute
from tests.edge_inputs import SIGNER, asgi_scope

import brownout
from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Trust
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit


async def origin_seen(policy: EdgePolicy, headers: list[tuple[bytes, bytes]]) -> str:
    async def handler(request: Request) -> PlainTextResponse:
        deadline = brownout.current().deadline
        assert deadline is not None
        async with brownout.deadline(0.5) as inner:  # a scope shortening it keeps it
            assert inner.deadline is not None and inner.deadline is not deadline
            assert inner.deadline.origin == deadline.origin
        return PlainTextResponse(deadline.origin)

    app = BrownoutMiddleware(Starlette(routes=[StarletteRoute("/x", handler)]), policy=policy)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(asgi_scope("/x", headers), receive, send)
    assert sent[0]["status"] == 200, sent
    return b"".join(m.get("body", b"") for m in sent[1:]).decode()


BUDGET = (b"brownout-budget-ms", b"2000")
CLAIM = (b"brownout-priority", b"sheddable")  # judged by `serve`, never the express path


@pytest.mark.parametrize("bulkhead", [True, False], ids=["bulkhead", "no-bulkhead"])
@pytest.mark.parametrize(
    ("trust", "deadline", "headers", "origin"),
    [
        (Trust.TRUSTED, InboundDeadlinePolicy(), [], "default"),
        (Trust.TRUSTED, InboundDeadlinePolicy(), [BUDGET], "header"),
        (Trust.TRUSTED, InboundDeadlinePolicy(), [BUDGET, CLAIM], "header"),
        (Trust.TRUSTED, InboundDeadlinePolicy(), [(b"brownout-budget-ms", b"x")], "default"),
        (Trust.UNTRUSTED, InboundDeadlinePolicy(honour_untrusted=False), [BUDGET], "default"),
        (Trust.UNTRUSTED, InboundDeadlinePolicy(), [BUDGET], "header"),
        (
            Trust.TRUSTED,
            InboundDeadlinePolicy(read_envoy=True),
            [(b"x-envoy-expected-rq-timeout-ms", b"3000")],
            "envoy",
        ),
        (Trust.SIGNED, InboundDeadlinePolicy(signer=SIGNER), [BUDGET], "default"),
    ],
)
async def test_the_edge_says_where_the_deadline_came_from(
    bulkhead: bool, trust: Trust, deadline: InboundDeadlinePolicy, headers: Any, origin: str
) -> None:
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4)) if bulkhead else None,
        trust=trust,
        deadline=deadline,
    )
    assert await origin_seen(policy, headers) == origin


async def test_a_signed_budget_is_signed() -> None:
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4)),
        trust=Trust.SIGNED,
        deadline=InboundDeadlinePolicy(signer=SIGNER),
    )
    header = (b"brownout-signed-budget", SIGNER.sign(2.0).encode())
    assert await origin_seen(policy, [header]) == "signed"
