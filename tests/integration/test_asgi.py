"""The ASGI edge against a real uvicorn server running FastAPI, with a real httpx client.

Requirements: D2, D3 (inbound clamp), D5 (cancel at expiry / disconnect), S2 (problem+json,
Retry-After, 503 vs 429), S4 (forged priority ignored), S7 (health under 10x flood,
connection kept open), O1/O4 (abandoned counted, operation is the route template).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
    UnauthenticatedUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import Route as StarletteRoute
from tests.integration.flood import (
    HTTP_FLOOD,
    assert_answered_fast,
    probe_under_flood,
    server_process,
)
from tests.integration.servers import send_then_hang_up, serve

import brownout
from brownout import (
    Bulkhead,
    Classification,
    EdgePolicy,
    InboundDeadlinePolicy,
    Priority,
    Route,
    Stats,
    Trust,
)
from brownout.events import EventHub
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit, LatencyEstimator
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


class TokenAuth(AuthenticationBackend):
    """``authorization: Bearer internal`` is a trusted service; anything else is anonymous."""

    async def authenticate(self, conn: Any) -> tuple[AuthCredentials, BaseUser] | None:
        if conn.headers.get("authorization") == "Bearer internal":
            return AuthCredentials(["internal"]), SimpleUser("billing")
        return None


def trust_authenticated(scope: Any) -> Trust:
    user = scope.get("user")
    return Trust.TRUSTED if user is not None and user.is_authenticated else Trust.UNTRUSTED


def caller_from_user(scope: Any, default: Classification) -> Classification:
    user = scope.get("user")
    if user is None or isinstance(user, UnauthenticatedUser):
        return default._replace(caller="anonymous")
    return default._replace(caller=user.display_name)


@dataclass
class Service:
    base: str
    hub: EventHub
    stats: Stats
    cancelled: list[str]
    connections: set[tuple[str, int]]


def build_app(
    *,
    limit: int = 2,
    queue: int = 1,
    hub: EventHub,
    cancelled: list[str],
    conns: set[Any],
    estimator: LatencyEstimator | None = None,
) -> FastAPI:
    app = FastAPI()

    @app.get("/work/{id}")
    async def work(id: int, hold: float = 0.0) -> dict[str, Any]:
        ctx = brownout.current()
        seen = {
            "remaining": ctx.remaining(),
            "priority": ctx.priority.label,
            "caller": ctx.caller,
            "operation": ctx.operation,
        }
        try:
            await asyncio.sleep(hold)
        except asyncio.CancelledError:
            cancelled.append(f"work/{id}")
            raise
        return seen

    @app.get("/reports/{id}")
    async def report(id: int) -> dict[str, Any]:
        return {"remaining": brownout.remaining()}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        gate = request.app.state.gate

        async def body() -> AsyncIterator[bytes]:
            yield b"first\n"
            await gate.wait()
            yield b"second\n"

        return StreamingResponse(body(), media_type="text/plain")

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    app.state.gate = asyncio.Event()
    policy = EdgePolicy(
        bulkhead=Bulkhead(
            "api",
            FixedLimit(limit),
            FifoQueue(max_size=queue, max_wait=0.05),
            events=hub,
            estimator=estimator,
        ),
        deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),
        trust=trust_authenticated,
        classifier=caller_from_user,
        health_paths=("/health",),
        routes={
            "/reports/{id}": Route(priority=Priority.SHEDDABLE, maximum=10.0),
            "/stream": Route(maximum=1.0),
        },
        events=hub,
    )

    @app.middleware("http")
    async def count_connections(request: Request, call_next: Any) -> Any:
        conns.add(request.scope["client"])
        return await call_next(request)

    app.add_middleware(BrownoutMiddleware, policy=policy)
    # Added last, so it runs first: the classifier and trust function see scope["user"].
    app.add_middleware(AuthenticationMiddleware, backend=TokenAuth())
    return app


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    cancelled: list[str] = []
    conns: set[Any] = set()
    app = build_app(hub=hub, cancelled=cancelled, conns=conns)
    async with serve(app) as base:
        yield Service(base, hub, stats, cancelled, conns)


async def test_untrusted_budget_is_clamped_to_the_route_maximum(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        r = await client.get("/reports/7", headers={"brownout-budget-ms": "60000"})
        assert r.status_code == 200
        assert 9.0 < r.json()["remaining"] <= 10.0  # D3: 60 s asked, route maximum 10 s
        r = await client.get("/work/1", headers={"brownout-budget-ms": "60000"})
        assert 4.0 < r.json()["remaining"] <= 5.0  # the policy maximum elsewhere
        r = await client.get("/work/1")
        assert 1.0 < r.json()["remaining"] <= 2.0  # the default
        r = await client.get("/work/1", headers={"brownout-budget-ms": "300"})
        assert 0.0 < r.json()["remaining"] <= 0.3  # a shorter budget is always honoured


async def test_forged_priority_is_ignored_and_a_trusted_one_honoured(service: Service) -> None:
    internal = {"authorization": "Bearer internal"}
    async with httpx.AsyncClient(base_url=service.base) as client:
        forged = (await client.get("/work/1", headers={"brownout-priority": "sheddable"})).json()
        raised = (
            await client.get("/work/1", headers={"brownout-priority": "critical_plus"})
        ).json()
        trusted = (
            await client.get("/work/1", headers={"brownout-priority": "sheddable-plus", **internal})
        ).json()
        capped = (
            await client.get("/work/1", headers={"brownout-priority": "critical_plus", **internal})
        ).json()
        budget = (
            await client.get("/work/1", headers={"brownout-budget-ms": "4000", **internal})
        ).json()
    # S4: an unauthenticated caller cannot change its priority, in either direction.
    assert forged["priority"] == raised["priority"] == "critical"
    assert forged["caller"] == "anonymous"
    # An authenticated service is trusted: its claim is honoured, capped below CRITICAL_PLUS.
    assert trusted["priority"] == "sheddable_plus"
    assert trusted["caller"] == "billing"
    assert capped["priority"] == "critical"
    assert 3.0 < budget["remaining"] <= 4.0
    assert forged["operation"] == "/work/{id}"  # the template, not /work/1
    await asyncio.sleep(0.05)
    assert service.stats.count("completed", caller="anonymous") == 2


async def test_refusals_are_problem_json_and_keep_the_connection_open(service: Service) -> None:
    """Refusals, then a success, on one TCP connection (unlike uvicorn --limit-concurrency)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    ports: set[int] = set()

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            ports.add(info["return_value"].get_extra_info("socket").getsockname()[1])

    async with httpx.AsyncClient(base_url=service.base) as holder:
        holds = [asyncio.create_task(holder.get("/work/1?hold=0.8")) for _ in range(3)]
        await asyncio.sleep(0.3)  # two running, one queued: the bulkhead is full
        async with httpx.AsyncClient(base_url=service.base, limits=limits) as client:
            refusals = [await client.get("/work/2", extensions={"trace": trace}) for _ in range(4)]
            await asyncio.gather(*holds)
            after = await client.get("/work/3", extensions={"trace": trace})
    for r in refusals:
        assert r.status_code == 503
        assert r.headers["content-type"] == "application/problem+json"
        body = r.json()
        assert body["status"] == 503
        assert body["reason"] in {"queue_full", "queue_timeout", "overloaded"}
        assert body["type"] == f"urn:brownout:reason:{body['reason']}"
    assert after.status_code == 200
    assert len(ports) == 1  # one TCP connection carried every refusal and the success
    assert service.stats.count("shed") >= 4


