"""Backoff: exponential with full jitter, decorrelated jitter, cap (R1)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brownout import DecorrelatedJitterBackoff, ExponentialBackoff


def test_exponential_without_jitter_doubles_up_to_the_cap() -> None:
    b = ExponentialBackoff(0.1, multiplier=2.0, cap=1.0, jitter=False)
    assert [b.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_full_jitter_is_deterministic_with_a_seeded_rng() -> None:
    a = ExponentialBackoff(0.1, cap=5.0, rng=random.Random(7))
    b = ExponentialBackoff(0.1, cap=5.0, rng=random.Random(7))
    assert [a.delay(n) for n in range(1, 10)] == [b.delay(n) for n in range(1, 10)]


def test_full_jitter_spreads_over_the_whole_range() -> None:
    b = ExponentialBackoff(1.0, cap=10.0, rng=random.Random(1))
    draws = [b.delay(3) for _ in range(2000)]  # ceiling 4.0
    assert min(draws) < 0.2 and max(draws) > 3.8
    assert 1.8 < sum(draws) / len(draws) < 2.2


@given(
    retry=st.integers(1, 10_000),
    base=st.floats(0.0, 10.0),
    cap=st.floats(0.0, 100.0),
    seed=st.integers(0, 2**32),
)
def test_exponential_never_exceeds_the_cap(retry: int, base: float, cap: float, seed: int) -> None:
    b = ExponentialBackoff(base, cap=cap, rng=random.Random(seed))
    assert 0.0 <= b.delay(retry) <= cap


@given(
    previous=st.floats(0.0, 1000.0),
    base=st.floats(0.001, 1.0),
    cap=st.floats(1.0, 60.0),
    seed=st.integers(0, 2**32),
)
def test_decorrelated_stays_within_base_three_times_previous_and_cap(
    previous: float, base: float, cap: float, seed: int
) -> None:
    b = DecorrelatedJitterBackoff(base, cap=cap, rng=random.Random(seed))
    d = b.delay(2, previous)
    assert base <= d <= min(cap, max(base, 3 * previous)) + 1e-9


def test_decorrelated_grows_from_the_previous_delay() -> None:
    rng = random.Random(3)
    b = DecorrelatedJitterBackoff(0.01, cap=100.0, rng=rng)
    finals = []
    for _ in range(300):
        delay = 0.0
        for n in range(1, 12):
            delay = b.delay(n, delay)
        finals.append(delay)
    # roughly exponential growth on average (unlike a fixed delay), still spread out
    assert sum(finals) / len(finals) > 10 * 0.01
    assert min(finals) < 0.05 < max(finals)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        ExponentialBackoff(-1)
    with pytest.raises(ValueError):
        ExponentialBackoff(0.1, multiplier=0.5)
    with pytest.raises(ValueError):
        DecorrelatedJitterBackoff(1.0, cap=0.5)


@pytest.mark.looptime
@pytest.mark.parametrize(
    "make",
    [
        lambda: ExponentialBackoff(float("nan")),
        lambda: ExponentialBackoff(0.1, cap=float("nan")),
        lambda: ExponentialBackoff(0.1, multiplier=float("nan")),
        lambda: DecorrelatedJitterBackoff(float("nan")),
        lambda: DecorrelatedJitterBackoff(0.1, cap=float("nan")),
    ],
)
def test_backoff_rejects_nan_parameters(make: Any) -> None:
    with pytest.raises(ValueError):
        make()
