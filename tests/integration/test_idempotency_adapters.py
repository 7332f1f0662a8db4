"""The idempotency adapters on real servers over loopback: uvicorn (ASGI, with the in-memory,
Redis and PostgreSQL stores), aiohttp and grpc.aio, each inside brownout's edge.

Checked through real clients: a concurrent duplicate gets 409, a repeat gets the stored answer
byte for byte (marked ``idempotent-replayed``), another payload 422, a missing required key
400, a crashed handler's key runs again, a handler cut off by its deadline keeps its key
locked until the lease ends and then runs again, and on PostgreSQL N concurrent and retried
HTTP requests with one key write one row.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from aiohttp import ClientSession, web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as StarletteRoute
from tests import services
from tests.integration.servers import serve, serve_aiohttp, serve_grpc

import brownout
from brownout import Bulkhead, Classification, EdgePolicy, InboundDeadlinePolicy, Route
from brownout.idempotency import (
    Idempotency,
    IdempotencyRule,
    InMemoryIdempotencyStore,
    PostgresIdempotencyStore,
    RedisIdempotencyStore,
    transaction,
)
from brownout.integrations.aiohttp_idempotency import idempotency_middleware
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.asgi_idempotency import IdempotencyMiddleware
from brownout.integrations.grpc_idempotency import IdempotencyServerInterceptor
from brownout.integrations.grpc_server import BrownoutServerInterceptor, GrpcCall
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration

RULES = {
    "/pay": IdempotencyRule(required=True),
    "/crash": IdempotencyRule(),
    "/slow": IdempotencyRule(),
    "/test.Pay/Pay": IdempotencyRule(required=True),
}


def policy(classifier: Any) -> EdgePolicy:
    return EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(32), FifoQueue(max_size=32, max_wait=1.0)),
        deadline=InboundDeadlinePolicy(default=3.0, maximum=5.0),
        classifier=classifier,
        routes={"/slow": Route(maximum=0.5)},
    )


def asgi_caller(scope: Any, default: Classification) -> Classification:
    user = dict(scope["headers"]).get(b"x-user", b"anonymous").decode()
    return default._replace(caller=user)


class Effects:
    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.crash = True
        self.sleep = 3.0


def asgi_app(idem: Idempotency, effects: Effects) -> Any:
    async def pay(request: Request) -> Response:
        body = await request.json()
        effects.runs["pay"] = effects.runs.get("pay", 0) + 1
        await asyncio.sleep(float(request.query_params.get("hold", "0")))
        answer = {
            "paid": body["amount"],
            "id": uuid.uuid4().hex,
            "caller": brownout.current().caller,
        }
        return JSONResponse(answer, status_code=201)

    async def crash(request: Request) -> Response:
        effects.runs["crash"] = effects.runs.get("crash", 0) + 1
        if effects.crash:
            raise RuntimeError("crashed")
        return Response(b"done", status_code=201)

    async def slow(request: Request) -> Response:
        effects.runs["slow"] = effects.runs.get("slow", 0) + 1
        await asyncio.sleep(effects.sleep)
        return Response(b"slow done", status_code=201)

    app = Starlette(
        routes=[
            StarletteRoute("/pay", pay, methods=["POST"]),
            StarletteRoute("/crash", crash, methods=["POST"]),
            StarletteRoute("/slow", slow, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, idempotency=idem)
    app.add_middleware(BrownoutMiddleware, policy=policy(asgi_caller))  # outermost
    return app


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield InMemoryIdempotencyStore()
        return
    redis_asyncio = pytest.importorskip("redis.asyncio")
    server = services.require(services.REDIS)
    client = redis_asyncio.Redis(host=server.host, port=server.port)
    yield RedisIdempotencyStore(client, prefix=f"test:idem:{uuid.uuid4().hex[:8]}:")
    await client.aclose()


async def settled(client: httpx.AsyncClient, path: str, **kw: Any) -> httpx.Response:
    """A repeat right after an answer: the ASGI layer sends a Redis or memory store's answer
    first and stores it right after, so a repeat within that round trip may get 409 (never a
    second run); a client retries it after a moment."""
    for _ in range(3):
        r = await client.post(path, **kw)
        if r.status_code != 409:
            return r
        await asyncio.sleep(0.05)
    return r


def key() -> dict[str, str]:
    return {"idempotency-key": f'"{uuid.uuid4()}"', "x-user": "alice"}


async def test_asgi_replay_conflict_mismatch_missing(store: Any) -> None:
    effects = Effects()
    async with serve(asgi_app(Idempotency(store, operations=RULES), effects)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            headers = key()
            first, second = await asyncio.gather(
                client.post("/pay?hold=0.4", json={"amount": 5}, headers=headers),
                client.post("/pay?hold=0.4", json={"amount": 5}, headers=headers),
            )
            codes = sorted([first.status_code, second.status_code])
            assert codes == [201, 409], codes
            done, busy = (first, second) if first.status_code == 201 else (second, first)
            assert busy.headers["content-type"] == "application/problem+json"
            assert int(busy.headers["retry-after"]) >= 1
            replay = await settled(client, "/pay?hold=0.4", json={"amount": 5}, headers=headers)
            assert replay.status_code == 201
            assert replay.content == done.content  # byte for byte (a fresh run has a new id)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.headers["content-type"] == done.headers["content-type"]
            other = await client.post("/pay?hold=0.4", json={"amount": 6}, headers=headers)
            assert other.status_code == 422
            assert other.json()["reason"] == "idempotency_mismatch"
            missing = await client.post("/pay", json={"amount": 5}, headers={"x-user": "alice"})
            assert missing.status_code == 400 and missing.json()["reason"] == "idempotency_missing"
            # the same key from another caller is another request
            bob = await client.post(
                "/pay", json={"amount": 5}, headers={**headers, "x-user": "bob"}
            )
            assert bob.status_code == 201 and bob.json()["caller"] == "bob"
    assert effects.runs["pay"] == 2


async def test_asgi_crash_then_retry_runs_again(store: Any) -> None:
    effects = Effects()
    async with serve(asgi_app(Idempotency(store, operations=RULES), effects)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            headers = key()
            crashed = await client.post("/crash", content=b"x", headers=headers)
            assert crashed.status_code == 500
            effects.crash = False
            retry = await client.post("/crash", content=b"x", headers=headers)
            assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
            replay = await settled(client, "/crash", content=b"x", headers=headers)
            assert replay.headers["idempotent-replayed"] == "true"
    assert effects.runs["crash"] == 2


async def test_asgi_deadline_then_retry_after_the_lease(store: Any) -> None:
    effects = Effects()
    idem = Idempotency(store, operations=RULES, lease_margin=0.5)
    async with serve(asgi_app(idem, effects)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            headers = key()
            expired = await client.post("/slow", content=b"x", headers=headers)
            assert expired.status_code == 504  # the edge cut it off at 0.5 s
            early = await client.post("/slow", content=b"x", headers=headers)
            assert early.status_code == 409 and early.headers["retry-after"] == "1"
            assert effects.runs["slow"] == 1  # not run twice while its outcome is unknown
            await asyncio.sleep(0.8)  # the lease: 0.5 s deadline + 0.5 s margin, from the start
            effects.sleep = 0.0
            retry = await client.post("/slow", content=b"x", headers=headers)
            assert retry.status_code == 201
    assert effects.runs["slow"] == 2


@pytest.fixture
async def pg_store(postgres_server: services.Service) -> AsyncIterator[PostgresIdempotencyStore]:
    asyncpg = pytest.importorskip("asyncpg")
    pool = await asyncpg.create_pool(
        host=postgres_server.host,
        port=postgres_server.port,
        user="postgres",
        database="test",
        min_size=1,
        max_size=10,
    )
    table = f"idem_{uuid.uuid4().hex[:8]}"
    store = PostgresIdempotencyStore(pool, table=table)
    await store.setup()
    await pool.execute(f"CREATE TABLE {table}_payments (amount int)")
    yield store
    await pool.execute(f"DROP TABLE {table}, {table}_payments")
    await pool.close()


async def test_asgi_postgres_exactly_once(pg_store: PostgresIdempotencyStore) -> None:
    table = f"{pg_store.table}_payments"

    async def pay(request: Request) -> Response:
        amount = (await request.json())["amount"]
        await transaction().execute(f"INSERT INTO {table} VALUES ($1)", amount)
        await asyncio.sleep(0.1)
        if request.query_params.get("crash"):
            raise RuntimeError("crashed after the write")
        return JSONResponse({"paid": amount, "id": uuid.uuid4().hex}, status_code=201)

    app = Starlette(routes=[StarletteRoute("/pay", pay, methods=["POST"])])
    idem = Idempotency(pg_store, operations=RULES)
    served = BrownoutMiddleware(IdempotencyMiddleware(app, idem), policy(asgi_caller))
    async with serve(served) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            headers = key()
            crashed = await client.post("/pay?crash=1", json={"amount": 5}, headers=headers)
            assert crashed.status_code == 500
            tries = await asyncio.gather(
                *(client.post("/pay", json={"amount": 5}, headers=headers) for _ in range(6))
            )
            codes = sorted(r.status_code for r in tries)
            assert codes.count(201) == 1 and codes.count(409) == 5, codes
            first = next(r for r in tries if r.status_code == 201)
            for _ in range(3):
                again = await client.post("/pay", json={"amount": 5}, headers=headers)
                assert again.status_code == 201 and again.content == first.content
    count = await pg_store._pool.fetchval(f"SELECT count(*) FROM {table}")
    assert count == 1


# -- aiohttp ----------------------------------------------------------------------------------
def aiohttp_caller(request: Any, default: Classification) -> Classification:
    return default._replace(caller=request.headers.get("x-user", "anonymous"))


async def test_aiohttp_replay_conflict_mismatch_missing_crash() -> None:
    runs = {"pay": 0, "crash": 0}

    async def pay(request: web.Request) -> web.Response:
        runs["pay"] += 1
        await asyncio.sleep(float(request.query.get("hold", "0")))
        body = await request.json()
        return web.json_response({"paid": body["amount"], "id": uuid.uuid4().hex}, status=201)

    async def crash(request: web.Request) -> web.Response:
        runs["crash"] += 1
        if runs["crash"] == 1:
            raise RuntimeError("crashed")
        return web.Response(status=201, text="done")

    async def slow(request: web.Request) -> web.Response:
        runs["slow"] = runs.get("slow", 0) + 1
        await asyncio.sleep(3.0 if runs["slow"] == 1 else 0.0)
        return web.Response(status=201, text="slow done")

    idem = Idempotency(InMemoryIdempotencyStore(), operations=RULES, lease_margin=0.5)
    app = web.Application(
        middlewares=[brownout_middleware(policy(aiohttp_caller)), idempotency_middleware(idem)]
    )
    app.router.add_post("/pay", pay)
    app.router.add_post("/crash", crash)
    app.router.add_post("/slow", slow)
    async with serve_aiohttp(app) as url, ClientSession(url) as client:
        headers = key()

        async def post(path: str, amount: int = 5, **kw: Any) -> tuple[int, dict[str, str], bytes]:
            async with client.post(path, json={"amount": amount}, **kw) as r:
                return r.status, dict(r.headers), await r.read()

        first, second = await asyncio.gather(
            post("/pay?hold=0.4", headers=headers), post("/pay?hold=0.4", headers=headers)
        )
        assert sorted([first[0], second[0]]) == [201, 409]
        done = first if first[0] == 201 else second
        replay = await post("/pay?hold=0.4", headers=headers)
        assert replay[0] == 201 and replay[2] == done[2]
        assert replay[1]["idempotent-replayed"] == "true"
        assert (await post("/pay?hold=0.4", 6, headers=headers))[0] == 422
        missing = await post("/pay", headers={"x-user": "alice"})
        assert missing[0] == 400 and json.loads(missing[2])["reason"] == "idempotency_missing"
        crash_key = key()
        assert (await post("/crash", headers=crash_key))[0] == 500
        assert (await post("/crash", headers=crash_key))[0] == 201
        assert (await post("/crash", headers=crash_key))[1]["idempotent-replayed"] == "true"
        # cut off at its deadline: locked until the lease ends, then it runs again
        slow_key = key()
        assert (await post("/slow", headers=slow_key))[0] == 504
        assert (await post("/slow", headers=slow_key))[0] == 409
        await asyncio.sleep(0.8)
        assert (await post("/slow", headers=slow_key))[0] == 201
    assert runs == {"pay": 1, "crash": 2, "slow": 2}


# -- grpc.aio ---------------------------------------------------------------------------------
def _ident(b: bytes) -> bytes:
    return b


def grpc_caller(call: GrpcCall, default: Classification) -> Classification:
    return default._replace(caller=dict(call.metadata).get("x-user", "anonymous"))


async def test_grpc_replay_conflict_mismatch_missing() -> None:
    runs: list[bytes] = []
    crashes: list[bytes] = []

    async def pay(request: bytes, context: Any) -> bytes:
        runs.append(request)
        await asyncio.sleep(0.4)
        return b"paid:" + request + b":" + uuid.uuid4().hex.encode()

    async def crash(request: bytes, context: Any) -> bytes:
        crashes.append(request)
        if len(crashes) == 1:
            raise RuntimeError("crashed")
        if len(crashes) == 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return b"done"

    idem = Idempotency(InMemoryIdempotencyStore(), operations=RULES)
    server = grpc.aio.server(
        interceptors=[
            BrownoutServerInterceptor(policy(grpc_caller)),
            IdempotencyServerInterceptor(idem),
        ]
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Pay",
                {
                    "Pay": grpc.unary_unary_rpc_method_handler(
                        pay, request_deserializer=_ident, response_serializer=_ident
                    ),
                    "Crash": grpc.unary_unary_rpc_method_handler(
                        crash, request_deserializer=_ident, response_serializer=_ident
                    ),
                },
            ),
        )
    )
    async with serve_grpc(server) as target, grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(
            "/test.Pay/Pay", request_serializer=_ident, response_deserializer=_ident
        )
        md = (("idempotency-key", "k-1"), ("x-user", "alice"))
        results = await asyncio.gather(
            call(b"5", metadata=md), call(b"5", metadata=md), return_exceptions=True
        )
        answers = [r for r in results if isinstance(r, bytes)]
        errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(answers) == 1 and len(errors) == 1, results
        assert errors[0].code() == grpc.StatusCode.ABORTED
        replay_call = call(b"5", metadata=md)
        assert await replay_call == answers[0]
        assert ("idempotent-replayed", "true") in tuple(await replay_call.initial_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:
            await call(b"6", metadata=md)
        assert mismatch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await call(b"5", metadata=(("x-user", "alice"),))
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a handler that raises, or ends the call with an error status, releases its key
        crash_call = channel.unary_unary(
            "/test.Pay/Crash", request_serializer=_ident, response_deserializer=_ident
        )
        md = (("idempotency-key", "c-1"), ("x-user", "alice"))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await crash_call(b"x", metadata=md)
        assert raised.value.code() == grpc.StatusCode.UNKNOWN
        with pytest.raises(grpc.aio.AioRpcError) as aborted:
            await crash_call(b"x", metadata=md)
        assert aborted.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await crash_call(b"x", metadata=md) == b"done"
        assert await crash_call(b"x", metadata=md) == b"done"  # replayed
    assert runs == [b"5"]
    assert len(crashes) == 3
