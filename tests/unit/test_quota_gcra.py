"""GCRA, the pure algorithm, on virtual time (S2, F1): the rate x t + burst bound, exact
retry-after, and the remaining/reset figures the RateLimit headers report."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout._quota import GcraPolicy, decide


def test_a_fresh_key_gets_its_whole_burst_then_waits_one_interval() -> None:
    policy = GcraPolicy(rate=10.0, burst=5)
    tat = None
    for expected_remaining in (4, 3, 2, 1, 0):
        out = decide(policy, tat, now=100.0)
        assert out.allowed
        assert out.remaining == expected_remaining
        tat = out.tat
    refused = decide(policy, tat, now=100.0)
    assert not refused.allowed
    assert refused.retry_after == pytest.approx(0.1)
    assert refused.remaining == 0
    assert refused.reset == pytest.approx(0.5)  # five units drain at 10/s
    assert refused.tat == tat  # a refusal does not consume
    assert decide(policy, tat, now=100.0 + refused.retry_after).allowed


def test_the_steady_rate_is_the_configured_rate() -> None:
    policy = GcraPolicy(rate=4.0, burst=1)
    tat = None
    admitted = 0
    for step in range(400):  # offered at 8/s for 50 s
        out = decide(policy, tat, now=step / 8)
        if out.allowed:
            admitted += 1
            tat = out.tat
    assert admitted == 200


def test_cost_weighs_a_request() -> None:
    policy = GcraPolicy(rate=1.0, burst=10)
    out = decide(policy, None, now=0.0, cost=7)
    assert out.allowed
    assert out.remaining == 3
    refused = decide(policy, out.tat, now=0.0, cost=4)
    assert not refused.allowed
    assert refused.remaining == 3
    assert refused.retry_after == pytest.approx(1.0)


def test_a_key_idle_long_enough_is_like_a_new_key() -> None:
    policy = GcraPolicy(rate=2.0, burst=3)
    out = decide(policy, None, now=0.0, cost=3)
    assert decide(policy, out.tat, now=out.tat).remaining == decide(policy, None, 5.0).remaining


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (math.inf, 1), (1.0, 0)])
def test_invalid_policies_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        GcraPolicy(rate, burst)


def test_impossible_costs_are_an_error_not_a_silent_refusal() -> None:
    policy = GcraPolicy(rate=1.0, burst=2)
    with pytest.raises(ValueError):
        decide(policy, None, 0.0, cost=3)
    with pytest.raises(ValueError):
        decide(policy, None, 0.0, cost=0)


def test_scaled_policy_divides_rate_and_burst_among_instances() -> None:
    assert GcraPolicy(100.0, 20).scaled(4) == GcraPolicy(25.0, 5)
    assert GcraPolicy(1.0, 2).scaled(4) == GcraPolicy(0.25, 1)  # never below one unit


arrivals = st.lists(
    st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.integers(1, 3)), min_size=1, max_size=120
)


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(0.5, 200.0, allow_nan=False),
    burst=st.integers(3, 30),
    gaps=arrivals,
    start=st.sampled_from([0.0, 12_345.678, 1.7e9]),  # loop time, or epoch-sized server time
)
@example(rate=193.828125, burst=3, gaps=[(0.0, 1), (0.0, 1), (0.0, 1), (1.0, 1)], start=1.7e9)
@example(  # the fifth admitted 3.4 us early: decide's round-off slack at 1.7e9
    rate=155.0,
    burst=3,
    gaps=[(0.0, 1), (0.0, 1), (0.0, 1), (1.9994705827081831, 1), (0.0, 1)],
    start=1.7e9,
)
def test_never_admits_more_than_rate_times_t_plus_burst(
    rate: float, burst: int, gaps: list[tuple[float, int]], start: float
) -> None:
    """Over ANY interval [a, b], admitted units <= rate * (b - a) + burst (S2, F1)."""
    policy = GcraPolicy(rate, burst)
    tat = None
    now = start
    admitted: list[tuple[float, int]] = []
    for gap, cost in gaps:
        now += gap / rate  # gaps scaled to the rate so bursts and idles both happen
        out = decide(policy, tat, now, cost)
        if out.allowed:
            tat = out.tat
            admitted.append((now, cost))
    # Arrival times near an epoch-sized start are rounded to its float spacing (2.4e-7 s at
    # 1.7e9), and `decide` treats a request due within its own round-off slack as due now
    # (interval * 1e-6 + |time| * 2e-15: 3.4 us at 1.7e9); the check allows both, scaled by
    # the rate, and nothing more.
    decide_slack = (1.0 / rate) * 1e-6 + abs(start + 10.0) * 2e-15
    slack = 1e-5 + (4 * math.ulp(start) + decide_slack) * rate
    for i, (first, _) in enumerate(admitted):
        total = 0
        for end, cost in admitted[i:]:
            total += cost
            assert total <= rate * (end - first) + burst + slack


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(0.5, 200.0, allow_nan=False),
    burst=st.integers(1, 30),
    gaps=arrivals,
)
def test_retry_after_is_exact_and_remaining_is_honest(
    rate: float, burst: int, gaps: list[tuple[float, int]]
) -> None:
    """A refused request is allowed exactly at now + retry_after, not before; ``remaining``
    unit requests are allowed right now."""
    policy = GcraPolicy(rate, burst)
    tat = None
    now = 0.0
    for gap, cost in gaps:
        cost = min(cost, burst)
        now += gap / rate
        out = decide(policy, tat, now, cost)
        if out.allowed:
            assert out.retry_after == 0
            tat = out.tat
            continue
        assert out.retry_after > 0
        assert out.remaining < cost
        assert decide(policy, tat, now + out.retry_after * (1 + 1e-9) + 1e-9, cost).allowed
        early = 1e-4 / rate
        if out.retry_after > early:
            assert not decide(policy, tat, now + out.retry_after - early, cost).allowed
    probe = tat
    for _ in range(decide(policy, tat, now).remaining):
        unit = decide(policy, probe, now)
        assert unit.allowed
        probe = unit.tat