async def test_retry_after_is_sent_only_with_an_estimate() -> None:
    hub = EventHub()
    hub.subscribe(Stats())  # observed: the bulkhead times every admission
    app = build_app(
        hub=hub, cancelled=[], conns=set(), limit=1, estimator=LatencyEstimator(min_samples=1)
    )
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        # No success yet: the bulkhead has no latency estimate, so no Retry-After (S2).
        hold = asyncio.create_task(client.get("/work/1?hold=0.3"))
        await asyncio.sleep(0.1)
        r = await client.get("/work/2")
        assert r.status_code == 503
        assert "retry-after" not in r.headers
        assert (await hold).status_code == 200
        # Now there is an estimate: refusals say when to come back (jitter: see unit tests).
        hold = asyncio.create_task(client.get("/work/1?hold=1.0"))
        await asyncio.sleep(0.1)
        refused = [await client.get("/work/2") for _ in range(5)]
        await hold
    for r in refused:
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1, r.text


FLOOD_SERVER = """
import asyncio, sys
import uvicorn
from fastapi import FastAPI
from brownout import Bulkhead
from brownout.queues import FifoQueue
from brownout.limits import FixedLimit
from brownout import EdgePolicy
from brownout.integrations.asgi import BrownoutMiddleware

app = FastAPI()

@app.get("/work")
async def work():
    await asyncio.sleep(0.5)  # holds capacity, leaves the CPU free
    return {"ok": True}

@app.get("/health")
async def health():
    return {"ok": True}

app.add_middleware(BrownoutMiddleware, policy=EdgePolicy(
    bulkhead=Bulkhead("api", FixedLimit(4), FifoQueue(max_size=4, max_wait=0.1)),
    health_paths=("/health",),
))

async def main():
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.should_exit = True
    await task

asyncio.run(main())
"""


