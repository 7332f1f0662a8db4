"""Known results reproduced by the simulator (sources in docs/simulator.md)."""

from __future__ import annotations

import math
from collections.abc import Callable

from brownout import Bulkhead, Dependency, ExponentialBackoff, RetryBudget, RetryPolicy
from brownout.limits import FixedLimit
from brownout.sim import (
    Arrivals,
    Build,
    Call,
    Constant,
    Exponential,
    Fault,
    Service,
    System,
    Unbudgeted,
    simulate,
)


def erlang_c_wait(lam: float, mu: float, c: int) -> float:
    """Mean wait in queue of M/M/c (Erlang C): P(wait) / (c mu - lambda)."""
    a = lam / mu
    below = sum(a**k / math.factorial(k) for k in range(c))
    top = a**c / math.factorial(c) / (1.0 - a / c)
    return top / (below + top) / (c * mu - lam)


def test_an_mmc_node_waits_as_erlang_c_says() -> None:
    lam, mu, c = 14.0, 10.0, 2  # utilisation 0.7
    system = System(
        services=(Service("node", 1, c, Exponential(1.0 / mu)),),
        arrivals=(Arrivals("clients", lam, Call("node")),),
        duration=3000.0,
        bucket=100.0,
        seed=1,
    )
    result = simulate(system)
    expected = erlang_c_wait(lam, mu, c)
    assert result.metric("node", "mean_wait") == _within(expected, 0.05)


class _within:
    def __init__(self, value: float, rel: float) -> None:
        self.value, self.rel = value, rel

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(other - self.value) <= self.rel * self.value

    def __repr__(self) -> str:
        return f"{self.value:.5f} +/- {self.rel:.0%}"


def _retrying(attempts: int, ratio: float | None) -> Callable[[Build], Dependency]:
    def make(b: Build) -> Dependency:
        budget = Unbudgeted() if ratio is None else RetryBudget(ratio, min_per_second=0.0)
        backoff = ExponentialBackoff(0.001, rng=b.rng)
        return Dependency(b.name, retry=RetryPolicy(attempts, budget=budget, backoff=backoff))

    return make


def _amplification(attempts: tuple[int, int, int], ratio: float | None, marker: bool) -> float:
    """Load at the failing bottom layer over the clients' load, for three retrying layers."""

    def tier(name: str, calls: tuple[Call, ...]) -> Service:
        return Service(name, 1, 10_000, Constant(0.001), calls=calls, do_not_retry_marker=marker)

    system = System(
        services=(
            tier("front", (Call("mid", dependency=_retrying(attempts[0], ratio)),)),
            tier("mid", (Call("back", dependency=_retrying(attempts[1], ratio)),)),
            tier("back", (Call("db", dependency=_retrying(attempts[2], ratio)),)),
            tier("db", ()),
        ),
        # Arrivals stop at 8 s so that every request's retries end within the run.
        arrivals=(Arrivals("clients", 20.0, Call("front"), steps=((8.0, 0.0),)),),
        faults=(Fault("error_rate", 0.0, service="db", fraction=1.0),),
        duration=10.0,
        seed=3,
    )
    result = simulate(system)
    return result.total("db", "offered") / result.total("clients", "offered")


def test_retries_at_every_layer_multiply() -> None:
    # Services that answer every failure with a plain 503: each layer retries its callee's.
    assert _amplification((4, 4, 4), None, marker=False) == 64.0


def test_retries_in_one_layer_multiply_once() -> None:
    assert _amplification((1, 1, 4), None, marker=False) == 4.0
    # brownout's do-not-retry marker makes the upper layers stop on their own.
    assert _amplification((4, 4, 4), None, marker=True) == 4.0


def test_a_ten_percent_budget_bounds_the_bottom_load() -> None:
    assert 1.0 < _amplification((4, 4, 4), 0.1, marker=True) <= 1.11
    # Without the marker each layer spends its own 10%: 1.1 ** 3.
    assert _amplification((4, 4, 4), 0.1, marker=False) <= 1.1**3 + 0.01


