"""Limit algorithms: formulas, safeguards, and convergence against a simulated knee (A5)."""

from __future__ import annotations

import random

import pytest

from brownout import AIMDLimit, FixedLimit, Gradient2Limit, VegasLimit
from brownout.admission.limits import Limit
from brownout.admission.model import KneeServer, run_saturated

KNEE = 100


def test_fixed_limit_never_moves() -> None:
    lim = FixedLimit(8)
    assert not lim.adaptive
    assert lim.on_sample(0.0, 5.0, 8, True) == 8
    assert lim.on_sample(0.0, 0.001, 8, False) == 8
    with pytest.raises(ValueError):
        FixedLimit(0)


def test_aimd_backs_off_once_per_round_trip() -> None:
    lim = AIMDLimit(100, min_limit=10)
    # two drops of requests that were in flight together: one decrease, not two
    assert lim.on_sample(0.0, 0.1, 100, True) == 90
    assert lim.on_sample(0.05, 0.1, 100, True) == 90
    # a drop of a request admitted after the decrease counts again
    assert lim.on_sample(0.2, 0.1, 90, True) == 81


def test_aimd_grows_one_per_round_trip_unless_app_limited() -> None:
    lim = AIMDLimit(20)
    for _ in range(20):  # one round trip's worth of samples at full concurrency
        lim.on_sample(0.0, 0.1, 20, False)
    assert lim.limit == 20 or lim.limit == 21
    assert 20.9 < lim._value < 21.1
    before = lim._value
    for _ in range(100):  # app-limited: only 5 in flight out of 21
        lim.on_sample(0.0, 0.1, 5, False)
    assert lim._value == before


def test_aimd_timeout_counts_as_drop() -> None:
    lim = AIMDLimit(50, timeout=1.0)
    assert lim.on_sample(0.0, 2.0, 50, False) == 45


@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
def test_dropped_samples_never_feed_rtt(make: type) -> None:
    lim = make(50, rng=random.Random(0))
    for i in range(200):
        lim.on_sample(i * 0.01, 0.1, 50, False)
    short, base = lim.short_rtt, lim.no_load_rtt
    before = lim.estimate
    lim.on_sample(2.0, 0.0001, 50, True)  # a fast rejection: its rtt means nothing
    assert (lim.short_rtt, lim.no_load_rtt) == (short, base)
    assert lim.estimate < before  # but the limit backs off


@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
def test_no_growth_while_app_limited(make: type) -> None:
    lim = make(50, rng=random.Random(0))
    for i in range(500):
        lim.on_sample(i * 0.01, 0.1, 10, False)  # only 10 of 50 in flight
    assert lim.estimate == 50


@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
def test_no_load_rtt_is_reprobed_with_jitter(make: type) -> None:
    a = make(40, probe_interval=10.0, probe_jitter=0.2, rng=random.Random(1))
    b = make(40, probe_interval=10.0, probe_jitter=0.2, rng=random.Random(2))
    starts: dict[int, float] = {}
    for lim, key in ((a, 1), (b, 2)):
        t = 0.0
        while t < 15.0:
            lim.on_sample(t, 0.05, lim.limit, False)
            if lim.probing and key not in starts:
                starts[key] = t
                assert lim.limit == lim.estimate // 2  # pinned to half the limit
            t += 0.001
    assert 8.0 <= starts[1] <= 12.0 and 8.0 <= starts[2] <= 12.0
    assert starts[1] != starts[2]  # jitter: a fleet does not probe in step


def test_probe_replaces_a_stale_baseline() -> None:
    lim = VegasLimit(40, probe_interval=5.0, probe_jitter=0.0, rng=random.Random(0))
    t = 0.0
    while t < 4.0:
        lim.on_sample(t, 0.05, lim.limit, False)
        t += 0.001
    assert lim.no_load_rtt == pytest.approx(0.05)
    while t < 8.0:  # the service is 4x slower now; only a probe can tell
        lim.on_sample(t, 0.2, min(lim.limit, 10), False)
        t += 0.001
    assert lim.no_load_rtt == pytest.approx(0.2)


def _run(limit: Limit, server: KneeServer) -> object:
    # 20 s normal, 20 s at 4x service time, 20 s normal again
    return run_saturated(limit, server, 60.0, slowdowns=((20.0, 4.0), (40.0, 1.0)))


def _limits() -> list[tuple[str, object]]:
    return [
        ("aimd", lambda seed: (AIMDLimit(), KneeServer(KNEE, 0.05, max_queue=10, seed=seed))),
        (
            "gradient2",
            lambda seed: (
                Gradient2Limit(probe_interval=5.0, rng=random.Random(seed)),
                KneeServer(KNEE, 0.05, seed=seed),
            ),
        ),
        (
            "vegas",
            lambda seed: (
                VegasLimit(probe_interval=5.0, rng=random.Random(seed)),
                KneeServer(KNEE, 0.05, seed=seed),
            ),
        ),
    ]


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("name", "make"), _limits(), ids=[n for n, _ in _limits()])
def test_converges_to_knee_survives_slowdown_and_recovers(name: str, make, seed: int) -> None:
    limit, server = make(seed)
    trace = _run(limit, server)
    low, high = 0.8 * KNEE, 1.2 * KNEE
    for phase, (start, end) in {
        "converged": (10.0, 20.0),
        "re-converged after 4x slowdown": (30.0, 40.0),
        "recovered": (50.0, 60.0),
    }.items():
        window = trace.window(start, end)  # type: ignore[attr-defined]
        assert len(window) > 50, phase
        assert low <= min(window) and max(window) <= high, (phase, min(window), max(window))
        # no oscillation: the limit holds steady inside the band
        assert max(window) - min(window) <= 0.15 * KNEE, (phase, min(window), max(window))
    assert trace.completed > 50_000  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
def test_no_ratchet_under_constant_load(make: type) -> None:
    limit = make(probe_interval=5.0, rng=random.Random(7))
    trace = run_saturated(limit, KneeServer(KNEE, 0.05, noise=0.3, seed=7), 120.0)
    late = trace.window(100.0, 120.0)
    assert max(late) <= 1.2 * KNEE


def test_knee_server_is_deterministic() -> None:
    a = run_saturated(VegasLimit(rng=random.Random(1)), KneeServer(20, 0.01, seed=5), 5.0)
    b = run_saturated(VegasLimit(rng=random.Random(1)), KneeServer(20, 0.01, seed=5), 5.0)
    assert a.points == b.points and a.completed == b.completed


@pytest.mark.parametrize("make", [AIMDLimit, Gradient2Limit, VegasLimit])
def test_bounds_are_respected(make: type) -> None:
    lim = make(10, min_limit=5, max_limit=12)
    for i in range(2000):
        lim.on_sample(i * 0.001, 0.01, lim.limit, False)
    assert lim.limit <= 12
    for i in range(2000):
        lim.on_sample(10 + i, 1.0, lim.limit, True)
    assert lim.limit >= 5
    with pytest.raises(ValueError):
        make(10, min_limit=20)


@pytest.mark.parametrize("make", [Gradient2Limit, VegasLimit])
def test_probe_during_warm_up_keeps_the_baseline_right(make: type) -> None:
    # very little traffic: the first probe comes before the warm-up has enough samples
    lim = make(40, probe_interval=1.0, probe_jitter=0.0, probe_samples=5)
    for i in range(200):
        lim.on_sample(i * 0.1, 0.05, 1, False)
    assert lim.no_load_rtt == pytest.approx(0.05)
