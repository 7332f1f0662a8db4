"""The whole chain across processes (issue 27, item 5; I1, I2, D6, R5): client -> front ->
payment service, each a real server on loopback.

- client: this process, httpx with `BrownoutTransport` and a `Dependency` (retries, a
  generated idempotency key, a `RedisOutcomeLedger` on the real Redis);
- front: a uvicorn process (Starlette behind `BrownoutMiddleware`) calling the payment service
  through `BrownoutTransport`, so the key, the attempt and the deadline travel on;
- payment: another uvicorn process with the idempotency layer on `PostgresIdempotencyStore`:
  the payment row and the stored answer commit in one transaction. A request marked
  ``x-slow-after-commit`` answers that long *after* its commit, past the client's timeout.

Rows are counted in PostgreSQL. The processes are `brownout._lab.payments_service`, the same
the lab's ``payments`` scenario runs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from tests import services

import brownout
from brownout import (
    Dependency,
    ExponentialBackoff,
    OutcomeState,
    Reconciler,
    RedisOutcomeLedger,
    RetryPolicy,
    UnknownOutcome,
)
from brownout._lab.payments import CLIENT_CALLER, chain, chain_key
from brownout._retry import OutcomeRecord
from brownout.integrations.httpx import BrownoutTransport

pytestmark = pytest.mark.integration

asyncpg = pytest.importorskip("asyncpg")
redis_asyncio = pytest.importorskip("redis.asyncio")

SLOW = "2.5"
"""Seconds the payment answers after its commit: well past the client's 0.5 s timeout."""


def dsn(server: services.Service) -> str:
    return f"postgresql://postgres@{server.host}:{server.port}/test"


@pytest.fixture
def system(postgres_server: services.Service) -> Iterator[dict[str, str]]:
    table = f"sys_pay_{uuid.uuid4().hex[:8]}"
    with chain("brownout", dsn(postgres_server), table) as (front, payment):
        yield {"front": front, "payment": payment, "table": table}


@pytest.fixture
async def db(postgres_server: services.Service, system: dict[str, str]) -> AsyncIterator[Any]:
    conn = await asyncpg.connect(dsn(postgres_server))
    try:
        yield conn
    finally:
        table = system["table"]
        await conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_idem")
        await conn.close()


@pytest.fixture
async def ledger(redis_server: services.Service) -> AsyncIterator[RedisOutcomeLedger]:
    client = redis_asyncio.Redis(host=redis_server.host, port=redis_server.port)
    prefix = f"{{test-system-{uuid.uuid4().hex}}}"
    try:
        yield RedisOutcomeLedger(client, prefix=prefix, ttl=60)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def client(front: str, ledger: RedisOutcomeLedger, **kw: Any) -> httpx.AsyncClient:
    payments = Dependency(
        "payments",
        timeout=0.5,
        retry=RetryPolicy(3, backoff=ExponentialBackoff(0.01, cap=0.05)),
        ledger=ledger,
        **kw,
    )
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=payments)
    return httpx.AsyncClient(
        base_url=front, transport=transport, headers={"x-caller": CLIENT_CALLER}
    )


async def rows(db: Any, table: str, order: str) -> list[tuple[str, str]]:
    got = await db.fetch(f"SELECT order_id, idem_key FROM {table} WHERE order_id = $1", order)
    return [(r["order_id"], r["idem_key"]) for r in got]


async def test_a_retry_after_a_slow_commit_gets_the_stored_answer(
    system: dict[str, str], db: Any, ledger: RedisOutcomeLedger
) -> None:
    """Attempt 1 commits and answers after the client's timeout; the client's own retry,
    same key, through the front, gets the stored answer: one row, nothing left unknown."""
    key = f"order-{uuid.uuid4().hex}"
    async with client(system["front"], ledger) as http:
        r = await http.post(
            "/checkout",
            json={"order": "o-retry", "amount": 10},
            headers={"idempotency-key": key, "x-slow-after-commit": SLOW},
        )
    assert r.status_code == 201, r.text
    assert r.headers.get("idempotent-replayed") == "true"  # attempt 2 got the stored answer
    assert r.json()["order"] == "o-retry"
    assert await rows(db, system["table"], "o-retry") == [("o-retry", chain_key(key))]
    assert await ledger.pending() == []  # answered in the end: no unknown outcome


async def test_an_unknown_outcome_is_reconciled_as_applied_and_resent_once(
    system: dict[str, str], db: Any, ledger: RedisOutcomeLedger
) -> None:
    """The deadline leaves no time for a retry: the client records the unknown outcome; the
    reconciler asks the payment service by key and finds it applied; the resend with the same
    key through the front is a replay; one row in all."""
    async with client(system["front"], ledger, min_useful=0.4) as http:
        with pytest.raises(UnknownOutcome) as info:
            async with brownout.request(deadline=0.8):
                await http.post(
                    "/checkout",
                    json={"order": "o-lost", "amount": 25},
                    headers={"x-slow-after-commit": SLOW},
                )
        key = info.value.idempotency_key
        assert key is not None  # generated by the transport, the same on every attempt
        [record] = await ledger.pending()
        assert (record.key, record.state) == (key, OutcomeState.PENDING)
        assert await rows(db, system["table"], "o-lost") == [("o-lost", chain_key(key))]

        asked: list[str] = []
        async with httpx.AsyncClient(base_url=system["payment"], timeout=5) as payment:

            async def check(record: OutcomeRecord) -> OutcomeState:
                asked.append(record.key)
                applied = (await payment.get(f"/payments/{chain_key(record.key)}")).json()
                return OutcomeState.APPLIED if applied["applied"] else OutcomeState.NOT_APPLIED

            resolved = await Reconciler(ledger, check).run_once()
        assert asked == [key]
        assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.APPLIED)]
        assert await ledger.pending() == []

        again = await http.post(
            "/checkout",
            json={"order": "o-lost", "amount": 25},
            headers={"idempotency-key": key, "x-slow-after-commit": SLOW},
        )
        assert again.status_code == 201, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.json()["order"] == "o-lost"
    assert len(await rows(db, system["table"], "o-lost")) == 1


async def test_another_body_under_the_same_key_is_refused_not_applied(
    system: dict[str, str], db: Any, ledger: RedisOutcomeLedger
) -> None:
    """The same key with another payload is 422 at the payment service, relayed by the front:
    a client bug cannot turn into a second payment."""
    key = f"order-{uuid.uuid4().hex}"
    async with client(system["front"], ledger) as http:
        first = await http.post(
            "/checkout", json={"order": "o-422", "amount": 5}, headers={"idempotency-key": key}
        )
        other = await http.post(
            "/checkout", json={"order": "o-422", "amount": 6}, headers={"idempotency-key": key}
        )
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert other.status_code == 422
    assert len(await rows(db, system["table"], "o-422")) == 1
