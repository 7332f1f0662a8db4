"""gRPC refusals follow the `EdgePolicy`: the status code and details of a refusal come from
the policy's tables (``statuses``, ``expired_status``, ``grpc_codes``, ``details``), as the
HTTP adapters' statuses and problem bodies do (issue 23: adapters translate, the edge
decides). A real grpc.aio server on loopback and a real client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Reason
from brownout.integrations.grpc_server import BrownoutServerInterceptor, status_code_for
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


def _ident(b: bytes) -> bytes:
    return b


async def _sleep(request: bytes, context: Any) -> bytes:
    await asyncio.sleep(float(request))
    return b"ok"


async def _server(policy: EdgePolicy) -> tuple[grpc.aio.Server, str]:
    handlers = grpc.method_handlers_generic_handler(
        "test.Policy",
        {"Sleep": grpc.unary_unary_rpc_method_handler(_sleep, _ident, _ident)},
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call(target: str, seconds: float, timeout: float = 5.0) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/test.Policy/Sleep")(str(seconds).encode(), timeout=timeout)
    return info.value


async def _hold(target: str) -> None:
    """A call holding the one slot for 0.15 s, answered within the route's 0.2 s."""
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.unary_unary("/test.Policy/Sleep")(b"0.15", timeout=5.0)


@pytest.fixture
async def full() -> AsyncIterator[tuple[EdgePolicy, str]]:
    """A server whose one slot is held: the next call is refused at once (queue_timeout)."""
    policy = EdgePolicy(
        bulkhead=Bulkhead("policy", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.01)),
        statuses={Reason.QUEUE_TIMEOUT: 429},
        details={Reason.QUEUE_TIMEOUT: "Come back later, please."},
        expired_status=503,
        deadline=InboundDeadlinePolicy(default=0.2, maximum=0.2),
    )
    server, target = await _server(policy)
    try:
        yield policy, target
    finally:
        await server.stop(None)


async def test_a_refusal_takes_its_grpc_code_and_details_from_the_policy(
    full: tuple[EdgePolicy, str],
) -> None:
    policy, target = full
    holder = asyncio.create_task(_hold(target))
    await asyncio.sleep(0.05)
    err = await _call(target, 0.0)
    await holder
    # statuses says 429, whose gRPC equivalent is RESOURCE_EXHAUSTED (UNAVAILABLE by default)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "Come back later, please."
    assert dict(err.trailing_metadata() or ())["brownout-reason"] == "queue_timeout"
    assert status_code_for(Reason.QUEUE_TIMEOUT, policy) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code_for(Reason.QUEUE_TIMEOUT) is grpc.StatusCode.UNAVAILABLE


async def test_expired_status_reaches_grpc(full: tuple[EdgePolicy, str]) -> None:
    # The server's deadline (route maximum 0.2 s) passes long before the client's (5 s):
    # the edge answers the expiry, with expired_status 503, i.e. UNAVAILABLE for gRPC.
    _, target = full
    err = await _call(target, 1.0, timeout=5.0)
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert dict(err.trailing_metadata() or ())["brownout-reason"] == "deadline_expired"
    assert err.details() == "The request's deadline passed before it could be answered."


async def test_grpc_codes_override_the_http_equivalent() -> None:
    policy = EdgePolicy(
        bulkhead=Bulkhead("policy", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.01)),
        statuses={Reason.QUEUE_TIMEOUT: 429},
        grpc_codes={Reason.DEADLINE_EXPIRED: "ABORTED", Reason.QUEUE_TIMEOUT: "UNAVAILABLE"},
        deadline=InboundDeadlinePolicy(default=0.2, maximum=0.2),
    )
    server, target = await _server(policy)
    try:
        expired = await _call(target, 1.0)
        assert expired.code() is grpc.StatusCode.ABORTED
        holder = asyncio.create_task(_hold(target))
        await asyncio.sleep(0.05)
        refused = await _call(target, 0.0)
        await holder
        assert refused.code() is grpc.StatusCode.UNAVAILABLE
        assert policy.refusal(Reason.QUEUE_TIMEOUT).status == 429  # HTTP keeps its own
    finally:
        await server.stop(None)


def test_grpc_codes_are_checked_when_the_policy_is_made() -> None:
    with pytest.raises(ValueError, match="UNAVAILBLE"):
        EdgePolicy(grpc_codes={Reason.QUOTA: "UNAVAILBLE"})
