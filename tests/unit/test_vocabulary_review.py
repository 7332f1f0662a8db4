"""Review of the vocabulary (deadline, context, propagation): defects found and fixed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import brownout
from brownout import BudgetSigner, Deadline, HeaderError, ManualClock, call_budget
from brownout.context import attach
from brownout.propagation import (
    BUDGET_HEADER,
    SIGNED_BUDGET_HEADER,
    decode_budget_ms,
    decode_grpc_timeout,
    encode_budget_ms,
    encode_grpc_timeout,
    outbound_headers,
)

# -- bind: one snapshot, entered afresh by every call -----------------------------------------


def test_bound_callable_runs_in_several_workers_at_once() -> None:
    barrier = threading.Barrier(2, timeout=5)

    def lookup() -> str:
        barrier.wait()  # both calls are inside the bound context at the same time
        return brownout.current().caller

    with brownout.request(caller="reports"):
        bound = brownout.bind(lookup)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(bound) for _ in range(2)]
        assert [f.result() for f in futures] == ["reports", "reports"]


def test_bound_callable_may_reenter_itself() -> None:
    def walk(depth: int) -> int:
        return depth if depth == 0 else bound(depth - 1)

    bound = brownout.bind(walk)
    assert bound(2) == 0


def test_bound_callable_does_not_leak_context_between_calls() -> None:
    def job() -> str:
        seen = brownout.current().caller
        attach(brownout.current().replace(caller="leaked"))  # a careless job, never detached
        return seen

    with brownout.request(caller="alice"):
        bound = brownout.bind(job)
    assert bound() == "alice"
    assert bound() == "alice"


# -- a scope never extends a deadline, whatever the clocks --------------------------------------


def test_scope_with_a_foreign_clock_deadline_does_not_extend_the_outer_one() -> None:
    manual = ManualClock(0.0)  # its instants are tiny next to the loop/monotonic clock's
    with brownout.deadline(1.0):
        with brownout.deadline(Deadline.after(100.0, clock=manual)):
            left = brownout.remaining()
            assert left is not None and left <= 1.0


def test_numeric_scope_shortens_a_foreign_clock_deadline() -> None:
    manual = ManualClock(0.0)
    with brownout.deadline(Deadline.after(100.0, clock=manual)):
        with brownout.deadline(5.0):
            left = brownout.remaining()
            assert left is not None and left <= 5.0
    # and one far in a foreign clock's future, but with little left, is kept
    late = ManualClock(1e12)
    with brownout.deadline(Deadline.after(0.5, clock=late)):
        with brownout.deadline(5.0):
            left = brownout.remaining()
            assert left is not None and left <= 0.5


def test_replace_keeps_the_earlier_deadline_across_clocks() -> None:
    manual = ManualClock(0.0)
    ctx = brownout.RequestContext(deadline=Deadline.after(1.0))
    longer = ctx.replace(deadline=Deadline.after(100.0, clock=manual))
    assert longer.deadline is ctx.deadline


@pytest.mark.looptime
@pytest.mark.parametrize(
    ("origin", "foreign", "expected"),
    [(-1000.0, 100.0, 2.0), (1e6, 0.5, 0.5)],  # foreign instants below / above the loop's
)
async def test_async_scope_keeps_the_earlier_of_loop_and_foreign_deadlines(
    origin: float, foreign: float, expected: float
) -> None:
    manual = ManualClock(origin)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(brownout.DeadlineExceeded):
        async with brownout.deadline(Deadline.after(foreign, clock=manual)):
            async with brownout.deadline(2.0):
                assert brownout.remaining() == pytest.approx(expected)
                await asyncio.sleep(50)
    assert loop.time() - start == pytest.approx(expected)


# -- encoders: huge and infinite durations are capped, never OverflowError --------------------


@pytest.mark.parametrize("seconds", [math.inf, 1e308, 1e300, 1e12])
def test_encoders_cap_huge_durations(seconds: float) -> None:
    assert encode_budget_ms(seconds) == "999999999999"
    assert encode_grpc_timeout(seconds) == "99999999H"
    signer = BudgetSigner({"k1": b"0123456789abcdef"})
    assert signer.verify(signer.sign(seconds)) == 999_999_999.999


def test_outbound_headers_under_an_infinite_deadline() -> None:
    with brownout.deadline(math.inf):
        assert outbound_headers()[BUDGET_HEADER] == "999999999999"


@given(st.floats(allow_nan=False))
def test_encoders_never_raise_and_never_extend(seconds: float) -> None:
    ms = encode_budget_ms(seconds)
    grpc = encode_grpc_timeout(seconds)
    assert decode_budget_ms(ms) <= max(seconds, 0.0) + 1e-6
    assert decode_grpc_timeout(grpc) <= max(seconds, 0.0) * (1 + 1e-9) + 1e-9


# -- reserve: kept back, never added -----------------------------------------------------------


@pytest.mark.parametrize("reserve", [-5.0, math.nan, -math.inf])
def test_call_budget_never_outlives_the_deadline(reserve: float) -> None:
    clock = ManualClock(0.0)
    d = Deadline.after(1.0, clock=clock)
    budget = call_budget(30.0, reserve=reserve, deadline=d)
    assert budget == 1.0


@pytest.mark.parametrize("reserve", [-5.0, math.nan])
def test_outbound_budget_never_exceeds_what_is_left(reserve: float) -> None:
    ctx = brownout.RequestContext(deadline=Deadline.after(1.0, clock=ManualClock(0.0)))
    assert outbound_headers(ctx=ctx, reserve=reserve)[BUDGET_HEADER] == "1000"


# -- signed budgets: a NaN skew tolerance must not disable the replay bound -------------------


@pytest.mark.parametrize("skew", [math.nan, -1.0])
def test_signer_refuses_a_meaningless_skew_tolerance(skew: float) -> None:
    with pytest.raises(ValueError, match="skew_tolerance"):
        BudgetSigner({"k1": b"0123456789abcdef"}, skew_tolerance=skew)


def test_signed_budget_replayed_late_is_refused() -> None:
    wall = [1000.0]
    signer = BudgetSigner({"k1": b"0123456789abcdef"}, wall_clock=lambda: wall[0])
    value = signer.sign(7.5)
    wall[0] += 3600.0
    with pytest.raises(HeaderError):
        signer.verify(value)
    policy = brownout.InboundDeadlinePolicy(default=2.0, maximum=30.0, signer=signer)
    got = policy.resolve({SIGNED_BUDGET_HEADER: value}.get, brownout.Trust.SIGNED)
    assert got.seconds == 2.0 and got.origin == "default"
