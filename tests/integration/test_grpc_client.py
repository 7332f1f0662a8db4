"""`BrownoutClientInterceptor` on a real grpc.aio channel against a real grpc.aio server.

Generic handlers with bytes in and out (no protoc). Requirements: D3 (the budget travels as
``grpc-timeout``), D4 (refused before sending), D6 (unknown outcome for a sent mutation that
timed out), R1 (``grpc-retry-pushback-ms: -1`` is never retried), R2 (UNAVAILABLE retried;
FAILED_PRECONDITION and INVALID_ARGUMENT never), R5 (same key, growing attempt), pushback
honoured.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

import brownout
from brownout import (
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    Priority,
    Reason,
    Rejected,
    ResponseError,
    RetriesExhausted,
    RetryPolicy,
    StopReason,
    UnknownOutcome,
)
from brownout.integrations.grpc_client import brownout_interceptors

pytestmark = pytest.mark.integration

GRPC_CLOCK_SLACK = 0.025
"""Margin for what the server's ``context.time_remaining()`` reads beyond the budget sent.
Earlier sessions saw +0.6 ms and +8.7 ms and took it for grpc core's cached clock; it was
grpc's rounding of ``grpc-timeout`` up on the wire, which the interceptor now takes off
before sending (``test_the_callee_never_gets_more_time_than_the_caller_has``)."""

WIRE_SLACK = 0.002
"""What the server may still read beyond the caller's remaining time once the interceptor has
taken grpc's rounding off: its clock read, not its rounding (which is 9 ms at 1 s)."""

ECHO = "/test.Client/Echo"
READ = "/test.Client/Read"


@dataclass
class Seen:
    calls: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    script: list[tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]] = field(default_factory=list)
    delay: float = 0.0


def _ident(b: bytes) -> bytes:
    return b


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        seen.times.append(time.monotonic())
        md = {k: v for k, v in context.invocation_metadata() or ()}
        md["time_remaining"] = context.time_remaining()
        seen.calls.append(md)
        if seen.delay:
            await asyncio.sleep(seen.delay)
        if seen.script:
            code, trailers = seen.script.pop(0)
            await context.abort(code, code.name, trailing_metadata=trailers)
        return request

    async def numbers(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        md = {k: v for k, v in context.invocation_metadata() or ()}
        md["time_remaining"] = context.time_remaining()
        seen.calls.append(md)
        for i in range(3):
            yield str(i).encode()

    handlers = grpc.method_handlers_generic_handler(
        "test.Client",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo, _ident, _ident),
            "Read": grpc.unary_unary_rpc_method_handler(echo, _ident, _ident),
            "Numbers": grpc.unary_stream_rpc_method_handler(numbers, _ident, _ident),
        },
    )
    srv = grpc.aio.server()
    srv.add_generic_rpc_handlers((handlers,))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await srv.stop(0)


def fast_retries(attempts: int = 3, **kw: Any) -> RetryPolicy:
    return RetryPolicy(attempts, backoff=ExponentialBackoff(0.001, cap=0.005), **kw)


def channel(target: str, dep: Dependency) -> grpc.aio.Channel:
    interceptors = brownout_interceptors(dep, idempotent_methods={READ})
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


async def test_budget_is_the_call_timeout_and_metadata_travels(server: tuple[str, Seen]) -> None:
    target, seen = server
    async with channel(target, Dependency("svc", timeout=1.0, reserve=0.1)) as ch:
        echo = ch.unary_unary(ECHO)
        read = ch.unary_unary(READ)
        async with brownout.request(deadline=0.5, priority=Priority.SHEDDABLE):
            assert await echo(b"hi") == b"hi"
            call = read(b"r")
            assert await call == b"r"
            assert await call.code() is grpc.StatusCode.OK
    mutation, query = seen.calls
    # min(1.0, 0.5 - 0.1) as grpc-timeout (D3); grpc core's cached clock can overstate a little
    assert 0.1 < mutation["time_remaining"] <= 0.4 + GRPC_CLOCK_SLACK
    assert mutation["brownout-priority"] == "sheddable"
    assert mutation["idempotency-key"]  # a mutation is keyed
    assert "idempotency-key" not in query and "brownout-attempt" not in query