def _storm(protected: bool) -> System:
    """280 req/s against 400 req/s of capacity; a 2 s slowdown at 10 s; 1 s client timeouts."""

    def client(b: Build) -> Dependency:
        budget = RetryBudget(0.1, min_per_second=1.0) if protected else Unbudgeted()
        backoff = ExponentialBackoff(0.01, cap=0.1, rng=b.rng)
        return Dependency(b.name, timeout=1.0, retry=RetryPolicy(3, budget=budget, backoff=backoff))

    def bulkhead(b: Build) -> Bulkhead:
        return Bulkhead(b.name, FixedLimit(5), loop_lag=None)

    return System(
        services=(
            Service("api", 4, 5, Exponential(0.05), bulkhead=bulkhead if protected else None),
        ),
        arrivals=(
            Arrivals(
                "users",
                280.0,
                Call("api", dependency=client, propagate_deadline=protected),
                deadline=3.0,
            ),
        ),
        faults=(Fault("slowdown", 10.0, 12.0, service="api", factor=20.0),),
        duration=30.0,
        bucket=1.0,
        seed=5,
    )


def test_a_retry_storm_outlives_its_trigger_without_budgets() -> None:
    result = simulate(_storm(protected=False))
    assert result.metric("users", "completed", 0.0, 10.0) > 250.0
    # 18 s after the slowdown ended: goodput still near zero, every worker busy with the dead.
    assert result.metric("users", "completed", 15.0, 30.0) < 10.0
    assert result.metric("api", "wasted", 15.0, 30.0) > 19.0  # of 20 workers


def test_budgets_and_shedding_recover_within_a_few_timeouts() -> None:
    result = simulate(_storm(protected=True))
    offered = result.metric("users", "offered", 15.0, 30.0)
    # Back at the offered load (all of it fits in capacity) 3 s (3 timeouts) after the end.
    assert result.metric("users", "completed", 15.0, 30.0) >= 0.97 * offered
    assert result.metric("users", "success_ratio", 15.0, 30.0) >= 0.97
    assert result.total("api", "wasted") == 0.0


def _chain(propagate: bool) -> System:
    """Three hops under a 0.5 s client deadline, the last one too slow for a third of the run."""

    def edge(b: Build) -> Dependency:
        return Dependency(b.name, reserve=0.01)

    def hop(name: str, calls: tuple[Call, ...], mean: float) -> Service:
        return Service(name, 2, 50, Exponential(mean), calls=calls)

    return System(
        services=(
            hop("front", (Call("mid", dependency=edge, propagate_deadline=propagate),), 0.005),
            hop("mid", (Call("back", dependency=edge, propagate_deadline=propagate),), 0.005),
            hop("back", (), 0.02),
        ),
        arrivals=(
            Arrivals("clients", 100.0, Call("front", propagate_deadline=propagate), deadline=0.5),
        ),
        faults=(Fault("slowdown", 5.0, 10.0, service="back", factor=40.0),),
        duration=15.0,
        seed=11,
    )


def test_with_propagation_no_hop_works_for_a_caller_who_gave_up() -> None:
    result = simulate(_chain(propagate=True))
    assert result.total("clients", "failed") > 100  # the slowdown did time requests out
    for layer in ("front", "mid", "back"):
        assert result.total(layer, "wasted") == 0.0
        assert result.total(layer, "late") == 0.0


def test_without_propagation_the_wasted_work_is_reported() -> None:
    result = simulate(_chain(propagate=False))
    assert result.total("back", "wasted") > 10.0  # worker-seconds spent on the abandoned
    # Only the clients gave up (the hops wait for each other without a deadline): the front
    # answers them late, after the work below it was done for nobody.
    assert result.total("front", "late") > 100
