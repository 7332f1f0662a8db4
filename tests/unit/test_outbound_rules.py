"""The rules the client adapters share (`brownout._retry.outbound`), and the gRPC streaming
path's budget against the unary path's."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Generator
from typing import Any

import grpc
import grpc.aio
import pytest

import brownout
from brownout import Dependency, Reason, Rejected
from brownout._retry.classify import ResponseError, RetriesExhausted, StopReason, TransientError
from brownout._retry.outbound import (
    ATTEMPT_EDGE,
    SAFE_METHODS,
    answer_for_caller,
    attempt_budget,
    http_answer_error,
    is_idempotent,
    needs_retry_layer,
)
from brownout.integrations.grpc_client import (
    BrownoutClientInterceptor,
    BrownoutUnaryStreamInterceptor,
)
from brownout.testing import ManualClock


def test_the_http_rules() -> None:
    assert {"GET", "HEAD", "OPTIONS", "TRACE"} == SAFE_METHODS
    assert is_idempotent("GET", SAFE_METHODS) and not is_idempotent("POST", SAFE_METHODS)
    assert is_idempotent("POST", SAFE_METHODS, True) and not is_idempotent("GET", (), None)
    assert [s for s in (200, 404, 409, 429, 500, 503, 599) if needs_retry_layer(s)] == [
        429,
        500,
        503,
        599,
    ]
    error = http_answer_error(503, {"retry-after": "2"}, "body")
    assert (error.status, error.retry_after, error.do_not_retry) == (503, 2.0, False)
    assert error.response == "body"
    assert http_answer_error(503, {"brownout-retry": "never"}, None).do_not_retry


def test_what_the_caller_gets_back() -> None:
    answer = ResponseError(500, response="resp")
    assert answer_for_caller(answer, str) == "resp"
    assert answer_for_caller(answer, bytes) is None  # not the framework's: re-raise
    gave_up = RetriesExhausted(
        ResponseError(503, response="last"), attempts=3, stopped_by=StopReason.ATTEMPTS
    )
    assert answer_for_caller(gave_up, str) is None
    assert answer_for_caller(gave_up, str, return_exhausted=True) == "last"
    lost = TransientError("lost", sent=True)
    lost.__cause__ = KeyError("x")
    assert isinstance(answer_for_caller(lost, KeyError), KeyError)
    assert answer_for_caller(ValueError(), object) is None


def test_attempt_budget() -> None:
    assert attempt_budget(None, reserve=0.0, min_useful=0.0, deadline=None) is None
    assert attempt_budget(0.5, reserve=0.0, min_useful=0.0, deadline=None) == 0.5
    clock = ManualClock()
    d = brownout.Deadline(1.0, clock=clock)
    assert attempt_budget(None, reserve=0.0, min_useful=0.0, deadline=d) == 1.0 - ATTEMPT_EDGE
    assert attempt_budget(0.3, reserve=0.1, min_useful=0.0, deadline=d) == 0.3
    assert attempt_budget(None, reserve=0.1, min_useful=0.0, deadline=d) == pytest.approx(0.9)
    with pytest.raises(Rejected) as refused:
        attempt_budget(None, reserve=0.1, min_useful=0.95, deadline=d)
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT


class _Call:
    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.sleep(0).__await__()


@pytest.mark.looptime
@pytest.mark.parametrize(
    ("timeout", "reserve", "deadline"),
    [(None, 0.0, 1.0), (None, 0.05, 1.0), (0.2, 0.0, 1.0), (5.0, 0.0005, 2.0), (0.5, 0.0, None)],
)
async def test_streaming_gets_the_same_timeout_as_unary(
    timeout: float | None, reserve: float, deadline: float | None
) -> None:
    # The streaming path computed its own budget (the reserve without unary's 1 ms floor):
    # the same context gave a stream a longer grpc-timeout than a unary call.
    dep = Dependency("backend", timeout=timeout, reserve=reserve)
    sent: dict[str, float | None] = {}

    def continuation(kind: str) -> Any:
        async def go(details: grpc.aio.ClientCallDetails, request: Any) -> Any:
            sent[kind] = details.timeout
            return _Call()

        return go

    details = grpc.aio.ClientCallDetails("/svc/M", None, None, None, None)
    async with brownout.deadline(deadline):
        await BrownoutClientInterceptor(dep).intercept_unary_unary(
            continuation("unary"), details, b""
        )
        await BrownoutUnaryStreamInterceptor(dep).intercept_unary_stream(
            continuation("stream"), details, b""
        )
    if timeout is None and deadline is None:
        assert sent == {"unary": None, "stream": None}
    else:
        unary, stream = sent["unary"], sent["stream"]
        assert unary is not None and stream is not None and not math.isnan(unary)
        # Virtual time stands still between the two calls: any gap is the old floor bug.
        assert stream == pytest.approx(unary, abs=1e-9)
