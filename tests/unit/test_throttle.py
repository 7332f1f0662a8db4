"""ClientThrottle: p = max(0, (requests - K x accepts) / (requests + 1)) over a window."""

from __future__ import annotations

import random

import pytest

from brownout import ClientThrottle, Reason, Rejected
from brownout.testing import ManualClock


def test_no_rejections_while_the_dependency_accepts() -> None:
    t = ClientThrottle(clock=ManualClock(), rng=random.Random(1))
    for _ in range(1000):
        t.check()
        t.record_accept()
    assert t.probability() == 0.0


def test_probability_follows_the_formula() -> None:
    t = ClientThrottle(k=2.0, clock=ManualClock(), rng=random.Random(1))
    for i in range(100):
        try:
            t.check()
        except Rejected:
            pass
        if i < 20:
            t.record_accept()
    assert t.requests == 100 and t.accepts == 20
    assert t.probability() == pytest.approx((100 - 2 * 20) / 101)


def test_a_dead_dependency_gets_mostly_local_rejections_but_keeps_a_trickle() -> None:
    t = ClientThrottle(k=2.0, clock=ManualClock(), rng=random.Random(2))
    sent = refused = 0
    reasons: set[Reason] = set()
    for _ in range(10_000):
        try:
            t.check()
            sent += 1
        except Rejected as e:
            reasons.add(e.reason)
            refused += 1
    assert refused > 9_000 and reasons == {Reason.THROTTLED}
    assert sent > 0  # it still probes, so it notices recovery


def test_half_accepted_traffic_is_not_throttled_with_k_2() -> None:
    t = ClientThrottle(k=2.0, clock=ManualClock(), rng=random.Random(3))
    for i in range(1000):
        t.check()
        if i % 2 == 0:
            t.record_accept()
    assert t.probability() == 0.0  # requests <= 2 x accepts


def test_history_ages_out_of_the_window() -> None:
    clock = ManualClock()
    t = ClientThrottle(window=10.0, buckets=10, clock=clock, rng=random.Random(4))
    for _ in range(100):
        try:
            t.check()
        except Rejected:
            pass
    assert t.probability() > 0.9
    clock.advance(11.0)
    assert t.probability() == 0.0


def test_k_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        ClientThrottle(k=0.5)