async def test_health_is_answered_fast_under_a_10x_flood() -> None:
    """S7: limit 4, 40 connections flooding in a closed loop, health probed meanwhile."""
    async with server_process(FLOOD_SERVER) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def probe() -> None:
                assert (await client.get("/health")).status_code == 200

            counts, latencies = await probe_under_flood(HTTP_FLOOD, port, probe)
    assert counts.get("200", 0) >= 8  # the limit kept serving
    assert counts.get("503", 0) > 5 * counts.get("200", 0)  # and the flood was >= 10x capacity
    assert_answered_fast(latencies)


async def test_deadline_expiry_cancels_the_handler_and_returns_504(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        t0 = time.perf_counter()
        r = await client.get("/work/9?hold=5", headers={"brownout-budget-ms": "300"})
        took = time.perf_counter() - t0
    assert r.status_code == 504
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["reason"] == "deadline_expired"
    assert took < 2.0
    assert "work/9" in service.cancelled
    assert service.stats.count("expired", reason="running") == 1


async def test_client_disconnect_cancels_the_handler(service: Service) -> None:
    await send_then_hang_up(service.base, "/work/5?hold=3")
    for _ in range(100):
        if "work/5" in service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert "work/5" in service.cancelled  # D5: the work stopped
    await asyncio.sleep(0.05)
    assert service.stats.count("abandoned") == 1  # O1: not a success
    assert service.stats.count("completed") == 0


async def test_streaming_passes_through_unbuffered(service: Service) -> None:
    async with (
        httpx.AsyncClient(base_url=service.base) as client,
        client.stream("GET", "/stream") as r,
    ):
        chunks = r.aiter_raw()
        first = await asyncio.wait_for(chunks.__anext__(), 2.0)
        assert first == b"first\n"  # arrived while the handler is still blocked


async def test_operation_label_is_the_route_template(service: Service) -> None:
    async with httpx.AsyncClient(base_url=service.base) as client:
        for i in range(5):
            await client.get(f"/work/{i}")
        await client.get("/nope/1")
        await client.get("/nope/2")
    await asyncio.sleep(0.05)  # the bulkhead reports completion just after the last byte
    assert service.stats.count("completed", operation="/work/{id}") == 5
    assert service.stats.count("completed", operation="unmatched") == 2
    ops = {key[1] for key in service.stats.counters}
    assert not any(op.startswith("/work/") and op != "/work/{id}" for op in ops)


async def test_included_routers_and_mounts_label_by_their_full_template() -> None:
    """The operation is the full route template however the app is assembled: routes of an
    ``include_router`` (with prefixes, nested; FastAPI keeps them as one nested route), of a
    mounted sub-application and of a mount inside it. Per-route policy keyed by such a
    template applies (here its maximum), and an unknown path under a mount is labelled by the
    mount's own template, so the label set stays bounded."""
    seen: list[tuple[str, float | None]] = []

    def record() -> dict[str, str]:
        ctx = brownout.current()
        seen.append((ctx.operation, ctx.remaining()))
        return {}

    inner = APIRouter(prefix="/orders")

    @inner.get("/{order_id}")
    async def order(order_id: int) -> dict[str, str]:
        return record()

    outer = APIRouter(prefix="/v1")
    outer.include_router(inner)

    @outer.get("/ping")
    async def ping() -> dict[str, str]:
        return record()

    sub = FastAPI()

    @sub.get("/reports/{rid}")
    async def report(rid: str) -> dict[str, str]:
        return record()

    async def asset(request: Request) -> JSONResponse:
        return JSONResponse(record())

    sub.mount("/assets", Starlette(routes=[StarletteRoute("/{name}", asset)]))
    app = FastAPI()
    app.include_router(outer)
    app.mount("/legacy", sub)
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(8)),
        routes={"/v1/orders/{order_id}": Route(default=0.5, maximum=0.5)},
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        for path in ("/v1/orders/7", "/v1/ping", "/legacy/reports/r9", "/legacy/assets/a.css"):
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/legacy/nothing/here")).status_code == 404
    assert [op for op, _ in seen] == [
        "/v1/orders/{order_id}",
        "/v1/ping",
        "/legacy/reports/{rid}",
        "/legacy/assets/{name}",
    ]
    remaining = seen[0][1]
    assert remaining is not None and remaining <= 0.5  # the included route's own policy
    layer: Any = app.middleware_stack
    while not isinstance(layer, BrownoutMiddleware):
        layer = layer.app
    route, _ = layer._paths["/legacy/nothing/here"]
    assert route.template == "/legacy/{path}"  # an unknown path, labelled by its mount


