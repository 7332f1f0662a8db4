"""The gRPC edge's express path and `EdgePolicy.serve` give the same answers and counts (O1).

As ``tests/unit/test_edge_paths_agree.py`` does for the ASGI middleware, over loopback: a real
grpc.aio server with `BrownoutServerInterceptor` and a real grpcio client. For every way a
method can end (an answer, a status set or aborted with, an exception, a refusal from a
dependency, an unknown outcome, expiry before and after a stream started, a client that
cancels, a handler that swallows that cancellation, a stream, a degraded mode's fallback), a
call without brownout metadata (the express path) and the same call with a priority claim
from an untrusted source (`serve`, which ignores it) must end with the same status and
``brownout-reason``, count the same lifecycle events with the same reasons, teach the adaptive
limit the same samples and free the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.outcomes import LONG, SHORT, Observed, observed

from brownout import (
    EdgePolicy,
    Reason,
    Rejected,
    Route,
    UnknownOutcome,
)
from brownout.integrations.grpc_server import BrownoutServerInterceptor

pytestmark = pytest.mark.integration

UNARY = [
    "ok",
    "aborts_internal",
    "sets_internal",
    "aborts_not_found",
    "raises",
    "rejected",
    "unknown",
    "expires",
    "cancels",
    "swallows_cancel",
    "fallback",
]
STREAMING = ["stream", "expires_mid_stream"]


async def start(stack: Any) -> tuple[grpc.aio.Channel, Observed]:
    o = observed("rpc", personal=b"personal", default=b"default")
    cancelled = o.cancelled

    async def unary(request: bytes, context: Any) -> bytes:
        outcome = request.decode()
        try:
            return await respond(outcome, context)
        except asyncio.CancelledError:
            cancelled.append(outcome)
            if outcome == "swallows_cancel":
                return b"answered anyway"
            raise

    async def respond(outcome: str, context: Any) -> bytes:
        if outcome == "ok":
            return b"ok"
        if outcome == "aborts_internal":
            await context.abort(grpc.StatusCode.INTERNAL, "broken")
        if outcome == "sets_internal":
            context.set_code(grpc.StatusCode.INTERNAL)
            return b""
        if outcome == "aborts_not_found":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        if outcome == "raises":
            raise RuntimeError("boom")
        if outcome == "rejected":
            raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")
        if outcome == "unknown":
            raise UnknownOutcome("key-1")
        if outcome in ("expires", "cancels", "swallows_cancel"):
            await asyncio.sleep(5)
        if outcome == "fallback":
            return await o.recommendations()  # type: ignore[no-any-return]
        raise AssertionError(outcome)

    async def streaming(request: bytes, context: Any) -> AsyncIterator[bytes]:
        outcome = request.decode()
        yield b"first"
        if outcome == "expires_mid_stream":
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                cancelled.append(outcome)
                raise
        yield b"second"

    def handlers(service: str) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            service,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.unary_stream_rpc_method_handler(streaming),
            },
        )

    policy = EdgePolicy(
        bulkhead=o.bulkhead,
        routes={
            "/test.Short/Unary": Route(default=SHORT, maximum=SHORT),
            "/test.Short/Stream": Route(default=SHORT, maximum=SHORT),
            "/test.Long/Unary": Route(default=LONG, maximum=LONG),
            "/test.Long/Stream": Route(default=LONG, maximum=LONG),
        },
        degraded=o.modes,
        sweep_period=0.02,
        events=o.hub,
    )
    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
    server.add_generic_rpc_handlers((handlers("test.Short"), handlers("test.Long")))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, None)
    channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    return channel, o


async def call(channel: grpc.aio.Channel, outcome: str, metadata: tuple[Any, ...]) -> Any:
    service = "test.Short" if outcome.startswith("expires") else "test.Long"
    got: list[bytes] = []
    try:
        if outcome in STREAMING:
            stream = channel.unary_stream(f"/{service}/Stream")(outcome.encode(), metadata=metadata)
            async for message in stream:
                got.append(message)
            rpc: Any = stream
        else:
            rpc = channel.unary_unary(f"/{service}/Unary")(outcome.encode(), metadata=metadata)
            if outcome in ("cancels", "swallows_cancel"):
                await asyncio.sleep(0.2)
                rpc.cancel()
            got.append(await rpc)
    except asyncio.CancelledError:
        return "cancelled by the client", None, got
    except grpc.aio.AioRpcError as e:
        trailers = dict(e.trailing_metadata() or ())
        return e.code(), trailers.get("brownout-reason"), got
    trailers = dict(await rpc.trailing_metadata() or ())
    return await rpc.code(), trailers.get("brownout-degraded"), got


@pytest.mark.parametrize("outcome", UNARY + STREAMING)
async def test_express_and_serve_agree_on_grpc(outcome: str) -> None:
    seen = {}
    for path_taken, metadata in (("express", ()), ("serve", (("brownout-priority", "sheddable"),))):
        async with contextlib.AsyncExitStack() as stack:
            channel, o = await start(stack)
            answer = await call(channel, outcome, metadata)
            await asyncio.sleep(0.1)  # anything the edge settles after the last message
            assert o.bulkhead.express == (1 if path_taken == "express" else 0), path_taken
            assert o.bulkhead.in_flight == 0, path_taken
            seen[path_taken] = (answer, o.seen())
    assert seen["express"] == seen["serve"]
