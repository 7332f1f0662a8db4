"""The gRPC edge's express path against a real grpc.aio server and a real grpcio client.

As for the HTTP middlewares (``test_asgi_express.py``, ``test_aiohttp_express.py``): a call
that carries no brownout metadata, on a method whose policy needs nothing beyond the
defaults, at an uncontended bulkhead, is admitted inline instead of through
`EdgePolicy.serve`. These tests check that it behaves and counts exactly as the general path
does: D1/D3 (the client's timeout, clamped, is the handler's remaining time), D5 (cancel at
expiry or client cancellation), S2 (UNAVAILABLE with the reason), O1 (every outcome counted),
G1/G2 (degraded modes announced, fallback answers not taught to the limit).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.limits import CountingBulkhead, SpyLimit

import brownout
from brownout import (
    DegradedMode,
    DegradedModes,
    EdgePolicy,
    Priority,
    Reason,
    Rejected,
    Route,
    Stats,
)
from brownout.events import EventHub
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


@dataclass
class Service:
    channel: grpc.aio.Channel
    stats: Stats
    bulkhead: CountingBulkhead
    cancelled: list[str] = field(default_factory=list)


def unary(fn: Any) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(fn)


async def start(
    policy_for: Any = None, limit: Any = None, recs: Any = None
) -> AsyncIterator[Service]:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    bulkhead = CountingBulkhead(
        "rpc", limit or FixedLimit(1), FifoQueue(max_size=4, max_wait=2.0), events=hub
    )
    cancelled: list[str] = []

    async def echo(request: bytes, context: Any) -> bytes:
        ctx = brownout.current()
        seen = {
            "remaining": ctx.remaining(),
            "priority": ctx.priority.label,
            "operation": ctx.operation,
            "in_flight": bulkhead.in_flight,
        }
        try:
            await asyncio.sleep(float(request or b"0"))
        except asyncio.CancelledError:
            cancelled.append("echo")
            raise
        return json.dumps(seen).encode()

    async def raises(request: bytes, context: Any) -> bytes:
        raise RuntimeError("boom")

    async def stubborn(request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append("stubborn")
        return b"answered anyway"

    async def missing(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such item")
        raise AssertionError("abort raises")

    async def aborts_internal(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.INTERNAL, "broken")
        raise AssertionError("abort raises")

    async def sets_internal(request: bytes, context: Any) -> bytes:
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details("broken")
        return b""

    async def breaker(request: bytes, context: Any) -> bytes:
        raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")

    async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()

    async def recommendations(request: bytes, context: Any) -> bytes:
        return str(await recs()).encode()

    handlers = grpc.method_handlers_generic_handler(
        "test.Express",
        {
            "Echo": unary(echo),
            "Raises": unary(raises),
            "Breaker": unary(breaker),
            "Missing": unary(missing),
            "Stubborn": unary(stubborn),
            "AbortsInternal": unary(aborts_internal),
            "SetsInternal": unary(sets_internal),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Recs": unary(recommendations),
        },
    )
    policy = (policy_for or _policy)(bulkhead, hub)
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Service(channel, stats, bulkhead, cancelled)
    finally:
        await server.stop(None)


def _policy(bulkhead: CountingBulkhead, hub: EventHub) -> EdgePolicy:
    return EdgePolicy(
        bulkhead=bulkhead,
        routes={"/test.Express/Echo": Route(default=1.5, maximum=5.0)},
        events=hub,
    )


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    async for svc in start():
        yield svc


async def settle() -> None:
    await asyncio.sleep(0.05)  # the bulkhead settles just after the last message left


async def echo(service: Service, hold: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    reply = await service.channel.unary_unary("/test.Express/Echo")(str(hold).encode(), **kwargs)
    return dict(json.loads(reply))


async def test_a_plain_call_takes_the_express_path_with_its_own_deadline(
    service: Service,
) -> None:
    with_timeout = await echo(service, timeout=3.0)
    clamped = await echo(service, timeout=60.0)
    without = await echo(service)
    assert service.bulkhead.express == 3
    # D1: the client's timeout. grpc core computes time_remaining() against a cached clock
    # that can lag real time by a few ms, overstating it slightly.
    assert 2.5 < with_timeout["remaining"] <= 3.0 + 0.025
    assert 4.0 < clamped["remaining"] <= 5.0  # D3: clamped to the route maximum
    assert 1.0 < without["remaining"] <= 1.5  # the route default
    assert with_timeout["operation"] == "/test.Express/Echo"
    assert with_timeout["in_flight"] == 1  # admitted: it holds a slot while it runs
    await settle()
    for kind in ("offered", "admitted", "completed"):
        assert service.stats.count(kind, operation="/test.Express/Echo") == 3, kind
    assert service.bulkhead.in_flight == 0


async def test_express_and_general_paths_count_alike(service: Service) -> None:
    for _ in range(3):
        await echo(service, timeout=5)
    for _ in range(3):  # priority metadata sends a call through EdgePolicy.serve
        seen = await echo(service, timeout=5, metadata=(("brownout-priority", "sheddable"),))
        assert seen["priority"] == Priority.CRITICAL.label  # untrusted: claim ignored
    assert service.bulkhead.express == 3
    await settle()
    for kind in ("offered", "admitted", "completed"):
        assert service.stats.count(kind, operation="/test.Express/Echo") == 6, kind


async def test_express_expiry_is_deadline_exceeded_and_cancels_the_handler(
    service: Service,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await echo(service, hold=10)  # the route default, 1.5 s, runs out first
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert service.bulkhead.express == 1
    assert service.cancelled == ["echo"]  # D5
    await settle()
    assert service.stats.count("expired", reason="running") == 1
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_express_failures_and_refusals_from_inside(service: Service) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await service.channel.unary_unary("/test.Express/Raises")(b"", timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await service.channel.unary_unary("/test.Express/Breaker")(b"", timeout=5)
    assert failed.value.code() is grpc.StatusCode.UNKNOWN
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert dict(refused.value.trailing_metadata() or ())["brownout-reason"] == "breaker_open"
    assert service.bulkhead.express == 2
    await settle()
    assert service.stats.count("failed", operation="/test.Express/Raises") == 1
    assert service.bulkhead.in_flight == 0


@pytest.mark.parametrize("express", [True, False], ids=["express", "serve"])
async def test_a_status_the_handler_ends_with_is_an_answer_or_a_failure(
    service: Service, express: bool
) -> None:
    """``context.abort`` and ``context.set_code`` are read as their HTTP equivalents on both
    paths: NOT_FOUND is an answer (goodput), INTERNAL a failure, however it was set."""
    metadata = () if express else (("brownout-priority", "sheddable"),)  # claims take serve
    codes = {}
    for method in ("Missing", "AbortsInternal", "SetsInternal"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await service.channel.unary_unary(f"/test.Express/{method}")(
                b"", timeout=5, metadata=metadata
            )
        codes[method] = err.value.code()
    assert codes == {
        "Missing": grpc.StatusCode.NOT_FOUND,
        "AbortsInternal": grpc.StatusCode.INTERNAL,
        "SetsInternal": grpc.StatusCode.INTERNAL,
    }
    assert service.bulkhead.express == (3 if express else 0)
    await settle()
    assert service.stats.count("completed", operation="/test.Express/Missing") == 1
    assert service.stats.count("failed", operation="/test.Express/Missing") == 0
    assert service.stats.count("failed", operation="/test.Express/AbortsInternal") == 1
    assert service.stats.count("failed", operation="/test.Express/SetsInternal") == 1
    assert service.stats.count("completed", operation="/test.Express/SetsInternal") == 0
    assert service.bulkhead.in_flight == 0


async def test_express_client_cancellation_counts_abandoned(service: Service) -> None:
    call = service.channel.unary_unary("/test.Express/Echo")(b"3", timeout=5)
    await asyncio.sleep(0.3)
    call.cancel()
    for _ in range(150):
        if service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.bulkhead.express == 1
    assert service.cancelled == ["echo"]  # D5
    await settle()
    assert service.stats.count("abandoned") == 1  # O1: not a success
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


async def test_streams_take_the_express_path(service: Service) -> None:
    stream = service.channel.unary_stream("/test.Express/Count")(b"3", timeout=5)
    got = [message async for message in stream]
    assert got == [b"0", b"1", b"2"]
    assert service.bulkhead.express == 1
    await settle()
    assert service.stats.count("completed", operation="/test.Express/Count") == 1
    assert service.bulkhead.in_flight == 0


async def test_degraded_modes_on_the_express_path() -> None:
    """G1/G2: the active modes are named in the trailing metadata, and a fallback's answer is
    goodput that never teaches the adaptive limit (as under `serve`)."""
    spy = SpyLimit()
    modes = DegradedModes([DegradedMode("recs", "recommendations from a default list")])

    def policy(bulkhead: CountingBulkhead, hub: EventHub) -> EdgePolicy:
        return EdgePolicy(bulkhead=bulkhead, degraded=modes, events=hub)

    @modes.fallback("recs", lambda: "default")
    async def recommendations() -> str:
        await asyncio.sleep(0.01)
        return "personal"

    async for svc in start(policy, limit=spy, recs=recommendations):
        method = svc.channel.unary_unary("/test.Express/Recs")
        normal = method(b"", timeout=5)
        assert await normal == b"personal"
        await settle()
        taught = len(spy.samples)
        modes.force("recs", on=True)
        degraded = method(b"", timeout=5)
        assert await degraded == b"default"
        await settle()
        assert "brownout-degraded" not in dict(await normal.trailing_metadata() or ())
        assert dict(await degraded.trailing_metadata() or ())["brownout-degraded"] == "recs"
        assert svc.bulkhead.express == 2
        assert taught == 1  # a real answer is a sample for the limit
        assert len(spy.samples) == 1  # the fallback's answer is not
        assert svc.stats.count("completed") == 2  # both are goodput
        assert svc.bulkhead.in_flight == 0


@pytest.mark.parametrize("express", [True, False], ids=["express", "serve"])
async def test_a_handler_that_swallows_the_client_cancel_is_still_abandoned(
    service: Service, express: bool
) -> None:
    metadata = () if express else (("brownout-priority", "sheddable"),)  # claims take serve
    call = service.channel.unary_unary("/test.Express/Stubborn")(b"", timeout=10, metadata=metadata)
    await asyncio.sleep(0.3)
    call.cancel()
    for _ in range(150):
        if service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.cancelled == ["stubborn"]
    assert service.bulkhead.express == (1 if express else 0)
    await settle()
    assert service.stats.count("abandoned") == 1  # O1: nobody heard the answer
    assert service.stats.count("completed") == 0
    assert service.bulkhead.in_flight == 0


@pytest.mark.parametrize("path", ["express", "serve"])
async def test_a_fallback_whose_mode_ended_before_the_answer_is_still_named(path: str) -> None:
    """G2: the trailing metadata named only the modes active when the call ended, so a call
    answered by a fallback whose mode ended meanwhile carried no word of it."""
    modes = DegradedModes([DegradedMode("recs", "recommendations from a default list")])

    def policy(bulkhead: CountingBulkhead, hub: EventHub) -> EdgePolicy:
        return EdgePolicy(bulkhead=bulkhead, degraded=modes, events=hub)

    @modes.fallback("recs", lambda: "default")
    async def recommendations() -> str:
        return "personal"

    async def answered_then_ended() -> str:
        body = await recommendations()
        modes.force("recs", on=False)
        return body

    metadata = (("brownout-priority", "critical"),) if path == "serve" else ()
    async for svc in start(policy, recs=answered_then_ended):
        method = svc.channel.unary_unary("/test.Express/Recs")
        modes.force("recs", on=True)
        call = method(b"", timeout=5, metadata=metadata)
        assert await call == b"default"
        assert dict(await call.trailing_metadata() or ())["brownout-degraded"] == "recs"
        call = method(b"", timeout=5, metadata=metadata)  # off, no fallback: nothing named
        assert await call == b"personal"
        assert "brownout-degraded" not in dict(await call.trailing_metadata() or ())
        assert svc.bulkhead.express == (2 if path == "express" else 0)
