"""A quota refusal over grpc.aio: RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms`` (S2, F1).

A real grpc.aio server on an ephemeral port, the edge's `BrownoutServerInterceptor` with
``EdgePolicy(quota=quota.for_edge(key=lambda c: c.caller))``, and a real grpc.aio client. The
caller comes from metadata through a classifier (standing in for authentication).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from brownout import Classification, EdgePolicy, InMemoryQuotaStore, Quota, QuotaStoreUnavailable
from brownout._quota import GcraOutcome, GcraPolicy
from brownout.events import EventHub
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.testing import ManualClock

pytestmark = pytest.mark.integration

METHOD = "/brownout.test.Echo/Say"


def caller_from_metadata(request: Any, default: Classification) -> Classification:
    for key, value in request.metadata:
        if key == "x-caller":
            return default._replace(caller=str(value))
    return default


async def say(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return b"hello " + request


async def start_server(quota: Quota) -> tuple[grpc.aio.Server, int]:
    policy = EdgePolicy(
        quota=quota.for_edge(key=lambda c: c.caller),
        classifier=caller_from_metadata,
        events=EventHub(),
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "brownout.test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def frozen_quota_server() -> AsyncIterator[tuple[Quota, int]]:
    # Time stands still for the quota, so the test cannot flake on a slow machine.
    quota = Quota(
        rate=1.0, burst=2, store=InMemoryQuotaStore(clock=ManualClock()), events=EventHub()
    )
    server, port = await start_server(quota)
    try:
        yield quota, port
    finally:
        await server.stop(None)


async def call(channel: grpc.aio.Channel, caller: str) -> bytes:
    rpc = channel.unary_unary(METHOD)
    result: bytes = await rpc(b"x", metadata=(("x-caller", caller),), timeout=5)
    return result


async def test_quota_refusal_is_resource_exhausted_with_pushback(
    frozen_quota_server: tuple[Quota, int],
) -> None:
    _, port = frozen_quota_server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert await call(channel, "tenant-a") == b"hello x"
        assert await call(channel, "tenant-a") == b"hello x"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(channel, "tenant-a")
        err = caught.value
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.trailing_metadata() or ())
        assert trailers["brownout-reason"] == "quota"
        # GCRA says 1 s until the next request; the edge stretches it by up to +50% jitter.
        assert 1000 <= int(trailers["grpc-retry-pushback-ms"]) <= 1500
        assert await call(channel, "tenant-b") == b"hello x"  # quotas are per caller


class DeadStore:
    """A shared store that is down: what a RedisQuotaStore raises when Redis is unreachable."""

    shared = True
    timeout = 0.05

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        raise QuotaStoreUnavailable("connection refused")


async def test_fail_closed_quota_is_unavailable_not_resource_exhausted() -> None:
    quota = Quota(1.0, 2, store=DeadStore(), on_store_failure="closed", events=EventHub())
    server, port = await start_server(quota)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "tenant-a")
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
