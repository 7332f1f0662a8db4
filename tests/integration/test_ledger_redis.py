"""Unknown outcomes on a real Redis and a real HTTP server over loopback (D6, T3).

Uses the shared Redis at 127.0.0.1:6379 with a unique key prefix per test (cleaned up).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from brownout import Dependency, RetryPolicy, UnknownOutcome
from brownout.retry import (
    ExponentialBackoff,
    OutcomeRecord,
    OutcomeState,
    Reconciler,
    ResponseError,
    TransientError,
)
from brownout.retry.ledger_redis import RedisOutcomeLedger

redis_asyncio = pytest.importorskip("redis.asyncio")
httpx = pytest.importorskip("httpx")
web = pytest.importorskip("aiohttp.web")

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis_client() -> AsyncIterator[tuple[object, str]]:
    client = redis_asyncio.Redis(host="127.0.0.1", port=6379)
    try:
        await client.ping()
    except Exception:  # pragma: no cover - environment
        await client.aclose()
        pytest.skip("SKIPPED LOUDLY: no Redis at 127.0.0.1:6379; the Redis ledger is untested")
    prefix = f"test-ledger-{uuid.uuid4().hex}"
    yield client, prefix
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_record_resolve_pending_and_expiry(redis_client: tuple[object, str]) -> None:
    client, prefix = redis_client
    ledger = RedisOutcomeLedger(client, prefix=prefix, ttl=60, wall=lambda: 1000.0)
    await ledger.record_unknown("k1", dependency="payments", detail="read timeout")
    await ledger.record_unknown("k1", dependency="other")  # first record wins
    await ledger.record_unknown("k2", dependency="payments")
    rec = await ledger.get("k1")
    assert rec == OutcomeRecord("k1", "payments", OutcomeState.PENDING, 1000.0, "read timeout")
    assert [r.key for r in await ledger.pending()] == ["k1", "k2"]
    ttl = await client.ttl(f"{prefix}:outcome:k1")  # type: ignore[attr-defined]
    assert 0 < ttl <= 60  # bounded in time

    await ledger.note_check("k2")
    await ledger.resolve("k1", OutcomeState.APPLIED)
    got = await ledger.get("k1")
    assert got is not None and got.state is OutcomeState.APPLIED
    pending = await ledger.pending()
    assert [(r.key, r.checks) for r in pending] == [("k2", 1)]

    await client.delete(f"{prefix}:outcome:k2")  # as if it expired
    assert await ledger.pending() == []
    assert await client.zcard(f"{prefix}:outcomes:pending") == 0  # type: ignore[attr-defined]
    await ledger.resolve("gone", OutcomeState.APPLIED)  # no half-written record appears
    assert await ledger.get("gone") is None


class PaymentServer:
    """Applies a charge 0.5 s after receiving it, deduplicating by Idempotency-Key."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.applied: dict[str, int] = {}
        self.work: set[asyncio.Task[None]] = set()

    async def apply(self, key: str) -> None:
        await asyncio.sleep(0.5)
        self.applied[key] = self.applied.get(key, 0) + (0 if key in self.applied else 1)

    async def charge(self, request: web.Request) -> web.Response:
        key = request.headers["idempotency-key"]
        self.received.append(key)
        if key in self.applied:
            return web.json_response({"status": "applied"})
        task = asyncio.create_task(self.apply(key))
        self.work.add(task)
        await asyncio.shield(task)
        return web.json_response({"status": "applied"})

    async def status(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        return web.json_response({"applied": key in self.applied})


async def test_mutation_applied_after_client_timeout_is_reconciled_by_key(
    redis_client: tuple[object, str],
) -> None:
    client, prefix = redis_client
    server = PaymentServer()
    app = web.Application()
    app.router.add_post("/charge", server.charge)
    app.router.add_get("/status/{key}", server.status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as http:

            async def charge(amount: int) -> object:
                from brownout import current

                key = current().idempotency_key
                assert key is not None
                try:
                    r = await http.post(
                        "/charge", json={"amount": amount}, headers={"idempotency-key": key}
                    )
                except httpx.ConnectError as e:
                    raise TransientError(str(e), sent=False) from e
                except httpx.TransportError as e:
                    raise TransientError(str(e), sent=True) from e
                if r.status_code >= 400:
                    raise ResponseError(r.status_code, response=r)
                return r.json()

            ledger = RedisOutcomeLedger(client, prefix=prefix, ttl=60)
            payments = Dependency(
                "payments",
                timeout=0.2,
                retry=RetryPolicy(2, backoff=ExponentialBackoff(0.01, cap=0.02)),
                ledger=ledger,
            )
            with pytest.raises(UnknownOutcome) as info:
                await payments.call(charge, 10)  # a mutation: keyed, retried, then unknown
            key = info.value.idempotency_key
            assert key is not None
            rec = await ledger.get(key)
            assert rec is not None and rec.state is OutcomeState.PENDING

            async def check(record: OutcomeRecord) -> OutcomeState:
                r = await http.get(f"/status/{record.key}")
                return OutcomeState.APPLIED if r.json()["applied"] else OutcomeState.PENDING

            reconciler = Reconciler(ledger, check)
            assert await reconciler.run_once() == []  # not applied yet: still unknown
            await asyncio.gather(*server.work)
            resolved = await reconciler.run_once()
            assert [(r.key, r.state) for r in resolved] == [(key, OutcomeState.APPLIED)]
            assert server.received == [key, key]  # the retry carried the same key
            assert server.applied == {key: 1}  # ... and caused no duplicate side effect
            assert await ledger.pending() == []
    finally:
        await runner.cleanup()
