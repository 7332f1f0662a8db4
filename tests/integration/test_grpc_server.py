"""The grpc.aio edge against a real server on loopback, with a real grpcio client.

Generic handlers with bytes (de)serializers: no protoc needed. Requirements: D1/D2/D3 (the
client's timeout is the handler's remaining time, clamped to the route maximum), D5 (expiry
and client cancellation stop the handler), S2 (UNAVAILABLE / RESOURCE_EXHAUSTED with
grpc-retry-pushback-ms), S4 (priority metadata only from a trusted source), S7 (health checks
answered within 50 ms under a 10x flood), O1 (abandoned).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.integration.flood import (
    GRPC_FLOOD,
    assert_answered_fast,
    probe_under_flood,
    server_process,
)

import brownout
from brownout import (
    Bulkhead,
    Classification,
    EdgePolicy,
    InboundDeadlinePolicy,
    Route,
    Stats,
    Trust,
)
from brownout.events import EventHub
from brownout.integrations.grpc_server import BrownoutServerInterceptor, GrpcCall
from brownout.limits import FixedLimit, LatencyEstimator
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


def _ident(b: bytes) -> bytes:
    return b


@dataclass
class Service:
    channel: grpc.aio.Channel
    stats: Stats
    cancelled: list[str]
    gate: asyncio.Event


def trust_internal(call: GrpcCall) -> Trust:
    token = dict(call.metadata).get("authorization")
    return Trust.TRUSTED if token == "Bearer internal" else Trust.UNTRUSTED


def build_server(hub: EventHub, cancelled: list[str], gate: asyncio.Event) -> grpc.aio.Server:
    async def echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        ctx = brownout.current()
        seen = {
            "remaining": ctx.remaining(),
            "priority": ctx.priority.label,
            "operation": ctx.operation,
            "caller": ctx.caller,
        }
        try:
            await asyncio.sleep(float(request or b"0"))
        except asyncio.CancelledError:
            cancelled.append("echo")
            raise
        return json.dumps(seen).encode()

    async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()
            if i == 0:
                await gate.wait()

    async def count_writer(request: bytes, context: Any) -> None:
        for i in range(int(request)):
            await context.write(str(i).encode())

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        async for r in requests:
            n += int(r)
        return str(n).encode()

    async def doubled(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            yield str(2 * int(r)).encode()

    def caller(call: GrpcCall, default: Classification) -> Classification:
        trusted = trust_internal(call) is Trust.TRUSTED
        return default._replace(caller="billing" if trusted else "anonymous")

    handlers = grpc.method_handlers_generic_handler(
        "test.Edge",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(
                echo, request_deserializer=_ident, response_serializer=_ident
            ),
            "Count": grpc.unary_stream_rpc_method_handler(
                count, request_deserializer=_ident, response_serializer=_ident
            ),
            "CountWriter": grpc.unary_stream_rpc_method_handler(
                count_writer, request_deserializer=_ident, response_serializer=_ident
            ),
            "Total": grpc.stream_unary_rpc_method_handler(
                total, request_deserializer=_ident, response_serializer=_ident
            ),
            "Doubled": grpc.stream_stream_rpc_method_handler(
                doubled, request_deserializer=_ident, response_serializer=_ident
            ),
        },
    )
    policy = EdgePolicy(
        bulkhead=Bulkhead(
            "grpc",
            FixedLimit(2),
            FifoQueue(max_size=1, max_wait=0.05),
            events=hub,
            estimator=LatencyEstimator(min_samples=1),
        ),
        deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),
        trust=trust_internal,
        classifier=caller,
        routes={"/test.Edge/Count": Route(maximum=1.0)},
        events=hub,
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers((handlers,))
    return server


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    hub = EventHub()
    stats = hub.subscribe(Stats())
    assert isinstance(stats, Stats)
    cancelled: list[str] = []
    gate = asyncio.Event()
    server = build_server(hub, cancelled, gate)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Service(channel, stats, cancelled, gate)
    finally:
        gate.set()
        await server.stop(None)


async def _echo(service: Service, hold: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    reply = await service.channel.unary_unary("/test.Edge/Echo")(str(hold).encode(), **kwargs)
    return dict(json.loads(reply))


async def test_client_timeout_is_the_handler_remaining_time(service: Service) -> None:
    seen = await _echo(service, timeout=1.5)
    # D1/D2: the caller's budget, not a fresh timeout. grpc core computes time_remaining()
    # against a cached clock that can lag real time by a few ms, overstating it slightly.
    assert 1.3 < seen["remaining"] <= 1.5 + 0.025
    assert seen["operation"] == "/test.Edge/Echo"
    clamped = await _echo(service, timeout=60)
    assert 4.5 < clamped["remaining"] <= 5.0  # D3: clamped to the maximum
    no_deadline = await _echo(service)
    assert 1.5 < no_deadline["remaining"] <= 2.0  # the policy default


async def test_priority_metadata_is_honoured_only_when_trusted(service: Service) -> None:
    forged = await _echo(service, metadata=(("brownout-priority", "sheddable"),))
    trusted = await _echo(
        service,
        metadata=(("brownout-priority", "sheddable"), ("authorization", "Bearer internal")),
    )
    assert forged["priority"] == "critical"  # S4
    assert forged["caller"] == "anonymous"
    assert trusted["priority"] == "sheddable"
    assert trusted["caller"] == "billing"


async def test_refusal_is_unavailable_with_pushback(service: Service) -> None:
    await _echo(service, 0.05)  # one success: the bulkhead has an estimate for Retry-After
    holders = [asyncio.create_task(_echo(service, 1.0)) for _ in range(2)]
    await asyncio.sleep(0.3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _echo(service)
    await asyncio.gather(*holders)
    err = info.value
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    trailers = dict(err.trailing_metadata() or ())
    assert trailers["brownout-reason"] in {"queue_timeout", "queue_full"}
    assert int(trailers["grpc-retry-pushback-ms"]) > 0  # S2: when to come back, jittered


async def test_expiry_is_deadline_exceeded_and_cancels_the_handler(service: Service) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _echo(service, 3.0, timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):
        if service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.cancelled == ["echo"]  # D5: the work stopped at the deadline


async def test_client_cancellation_cancels_the_handler_and_counts_abandoned(
    service: Service,
) -> None:
    call = service.channel.unary_unary("/test.Edge/Echo")(b"3")
    await asyncio.sleep(0.2)
    call.cancel()
    for _ in range(100):
        if service.cancelled:
            break
        await asyncio.sleep(0.02)
    assert service.cancelled == ["echo"]
    await asyncio.sleep(0.05)
    assert service.stats.count("abandoned") == 1
    assert service.stats.count("completed") == 0


async def test_streaming_methods_pass_through(service: Service) -> None:
    ch = service.channel
    stream = ch.unary_stream("/test.Edge/Count")(b"3")
    first = await asyncio.wait_for(stream.read(), 2.0)
    assert first == b"0"  # unbuffered: the first message arrives while the handler waits
    service.gate.set()
    assert [await stream.read(), await stream.read()] == [b"1", b"2"]
    assert await stream.read() is grpc.aio.EOF
    written = [m async for m in ch.unary_stream("/test.Edge/CountWriter")(b"3")]
    assert written == [b"0", b"1", b"2"]

    async def numbers() -> AsyncIterator[bytes]:
        for i in (1, 2, 3):
            yield str(i).encode()

    assert await ch.stream_unary("/test.Edge/Total")(numbers()) == b"6"
    assert [m async for m in ch.stream_stream("/test.Edge/Doubled")(numbers())] == [
        b"2",
        b"4",
        b"6",
    ]
    await asyncio.sleep(0.05)
    assert service.stats.count("completed") == 4


async def test_streaming_expiry_ends_the_stream_with_deadline_exceeded(service: Service) -> None:
    stream = service.channel.unary_stream("/test.Edge/Count")(b"3")  # route maximum 1 s
    assert await stream.read() == b"0"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_quota_refusal_is_resource_exhausted() -> None:
    @dataclass
    class Decision:
        allowed: bool = False
        retry_after: float | None = 1.0
        limit: int | None = None
        remaining: int | None = None
        reset: float | None = None

    async def quota(c: Classification) -> Decision:
        return Decision()

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    server = grpc.aio.server(
        interceptors=[BrownoutServerInterceptor(EdgePolicy(quota=quota, events=EventHub()))]
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Q",
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(
                        echo, request_deserializer=_ident, response_serializer=_ident
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ch.unary_unary("/test.Q/Echo")(b"x")
    finally:
        await server.stop(None)
    err = info.value
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.trailing_metadata() or ())
    assert trailers["brownout-reason"] == "quota"
    assert 1000 <= int(trailers["grpc-retry-pushback-ms"]) <= 1500


FLOOD_SERVER = """
import asyncio, sys
import grpc, grpc.aio
from brownout import Bulkhead
from brownout.queues import FifoQueue
from brownout.limits import FixedLimit
from brownout import EdgePolicy
from brownout.integrations.grpc_server import BrownoutServerInterceptor

