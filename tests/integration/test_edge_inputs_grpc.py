"""Generated metadata and timeouts through the gRPC edge over loopback (D3, S2, S4).

A real grpcio client calls a real grpc.aio server running `BrownoutServerInterceptor`, with
generated call timeouts (none, spent, short, past the method's maximum) and metadata: budget,
signed-budget and priority keys with valid, near-valid and random values, repeated or not,
beside other keys (lower case and visible ASCII, as gRPC requires). For every trust level,
with and without a bulkhead and a listener, each call must end OK with the handler having
seen what `InboundDeadlinePolicy.resolve` gives the metadata and the call's own deadline (an
unsigned budget like the others, honoured where the trust level honours one), a priority
claim honoured only from a trusted source; or, when the deadline was too short to reach the
handler, end with DEADLINE_EXCEEDED. No bulkhead slot is left taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.edge_inputs import (
    CONFIGS,
    SLACK,
    Headers,
    edge_policy,
    examples,
    expected_budget,
    header_lists,
    judge_seen,
)
from tests.integration.servers import LoopThread

import brownout
from brownout import Priority, Reason, Trust
from brownout.integrations.grpc_server import BrownoutServerInterceptor
from brownout.wire import REFUSAL_REASON_KEY

pytestmark = pytest.mark.integration

METHOD = "/test.Inputs/Echo"
Case = tuple[float | None, Headers]
GRPC_TIMEOUT_ROUNDING = 0.1
"""grpc core rounds a call's timeout up on the wire (``grpc-timeout``), so the server's
``time_remaining()`` can exceed the client's ``timeout=``: seen here, 1.0 s arrived as 1.009 s,
12.3456 s as 12.3997 s and 60 s as 60.099 s. The edge takes the call's remaining time as it
arrives; the route maximum still caps it."""
Running = dict[tuple[Trust, bool, bool], tuple[Any, grpc.aio.Channel]]


async def start_servers(stack: contextlib.AsyncExitStack) -> Running:
    running: Running = {}
    for key in CONFIGS:
        policy = edge_policy(*key, template=METHOD)

        async def echo(request: bytes, context: Any) -> bytes:
            ctx = brownout.current()
            return json.dumps([ctx.remaining(), int(ctx.priority)]).encode()

        server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "test.Inputs", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stack.push_async_callback(server.stop, None)
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        running[key] = (policy, channel)
    return running


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LoopThread, Running]]:
    with LoopThread() as thread:
        yield thread, thread.run(start_servers(thread.stack))


async def run_cases(
    policy: Any, channel: grpc.aio.Channel, trust: Trust, cases: list[Case]
) -> None:
    call = channel.unary_unary(METHOD)
    for timeout, metadata in cases:
        sent = tuple((k.decode(), v.decode()) for k, v in metadata)
        rounding = 0.0
        if timeout is None:
            expected = expected_budget(policy, trust, metadata, METHOD)
        else:
            # The call's own deadline is an unsigned budget like the metadata's (issue 24).
            expected = expected_budget(policy, trust, metadata, METHOD, carried=timeout)
            rounding = GRPC_TIMEOUT_ROUNDING + timeout / 100
        try:
            # Without a timeout the call has no deadline of its own: wait_for keeps a hang
            # from stalling the suite.
            reply = await asyncio.wait_for(call(b"", metadata=sent, timeout=timeout), 30)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            trailers = dict(e.trailing_metadata() or ())
        else:
            remaining, priority = json.loads(reply)
            judge_seen(trust, metadata, expected, remaining, Priority(priority), rounding)
            continue
        # A deadline too short for the trip to the handler: the server's DEADLINE_EXCEEDED,
        # or the client's own timer; or, with a bulkhead, its latency estimate saying the
        # budget cannot cover the work (D7: on a slow machine the estimate of even this
        # trivial handler can exceed a budget of a few milliseconds), as the HTTP judge allows.
        assert expected < SLACK, (code, expected)
        too_short = (
            code is grpc.StatusCode.UNAVAILABLE
            and policy.bulkhead is not None
            and trailers.get(REFUSAL_REASON_KEY) == Reason.DEADLINE_TOO_SHORT.value
        )
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED or too_short, (code, trailers)
    bulkhead = policy.bulkhead
    if bulkhead is not None:
        for _ in range(100):  # settled just after the last message left
            if bulkhead.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert bulkhead.in_flight == 0


# gRPC keys are lower case, and ``grpc-*`` keys are the transport's own.
metadata_lists = header_lists(wire=True).map(
    lambda pairs: [(k.lower(), v) for k, v in pairs if not k.lower().startswith(b"grpc-")]
)
timeouts = st.one_of(
    st.none(),
    st.none(),
    st.floats(min_value=0.001, max_value=100.0),
    st.sampled_from([0.001, 1.0, 4.99, 5.0, 5.01, 60.0]),
)


@pytest.mark.parametrize("trust", list(Trust))
def test_the_grpc_edge_on_any_metadata_and_timeout(
    servers: tuple[LoopThread, Running], trust: Trust
) -> None:
    thread, running = servers

    @examples(120)
    @given(
        with_bulkhead=st.booleans(),
        listening=st.booleans(),
        cases=st.lists(st.tuples(timeouts, metadata_lists), min_size=1, max_size=8),
    )
    def any_metadata(with_bulkhead: bool, listening: bool, cases: list[Case]) -> None:
        policy, channel = running[trust, with_bulkhead, listening]
        thread.run(run_cases(policy, channel, trust, cases))

    any_metadata()
