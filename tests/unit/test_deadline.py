"""Deadline and call budget (D1, D2, D4, D7) on a manual clock: no sleeping."""

from __future__ import annotations

import math
import pickle

import pytest

import brownout
from brownout import Deadline, Reason, Rejected, call_budget
from brownout.testing import ManualClock


def test_remaining_counts_down_and_never_goes_negative() -> None:
    clock = ManualClock(100.0)
    d = Deadline.after(1.5, clock=clock)
    assert d.remaining() == pytest.approx(1.5)
    clock.advance(1.0)
    assert d.remaining() == pytest.approx(0.5)
    assert not d.expired
    clock.advance(1.0)
    assert d.remaining() == 0.0
    assert d.expired


def test_deadline_is_immutable_and_not_picklable() -> None:
    d = Deadline.after(1.0, clock=ManualClock())
    with pytest.raises(AttributeError):
        d.at = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="remaining"):
        pickle.dumps(d)


def test_nan_is_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        Deadline.after(math.nan)


def test_earliest_only_shortens() -> None:
    clock = ManualClock()
    short, long = Deadline.after(1, clock=clock), Deadline.after(5, clock=clock)
    assert long.earliest(short) is short
    assert short.earliest(long) is short
    assert short.earliest(None) is short


def test_call_budget_seed_example_rejects_before_starting() -> None:
    # The seed's example: 40 ms left, the call needs 150 ms -> reject before starting (D4).
    clock = ManualClock()
    d = Deadline.after(0.040, clock=clock)
    with pytest.raises(Rejected) as info:
        call_budget(1.0, min_useful=0.150, deadline=d)
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT


def test_call_budget_is_min_of_normal_timeout_and_remaining_minus_reserve() -> None:
    clock = ManualClock()
    d = Deadline.after(2.0, clock=clock)
    assert call_budget(0.5, reserve=0.1, deadline=d) == pytest.approx(0.5)
    clock.advance(1.7)  # 0.3 left
    assert call_budget(0.5, reserve=0.1, deadline=d) == pytest.approx(0.2)
    clock.advance(0.25)  # 0.05 left, below the reserve
    with pytest.raises(Rejected) as info:
        call_budget(0.5, reserve=0.1, deadline=d)
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    clock.advance(1)
    with pytest.raises(Rejected) as info:
        call_budget(0.5, deadline=d)
    assert info.value.reason is Reason.DEADLINE_EXPIRED


def test_call_budget_without_deadline_uses_normal_timeout() -> None:
    assert call_budget(0.8, reserve=0.1, min_useful=0.5) == 0.8


def test_call_budget_reads_the_request_context() -> None:
    with brownout.deadline(0.030):
        with pytest.raises(Rejected):
            call_budget(1.0, min_useful=0.150)
        assert call_budget(1.0) <= 0.030


# -- reserve: kept back, never added -----------------------------------------------------------


@pytest.mark.parametrize("reserve", [-5.0, math.nan, -math.inf])
def test_call_budget_never_outlives_the_deadline(reserve: float) -> None:
    clock = ManualClock(0.0)
    d = Deadline.after(1.0, clock=clock)
    budget = call_budget(30.0, reserve=reserve, deadline=d)
    assert budget == 1.0