async def work(request, context):
    await asyncio.sleep(0.5)  # holds capacity, leaves the CPU free
    return b"ok"

async def check(request, context):
    return b"\\x08\\x01"  # grpc.health.v1.HealthCheckResponse(status=SERVING)

def unary(fn):
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=None, response_serializer=None
    )

async def main():
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), FifoQueue(max_size=4, max_wait=0.1))
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("test.Flood", {"Work": unary(work)}),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": unary(check)}),
    ))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)

asyncio.run(main())
"""


async def test_health_check_is_answered_fast_under_a_10x_flood() -> None:
    """S7, as the ASGI edge: limit 4, 40 concurrent calls flooding in a closed loop,
    ``grpc.health.v1.Health/Check`` probed meanwhile (health methods are never admitted)."""
    async with server_process(FLOOD_SERVER) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            await check(b"", timeout=10)  # connected before the clock starts

            async def probe() -> None:
                assert await check(b"", timeout=5) == b"\x08\x01"

            counts, latencies = await probe_under_flood(GRPC_FLOOD, port, probe)
    assert counts.get("OK", 0) >= 8  # the limit kept serving
    assert counts.get("UNAVAILABLE", 0) > 5 * counts.get("OK", 0)  # a flood >= 10x capacity
    assert_answered_fast(latencies)
