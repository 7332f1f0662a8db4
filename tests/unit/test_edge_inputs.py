"""Arbitrary inbound headers and paths through the ASGI edge (D3, S2, S4, O1; bad input).

Generated requests (budget, signed-budget, priority, Envoy, attempt and idempotency headers
with valid, near-valid and random values, repeated or not, beside random other headers, on
matching and non-matching paths) go through `BrownoutMiddleware` and a real Starlette app,
called in-process (no socket: thousands of requests in seconds; the loopback tests in
``tests/integration`` cover the servers). For every trust level, with and without a bulkhead,
with and without a listener on the event hub, each request must:

- get exactly one complete answer, within a bound (nothing hangs): the handler's 200, the
  router's 404 for a path no route matches, or a problem+json refusal naming its reason;
- run the handler only with the deadline `InboundDeadlinePolicy.resolve` gives for the same
  headers and trust (never past the route maximum), and with a header-claimed priority only
  when the source is trusted, capped at ``max_claimed_priority``;
- leave nothing behind: no bulkhead slot, no swept flight, no request context; and the
  middleware's path cache and the policy's per-route caches stay within their bounds.

The express path (`EdgePolicy.express_budget`) and the general path (`EdgePolicy.serve`) are
both taken, depending on the headers; what each answer must be comes from the reference
parsers (``tests/edge_inputs.py``), so the test is differential. The same requests go
through the aiohttp edge over loopback in ``tests/integration/test_edge_inputs_aiohttp.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from tests.edge_inputs import (
    CONFIGS,
    SIGNER,
    Answer,
    Edge,
    Headers,
    asgi_scope,
    edge_policy,
    examples,
    header_lists,
    judge,
    paths,
    starlette_edge,
)

import brownout
from brownout import Trust
from brownout._context import NO_REQUEST
from brownout.integrations.asgi import BrownoutMiddleware

PATH_CACHE = 8
ANSWER_WITHIN = 10.0

Message = MutableMapping[str, Any]

EDGES = {key: starlette_edge(edge_policy(*key), path_cache_size=PATH_CACHE) for key in CONFIGS}


async def call(app: Callable[..., Awaitable[None]], scope: dict[str, Any]) -> list[Message]:
    """One request as a server makes it: the body, then ``receive`` blocks until the client
    goes away (it never does here)."""
    sent: list[Message] = []
    delivered = False
    forever = asyncio.Event()

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await forever.wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), ANSWER_WITHIN)
    return sent


def brownout_middleware(edge: Edge) -> BrownoutMiddleware:
    layer: Any = edge.app.middleware_stack
    while not isinstance(layer, BrownoutMiddleware):
        layer = layer.app
    return layer


async def check(edge: Edge, trust: Trust, path: str, headers: Headers) -> Answer:
    before = len(edge.seen)
    sent = await call(edge.app, asgi_scope(path, headers))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(starts) == 1, sent
    assert bodies and not bodies[-1].get("more_body", False), sent
    ran = len(edge.seen) > before
    answer = Answer(
        status=starts[0]["status"],
        content_type=dict(starts[0]["headers"]).get(b"content-type", b"").decode(),
        body=b"".join(m.get("body", b"") for m in bodies),
        ran=ran,
    )
    if ran:
        answer.remaining, answer.priority = edge.seen[-1]
    judge(edge.policy, trust, path, headers, answer)

    # Nothing left behind, caches bounded.
    if edge.bulkhead is not None:
        assert edge.bulkhead.in_flight == 0
    assert not edge.policy._sweeper.pending
    assert brownout.current() is NO_REQUEST
    assert len(brownout_middleware(edge)._paths) <= PATH_CACHE
    return answer


@examples(2000)
@given(
    trust=st.sampled_from(list(Trust)),
    with_bulkhead=st.booleans(),
    listening=st.booleans(),
    path=paths,
    headers=header_lists(wire=False),
)
def test_any_headers_get_one_answer_a_bounded_deadline_and_leave_nothing_behind(
    trust: Trust,
    with_bulkhead: bool,
    listening: bool,
    path: str,
    headers: Headers,
) -> None:
    edge = EDGES[(trust, with_bulkhead, listening)]
    answer = asyncio.run(check(edge, trust, path, headers))
    event(f"answer {answer.status}" + (" from the handler" if answer.ran else ""))


@pytest.mark.parametrize("trust", list(Trust))
def test_both_paths_are_taken_whatever_hypothesis_draws(trust: Trust) -> None:
    """Fixed cases that take each path: no header and a plain budget (express), a repeated
    budget, a claim, a spent budget and a signed one (serve)."""
    edge = EDGES[(trust, True, False)]
    cases: list[Headers] = [
        [],
        [(b"brownout-budget-ms", b"800")],
        [(b"brownout-budget-ms", b"800"), (b"brownout-budget-ms", b"90")],
        [(b"brownout-priority", b"critical_plus")],
        [(b"brownout-budget-ms", b"0")],
        [(b"brownout-signed-budget", SIGNER.sign(0.8).encode())],
    ]
    for headers in cases:
        asyncio.run(check(edge, trust, "/items/7", headers))


# -- bounded: an attacker forging headers and paths ----------------------------------------------


async def test_bounded_100k_forged_callers_paths_and_headers_through_the_middleware() -> None:
    """100,000 requests, each with its own path (half match no route), its own caller (from a
    forged API key) and forged budget and priority headers, through the real middleware and
    a Starlette app, with a classifier as careless as it can be (operation = the raw path).
    Every per-key structure on the way stays within its bound, and nothing is left behind."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route as StarletteRoute
    from tests.edge_inputs import TEMPLATE

    from brownout import Bulkhead, Classification, EdgePolicy, InboundDeadlinePolicy, Route, Stats
    from brownout.events import EventHub
    from brownout.limits import FixedLimit

    def classify(scope: Any, cls: Classification) -> Classification:
        key = dict(scope["headers"]).get(b"x-api-key", b"anonymous").decode("latin-1")
        return cls._replace(caller=key, operation=scope["path"])

    hub = EventHub()
    stats = hub.subscribe(Stats(max_callers=100, max_operations=200))
    bulkhead = Bulkhead("api", FixedLimit(4), events=hub)
    policy = EdgePolicy(
        bulkhead=bulkhead,
        deadline=InboundDeadlinePolicy(signer=SIGNER, events=hub),
        trust=Trust.SIGNED,
        routes={TEMPLATE: Route(default=1.5, maximum=5.0)},
        classifier=classify,
        events=hub,
    )

    async def item(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[StarletteRoute(TEMPLATE, item)])
    app.add_middleware(BrownoutMiddleware, policy=policy, path_cache_size=PATH_CACHE)
    for i in range(100_000):
        path = f"/items/{i}" if i % 2 else f"/nowhere/{i}"
        forged: Headers = [(b"x-api-key", f"key-{i}".encode())]
        if i % 3 == 0:
            forged += [
                (b"brownout-budget-ms", f"{i}x".encode()),
                (b"brownout-priority", b"critical_plus"),
                (b"brownout-signed-budget", f"v1.k{i}.150.0.AAAA".encode()),
            ]
        sent = await call(app, asgi_scope(path, forged))
        assert sent[0]["status"] in (200, 404)
    layer: Any = app.middleware_stack
    while not isinstance(layer, BrownoutMiddleware):
        layer = layer.app
    assert len(layer._paths) <= PATH_CACHE and len(layer._previous) <= PATH_CACHE
    assert len(layer._templates) <= 2 and len(layer._indexes) == 1
    assert len(policy._resolved) <= 1024 + 1 and len(policy._plain) <= 1024
    assert not policy._sweeper.pending
    assert bulkhead.in_flight == 0
    ledger = bulkhead.ledger
    assert ledger is not None and ledger.row_count <= ledger.max_rows
    assert bulkhead.estimator is not None
    assert len(bulkhead.estimator) <= bulkhead.estimator.max_operations
    assert len(stats.callers) <= 100 and len(stats.operations) <= 200
    assert stats.series_count() <= stats.max_series + 52 + 3 * 201
    assert len({problem for _h, problem in stats.headers_ignored}) <= 8
    # A host stall longer than a request's budget makes it late, not lost: both count.
    ended = {k: stats.count(k) for k in ("completed", "completed_late", "failed", "expired")}
    assert ended["completed"] + ended["completed_late"] == 100_000, ended
