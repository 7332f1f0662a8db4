"""Retry budgets (R3): the Finagle-style sliding-window budget and gRPC retryThrottling (A6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import GrpcRetryThrottle, RetryBudget
from brownout.testing import ManualClock


def test_reserve_alone_allows_min_per_second_times_window() -> None:
    clock = ManualClock()
    b = RetryBudget(ratio=0.1, min_per_second=2, window=10.0, clock=clock)
    granted = sum(b.try_acquire_retry() for _ in range(100))
    assert granted == 20


@pytest.mark.parametrize(
    ("min_per_second", "window", "reserve"),
    # 0.29 * 100 is 28.999999999999996 in floats, 2.05 * 60 is 122.99999999999999
    [(0.29, 100.0, 29), (0.57, 100.0, 57), (2.05, 60.0, 123), (0.5, 3.0, 1)],
)
def test_the_reserve_is_min_per_second_times_window_despite_float_rounding(
    min_per_second: float, window: float, reserve: int
) -> None:
    b = RetryBudget(ratio=0.0, min_per_second=min_per_second, window=window, clock=ManualClock())
    assert b.available() == reserve
    assert sum(b.try_acquire_retry() for _ in range(200)) == reserve


def test_originals_deposit_ratio_of_a_retry_each() -> None:
    clock = ManualClock()
    b = RetryBudget(ratio=0.1, min_per_second=0, window=10.0, clock=clock)
    for _ in range(100):
        b.record_request()
    assert b.available() == 10
    assert sum(b.try_acquire_retry() for _ in range(50)) == 10
    assert not b.try_acquire_retry()


def test_tokens_come_back_when_the_window_slides() -> None:
    clock = ManualClock()
    b = RetryBudget(ratio=0.5, min_per_second=0, window=10.0, buckets=10, clock=clock)
    for _ in range(10):
        b.record_request()
    assert sum(b.try_acquire_retry() for _ in range(10)) == 5
    clock.advance(5.0)
    for _ in range(10):
        b.record_request()
    assert sum(b.try_acquire_retry() for _ in range(10)) == 5
    clock.advance(5.0)  # the first slice (10 originals, 5 retries) left the window
    assert b.available() == 0
    clock.advance(5.0)  # everything left: empty
    assert b.available() == 0
    for _ in range(4):
        b.record_request()
    assert b.available() == 2


def test_zero_ratio_means_only_the_minimum() -> None:
    clock = ManualClock()
    b = RetryBudget(ratio=0.0, min_per_second=1, window=5.0, clock=clock)
    for _ in range(1000):
        b.record_request()
    assert sum(b.try_acquire_retry() for _ in range(100)) == 5


def test_steady_state_load_is_bounded_by_one_plus_ratio() -> None:
    """100 originals/s, every one failing and wanting 2 retries: the budget lets through
    ratio x originals + the minimum, so the dependency sees <= (1 + ratio) x r + min."""
    clock = ManualClock()
    b = RetryBudget(ratio=0.1, min_per_second=1, window=10.0, clock=clock)
    originals = retries = 0
    for _ in range(60 * 100):  # one minute
        clock.advance(0.01)
        b.record_request()
        originals += 1
        for _ in range(2):
            retries += b.try_acquire_retry()
    # per second: 10 from the ratio, ~1 from the minimum (the reserve refills each window)
    assert retries <= 0.1 * originals + 1 * (60 + 10)
    assert retries >= 0.1 * originals * 0.9


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.sampled_from([0.05, 0.1, 0.2, 0.5, 1.0]),
    min_per_second=st.integers(0, 5),
    ops=st.lists(
        st.tuples(st.sampled_from(["orig", "retry", "tick"]), st.floats(0.0, 3.0)),
        max_size=300,
    ),
)
def test_retries_never_exceed_the_budget_within_its_window(
    ratio: float, min_per_second: int, ops: list[tuple[str, float]]
) -> None:
    """Property (R3): at every grant, retries granted in the budget's current window are at
    most ratio x originals in that window + min_per_second x window."""
    window, buckets = 10.0, 10
    width = window / buckets
    clock = ManualClock()
    b = RetryBudget(
        ratio=ratio, min_per_second=min_per_second, window=window, buckets=buckets, clock=clock
    )
    log: list[tuple[int, str]] = []
    for op, dt in ops:
        if op == "tick":
            clock.advance(dt)
            continue
        slice_now = int(clock.now() // width)
        if op == "orig":
            b.record_request()
            log.append((slice_now, "orig"))
        elif b.try_acquire_retry():
            log.append((slice_now, "retry"))
            in_window = [k for s, k in log if slice_now - buckets < s <= slice_now]
            retries = in_window.count("retry")
            originals = in_window.count("orig")
            assert retries <= ratio * originals + min_per_second * window + 1e-9


def test_budget_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError):
        RetryBudget(ratio=-0.1)
    with pytest.raises(ValueError):
        RetryBudget(min_per_second=-1)


# -- gRPC retryThrottling, gRFC A6 ------------------------------------------------------------


def test_grpc_throttle_matches_the_published_rules_on_a_scripted_sequence() -> None:
    """The sequence of grpc core's retry_throttle_test (Basic): max_tokens 4, ratio 1.6.

    Threshold is max_tokens / 2 = 2: retries are allowed only while token_count > 2."""
    t = GrpcRetryThrottle(max_tokens=4, token_ratio=1.6)
    assert t.tokens == 4 and t.retry_allowed
    script = [
        ("failure", 3.0, True),
        ("success", 4.0, True),  # not incremented beyond max
        ("failure", 3.0, True),
        ("failure", 2.0, False),  # at the threshold: no retries
        ("success", 3.6, True),
        ("failure", 2.6, True),
        ("failure", 1.6, False),
        ("failure", 0.6, False),
        ("failure", 0.0, False),  # not decremented below 0
        ("success", 1.6, False),
        ("success", 3.2, True),
        ("success", 4.0, True),
        ("failure", 3.0, True),
    ]
    for step, (event, tokens, allowed) in enumerate(script):
        if event == "failure":
            t.record_failure()
        else:
            t.record_success()
        assert t.tokens == pytest.approx(tokens), step
        assert t.try_acquire_retry() is allowed, step


def test_grpc_throttle_ratio_keeps_three_decimals() -> None:
    t = GrpcRetryThrottle(max_tokens=10, token_ratio=0.1239)
    for _ in range(10):
        t.record_failure()
    assert t.tokens == 0
    t.record_success()
    assert t.tokens == pytest.approx(0.123)


def test_grpc_throttle_default_config_recovers_only_through_successes() -> None:
    """The A6 example config (maxTokens 10, tokenRatio 0.1): 5 straight failures reach the
    threshold of 5; each success earns 0.1, so ten successes pay for one failure."""
    t = GrpcRetryThrottle(10, 0.1)
    for _ in range(4):
        t.record_failure()
    assert t.try_acquire_retry()
    t.record_failure()
    assert not t.try_acquire_retry()  # 5 is not > 5
    t.record_success()
    assert t.try_acquire_retry()  # 5.1
    t.record_failure()  # 4.1
    for _ in range(9):
        t.record_success()
    assert not t.try_acquire_retry()  # 5.0
    t.record_success()
    assert t.try_acquire_retry()  # 5.1