async def test_refuses_before_sending(server: tuple[str, Seen]) -> None:
    target, seen = server
    dep = Dependency("svc", timeout=1.0, reserve=0.02, min_useful=0.2)
    async with channel(target, dep) as ch, brownout.deadline(0.1):
        with pytest.raises(Rejected) as info:
            await ch.unary_unary(READ)(b"x")
        with pytest.raises(Rejected):
            async for _ in ch.unary_stream("/test.Client/Numbers")(b"x"):
                pass
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    assert seen.calls == []


async def test_unavailable_is_retried_with_pushback_same_key_growing_attempt(
    server: tuple[str, Seen],
) -> None:
    target, seen = server
    seen.script = [
        (grpc.StatusCode.UNAVAILABLE, (("grpc-retry-pushback-ms", "1000"),)),
        (grpc.StatusCode.UNAVAILABLE, ()),
    ]
    async with channel(target, Dependency("svc", retry=fast_retries(3))) as ch:
        reply = await ch.unary_unary(ECHO)(b"pay", metadata=(("idempotency-key", "k-7"),))
    assert reply == b"pay"
    assert [c.get("brownout-attempt", "1") for c in seen.calls] == ["1", "2", "3"]
    assert {c["idempotency-key"] for c in seen.calls} == {"k-7"}
    assert seen.times[1] - seen.times[0] >= 0.95  # pushback honoured


async def test_negative_pushback_is_never_retried(server: tuple[str, Seen]) -> None:
    target, seen = server
    seen.script = [(grpc.StatusCode.UNAVAILABLE, (("grpc-retry-pushback-ms", "-1"),))] * 3
    async with channel(target, Dependency("svc", retry=fast_retries(3))) as ch:
        with pytest.raises(RetriesExhausted) as info:
            await ch.unary_unary(READ)(b"x")
    assert len(seen.calls) == 1
    assert info.value.stopped_by is StopReason.DO_NOT_RETRY


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT]
)
async def test_non_retryable_codes_raise_the_grpc_error_unretried(
    server: tuple[str, Seen], code: grpc.StatusCode
) -> None:
    target, seen = server
    seen.script = [(code, ())] * 3
    async with channel(target, Dependency("svc", retry=fast_retries(3))) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ch.unary_unary(READ)(b"x")
    assert info.value.code() is code
    assert len(seen.calls) == 1


async def test_giving_up_on_unavailable_raises_retries_exhausted(
    server: tuple[str, Seen],
) -> None:
    target, seen = server
    seen.script = [(grpc.StatusCode.UNAVAILABLE, ())] * 4
    async with channel(target, Dependency("svc", retry=fast_retries(3))) as ch:
        with pytest.raises(RetriesExhausted) as info:
            await ch.unary_unary(READ)(b"x")
        assert info.value.attempts == 3
        assert isinstance(info.value.response, grpc.aio.AioRpcError)
    async with channel(target, Dependency("no-retries")) as ch:  # not a retry layer
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await ch.unary_unary(READ)(b"x")
    assert plain.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(seen.calls) == 4


async def test_sent_mutation_that_times_out_is_an_unknown_outcome(
    server: tuple[str, Seen],
) -> None:
    target, seen = server
    seen.delay = 2.0
    ledger = InMemoryOutcomeLedger()
    dep = Dependency("slow", timeout=0.2, retry=fast_retries(2), ledger=ledger)
    started = time.monotonic()
    async with channel(target, dep) as ch:
        with pytest.raises(UnknownOutcome) as info:
            await ch.unary_unary(ECHO)(json.dumps({"amount": 5}).encode())
    assert time.monotonic() - started < 1.5
    key = info.value.idempotency_key
    assert key is not None
    assert [c["idempotency-key"] for c in seen.calls] == [key, key]
    assert [r.key for r in await ledger.pending()] == [key]


