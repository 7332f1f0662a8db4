"""Unknown outcomes end to end (D6, T3, R2, R5): httpx + `BrownoutTransport` + a real server.

The payment server deduplicates by ``Idempotency-Key`` and applies a charge only when the test
opens its gate, i.e. *after* the client's attempts have timed out. The client gets
`UnknownOutcome(key)`; the ledger (in memory, and on the shared Redis) holds the key; the
`Reconciler` asks the server and resolves it; a resend with the same key causes no second
side effect. A second test covers the other branch: the server never applied it, the
reconciler says so, and a resend applies it exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests import services
from tests.integration.servers import serve

from brownout import (
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    OutcomeLedger,
    OutcomeState,
    Reconciler,
    RetryPolicy,
    UnknownOutcome,
)
from brownout._retry import OutcomeRecord
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration


class PaymentServer:
    """Charges once per Idempotency-Key; a charge waits for ``gate`` before it is applied."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.received: list[str] = []
        self.charges: dict[str, str] = {}  # key -> charge id: the side effect
        self.in_progress: dict[str, asyncio.Task[str]] = {}
        self._ids = itertools.count(1)

    async def _apply(self, key: str) -> str:
        await self.gate.wait()
        charge = f"ch_{next(self._ids)}"
        self.charges[key] = charge
        del self.in_progress[key]
        return charge

    async def charge(self, request: Request) -> Response:
        key = request.headers["idempotency-key"]
        self.received.append(key)
        if key in self.charges:  # a repeat: answer with the original result
            return JSONResponse({"charge": self.charges[key], "replayed": True})
        task = self.in_progress.get(key)
        if task is None:
            # Runs on its own: a client that goes away does not undo the charge.
            task = self.in_progress[key] = asyncio.create_task(self._apply(key))
        charge = await asyncio.shield(task)
        return JSONResponse({"charge": charge, "replayed": False})

    async def status(self, request: Request) -> Response:
        key = request.path_params["key"]
        if key in self.charges:
            return JSONResponse({"state": "applied"})
        if key in self.in_progress:
            return JSONResponse({"state": "in_progress"})
        return JSONResponse({"state": "unknown"})

    def forget_in_progress(self) -> None:
        """Crash before applying: in-flight charges are lost, never applied."""
        for task in self.in_progress.values():
            task.cancel()
        self.in_progress.clear()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/charges", self.charge, methods=["POST"]),
                Route("/charges/{key}", self.status),
            ]
        )


@pytest.fixture(params=["memory", "redis"])
async def ledger(request: pytest.FixtureRequest) -> AsyncIterator[OutcomeLedger]:
    if request.param == "memory":
        yield InMemoryOutcomeLedger(max_entries=100)
        return
    redis_asyncio = pytest.importorskip("redis.asyncio")
    from brownout._retry.ledger_redis import RedisOutcomeLedger

    server = services.require(services.REDIS)
    client = redis_asyncio.Redis(host=server.host, port=server.port)
    prefix = f"{{test-unknown-{uuid.uuid4().hex}}}"  # tagged as the ledger stores it
    try:
        yield RedisOutcomeLedger(client, prefix=prefix, ttl=60)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def payments_client(base: str, ledger: OutcomeLedger) -> httpx.AsyncClient:
    payments = Dependency(
        "payments",
        timeout=0.2,
        retry=RetryPolicy(2, backoff=ExponentialBackoff(0.001, cap=0.005)),
        ledger=ledger,
    )
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=payments)
    return httpx.AsyncClient(base_url=base, transport=transport)


def checker(http: httpx.AsyncClient) -> Any:
    async def check(record: OutcomeRecord) -> OutcomeState:
        state = (await http.get(f"/charges/{record.key}")).json()["state"]
        if state == "applied":
            return OutcomeState.APPLIED
        if state == "unknown":
            return OutcomeState.NOT_APPLIED
        return OutcomeState.PENDING

    return check


async def test_applied_after_the_client_timed_out_is_reconciled_without_duplicates(
    ledger: OutcomeLedger,
) -> None:
    server = PaymentServer()
    async with serve(server.app()) as base, payments_client(base, ledger) as http:
        with pytest.raises(UnknownOutcome) as info:
            await http.post("/charges", json={"amount": 42})
        key = info.value.idempotency_key
        assert key is not None
        assert server.received == [key, key]  # retried once, with the same key (R5)
        assert server.charges == {}  # nothing applied yet: the outcome really is unknown
        record = await ledger.get(key)
        assert record is not None and record.state is OutcomeState.PENDING

        reconciler = Reconciler(ledger, checker(http))
        assert await reconciler.run_once() == []  # in progress on the server: still unknown

        server.gate.set()  # the server applies the charge, after the client gave up
        for _ in range(200):
            if key in server.charges:
                break
            await asyncio.sleep(0.01)
        resolved = await reconciler.run_once()
        assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.APPLIED)]
        assert await ledger.pending() == []

        again = await http.post("/charges", json={"amount": 42}, headers={"idempotency-key": key})
        assert again.status_code == 200
        assert again.json() == {"charge": server.charges[key], "replayed": True}
        assert len(server.charges) == 1  # one side effect for three sends of the same key


async def test_never_applied_is_reconciled_and_resent_exactly_once(
    ledger: OutcomeLedger,
) -> None:
    server = PaymentServer()
    async with serve(server.app()) as base, payments_client(base, ledger) as http:
        with pytest.raises(UnknownOutcome) as info:
            await http.post("/charges", json={"amount": 7})
        key = info.value.idempotency_key
        assert key is not None
        server.forget_in_progress()  # the server lost it before applying

        resolved = await Reconciler(ledger, checker(http)).run_once()
        assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.NOT_APPLIED)]

        server.gate.set()
        first = await http.post("/charges", json={"amount": 7}, headers={"idempotency-key": key})
        second = await http.post("/charges", json={"amount": 7}, headers={"idempotency-key": key})
        assert first.json()["replayed"] is False and second.json()["replayed"] is True
        assert first.json()["charge"] == second.json()["charge"]
        assert list(server.charges) == [key]