async def test_quota_refusal_is_429_with_ratelimit_headers() -> None:
    @dataclass
    class Decision:
        allowed: bool
        retry_after: float | None = 2.0
        limit: int | None = 10
        remaining: int | None = 0
        reset: float | None = 1.5

    async def quota(c: Classification) -> Decision:
        return Decision(allowed=c.caller != "anonymous")

    hub = EventHub()
    stats = hub.subscribe(Stats())
    app = FastAPI()

    @app.get("/x")
    async def x() -> dict[str, str]:
        return {"ok": "yes"}

    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), events=hub),
        classifier=caller_from_user,
        trust=trust_authenticated,
        quota=quota,
        events=hub,
    )
    app.add_middleware(BrownoutMiddleware, policy=policy)
    app.add_middleware(AuthenticationMiddleware, backend=TokenAuth())
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        refused = await client.get("/x")
        allowed = await client.get("/x", headers={"authorization": "Bearer internal"})
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert json.loads(refused.content)["reason"] == "quota"
    assert 2 <= int(refused.headers["retry-after"]) <= 4  # [ceil(2), ceil(2 * 1.5) + 1]
    assert refused.headers["ratelimit-limit"] == "10"
    assert refused.headers["ratelimit-remaining"] == "0"
    assert refused.headers["ratelimit-reset"] == "2"
    assert allowed.status_code == 200
    assert isinstance(stats, Stats)
    assert stats.count("shed", reason="quota", caller="anonymous") == 1
    assert stats.count("offered") == 2  # once each: quota refusal by the edge, else bulkhead