@pytest.mark.parametrize("budget", [0.3, 0.999, 1.2345, 5.5, 9.999, 12.3456, 60.5, 100.5])
async def test_the_callee_never_gets_more_time_than_the_caller_has(
    server: tuple[str, Seen], budget: float
) -> None:
    """D1 over gRPC: grpc core rounds ``grpc-timeout`` up when it writes it (a 1.0 s timeout
    arrives as 1.009 s, 60 s as 60.099 s); the interceptor takes that step off first, so the
    callee's remaining time is never more than the caller's, and at most a step (~1%) less."""
    target, seen = server
    async with channel(target, Dependency("svc")) as ch:
        async with brownout.request(deadline=budget):
            assert await ch.unary_unary(READ)(b"x") == b"x"
    got = seen.calls[0]["time_remaining"]
    assert got <= budget + WIRE_SLACK
    assert got > budget * 0.98 - 0.1  # generous: the trip itself takes time


async def test_streaming_call_gets_budget_and_metadata(server: tuple[str, Seen]) -> None:
    target, seen = server
    async with channel(target, Dependency("svc", timeout=0.8)) as ch:
        async with brownout.request(deadline=5.0, priority=Priority.SHEDDABLE_PLUS):
            got = [m async for m in ch.unary_stream("/test.Client/Numbers")(b"x")]
    assert got == [b"0", b"1", b"2"]
    assert 0.3 < seen.calls[0]["time_remaining"] <= 0.8 + GRPC_CLOCK_SLACK
    assert seen.calls[0]["brownout-priority"] == "sheddable_plus"


@pytest.mark.parametrize("deadline", [0.4, 1.2345])
async def test_a_call_cut_at_its_deadline_raises_deadline_exceeded(
    server: tuple[str, Seen], deadline: float
) -> None:
    """The timeout sent is one rounding step shorter than the attempt's budget (so that the
    callee never gets more time, above), so grpc's own DEADLINE_EXCEEDED arrives just before
    the deadline scope would fire: it is the same expiry and raises the same
    `brownout.DeadlineExceeded` the HTTP clients raise (an edge above answers 504)."""
    target, seen = server
    seen.delay = 5.0
    async with channel(target, Dependency("svc")) as ch:
        with pytest.raises(brownout.DeadlineExceeded):
            async with brownout.request(deadline=deadline):
                await ch.unary_unary(READ)(b"x")


_DYING_SERVER = """
import asyncio, sys
import grpc, grpc.aio

async def echo(request, context):
    print("called", flush=True)
    await asyncio.sleep(60)  # killed in here: the call may have been applied
    return request

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Client", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.mark.parametrize("keyed", [True, False])
async def test_a_server_dying_mid_call_leaves_a_mutation_unknown_not_refused(keyed: bool) -> None:
    """grpc reports a connection lost mid-call as UNAVAILABLE ("Stream removed"), the code a
    refusal uses. It was read as "refused, not run": an unkeyed mutation was resent (R2), and
    a keyed one whose later attempts found nobody listening ended as RetriesExhausted, so its
    possibly-applied first attempt never reached the ledger (D6)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DYING_SERVER, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        ledger = InMemoryOutcomeLedger()
        dep = Dependency(
            "dying", retry=fast_retries(3, idempotency_keys=keyed), ledger=ledger, timeout=20.0
        )
        async with channel(f"127.0.0.1:{port}", dep) as ch:
            call = asyncio.ensure_future(ch.unary_unary(ECHO)(b"pay 5"))
            assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"called\n"
            proc.kill()
            with pytest.raises(UnknownOutcome) as info:
                await asyncio.wait_for(call, 30)
        cause = info.value.__cause__
        assert isinstance(cause, ResponseError) and cause.grpc_code == "UNAVAILABLE"
        if keyed:
            assert info.value.idempotency_key is not None
            assert [r.key for r in await ledger.pending()] == [info.value.idempotency_key]
        else:
            assert info.value.idempotency_key is None
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_call_that_never_connects_is_retried_even_as_a_mutation() -> None:
    """The other side of the same rule: grpc's "failed to connect" never left the client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    dep = Dependency("nobody", retry=fast_retries(3, idempotency_keys=False))
    async with channel(f"127.0.0.1:{port}", dep) as ch:
        with pytest.raises(RetriesExhausted) as info:
            await ch.unary_unary(ECHO)(b"pay 5")
    assert info.value.attempts == 3
