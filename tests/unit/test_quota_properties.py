"""Property tests of the quota implementations on virtual time (S2, S5, F1), no Redis.

- GCRA against a brute-force model in exact rational arithmetic (a token bucket of ``burst``
  tokens refilled at ``rate``): every decision, ``retry_after``, ``remaining`` and ``reset``
  is the model's, up to the documented round-off slack; over ANY interval no more than
  ``rate * t + burst`` units are allowed (docs/quotas.md, "The guarantee").
- `InMemoryQuotaStore` over many keys is the pure GCRA per key while no active key is
  evicted, never holds more than ``max_keys``, and evicts an active key only when every
  stored key is still draining.
- Absurd inputs (costs outside ``1..burst``, NaN or infinite costs and times, huge times,
  empty, huge or non-UTF-8 keys) get a ``ValueError`` that says what is wrong, or an ordinary
  decision, never another exception, and never a corrupted key.
- `Quota` answers an impossible cost the same way whether its shared store is up or down.

The Redis store is held to the same model in tests/integration/test_quota_redis_properties.py.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout import InMemoryQuotaStore, Quota, QuotaStoreUnavailable, Reason
from brownout._quota import GcraOutcome, GcraPolicy, decide
from brownout.events import EventHub
from brownout.testing import ManualClock

FAST = settings(max_examples=250, deadline=None, derandomize=True)

rates = st.one_of(
    st.floats(0.01, 1000.0, allow_nan=False),
    st.sampled_from([1 / 3, 0.1, 7.0, 100.0, 193.828125]),  # inexact intervals, a known case
)
# Gaps in units of the emission interval: whole and half intervals land exactly on the
# boundary where a request becomes due, 1 - 1e-4 just before it (outside the round-off slack,
# so it must be refused); arbitrary floats land anywhere.
gaps = st.one_of(
    st.floats(0.0, 5.0, allow_nan=False),
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 1 - 1e-4, 1 - 1e-7]),
)
starts = st.sampled_from([0.0, -50.0, 12_345.678, 1.7e9])  # loop time, or epoch-sized


def exact(x: float) -> Fraction:
    return Fraction(x)


def slack_bound(policy: GcraPolicy, base: float, now: float) -> float:
    """An upper bound of the round-off slack `decide` grants (documented in gcra.py), plus
    the rounding of its own arithmetic: a request due later than this is always refused."""
    return policy.interval * 1e-6 + max(abs(base), abs(now)) * 4e-15 + rounding(policy, base, now)


def rounding(policy: GcraPolicy, base: float, now: float) -> float:
    """A few ulps of the largest magnitude `decide` adds or subtracts."""
    return 16 * math.ulp(max(abs(base), abs(now), policy.tolerance, 1.0))


def check_against_model(
    policy: GcraPolicy, tat: float | None, now: float, cost: int, out: GcraOutcome
) -> None:
    """One decision of `decide` against the exact token-bucket model from the same state."""
    rate = exact(policy.rate)
    burst = policy.burst
    t_now = exact(now)
    base = t_now if tat is None or exact(tat) < t_now else exact(tat)
    # Tokens in the bucket now: full (``burst``) minus what the TAT says is still draining.
    tokens = burst - (base - t_now) * rate
    due_in = (cost - tokens) / rate  # seconds until ``cost`` tokens are there (<= 0: now)
    slack = slack_bound(policy, float(base), now)
    error = Fraction(rounding(policy, float(base), now))
    if due_in <= 0:
        assert out.allowed, f"the model has {float(tokens)} >= {cost} tokens: must be allowed"
    elif due_in > slack:
        assert not out.allowed, f"{cost} units are due only in {float(due_in)} s"
    if out.allowed:
        after = tokens - cost
        assert out.retry_after == 0
        assert abs(exact(out.tat) - (base + cost / rate)) <= error
    else:
        after = tokens
        assert exact(out.tat) == base  # a refusal consumes nothing
        # retry_after is the model's wait: at now + retry_after the request is due, not before.
        assert abs(exact(out.retry_after) - due_in) <= error, (out.retry_after, due_in)
    # reset: time until the bucket is full again; remaining: whole tokens left, rounded down
    # (up to the slack: decide adds half of it so "n fit" is never a lie).
    assert abs(exact(out.reset) - (burst - after) / rate) <= error
    tolerance = Fraction(slack) * rate + Fraction(1, 10**9)
    assert math.floor(after - tolerance) <= out.remaining <= max(0, math.floor(after + tolerance))
    assert 0 <= out.remaining <= burst


@FAST
@given(
    rate=rates,
    burst=st.integers(1, 30),
    steps=st.lists(st.tuples(gaps, st.integers(1, 30)), min_size=1, max_size=80),
    start=starts,
)
@example(rate=193.828125, burst=3, steps=[(0.0, 1), (0.0, 1), (0.0, 1), (1.0, 1)], start=1.7e9)
def test_gcra_is_the_exact_token_bucket_and_never_exceeds_rate_t_plus_burst(
    rate: float, burst: int, steps: list[tuple[float, int]], start: float
) -> None:
    """Every decision is the brute-force model's (S2: exact Retry-After; the RateLimit
    header's remaining/reset), and over any interval [a, b] the allowed units are at most
    ``rate * (b - a) + burst`` (F1, docs/quotas.md)."""
    policy = GcraPolicy(rate, burst)
    tat: float | None = None
    now = start
    admitted: list[tuple[float, int]] = []
    for gap, raw_cost in steps:
        cost = min(raw_cost, burst)
        now += gap / rate
        out = decide(policy, tat, now, cost)
        check_against_model(policy, tat, now, cost, out)
        if out.allowed:
            tat = out.tat
            admitted.append((now, cost))
            if out.remaining:  # "n units fit" is honest: n units are allowed right now
                assert decide(policy, tat, now, out.remaining).allowed
        elif out.retry_after > 0:  # and retry_after is honest the other way round too
            assert decide(policy, tat, now + out.retry_after, cost).allowed
    # The bound, in exact arithmetic over every interval of admitted requests. decide may
    # admit a request up to its slack early, and each TAT step rounds: that, scaled by the
    # rate, is the only allowance.
    allowance = exact(rate) * Fraction(slack_bound(policy, now, now)) * (len(admitted) + 1)
    for i, (first, _) in enumerate(admitted):
        total = 0
        for end, cost in admitted[i:]:
            total += cost
            assert total <= exact(rate) * (exact(end) - exact(first)) + burst + allowance


@FAST
@given(
    rate=st.floats(0.5, 50.0, allow_nan=False),
    burst=st.integers(1, 5),
    max_keys=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.sampled_from("abcdefgh"), gaps, st.integers(1, 5)), min_size=1, max_size=80
    ),
)
def test_memory_store_is_gcra_per_key_and_evicts_active_keys_only_when_full(
    rate: float, burst: int, max_keys: int, steps: list[tuple[str, float, int]]
) -> None:
    """Idle keys are dropped losslessly; an active key (still draining) is evicted only when
    ``max_keys`` active keys are stored; the store never holds more than ``max_keys``."""
    policy = GcraPolicy(rate, burst)
    clock = ManualClock(100.0)
    store = InMemoryQuotaStore(max_keys=max_keys, clock=clock)
    model: dict[str, float] = {}
    for key, gap, raw_cost in steps:
        cost = min(raw_cost, burst)
        clock.advance(gap / rate)
        now = clock.now()
        active_before = sum(1 for k, t in model.items() if t > now and k != key)
        evicted_before = store.evicted_active
        out = store.decide_now(key, policy, cost)
        assert len(store) <= max_keys
        if store.evicted_active != evicted_before:
            # Forgiving a debt is documented only for a store full of draining keys.
            assert store.evicted_active == evicted_before + 1
            assert key not in model or model[key] <= now  # the newcomer is a new key
            assert active_before >= max_keys
            return  # which key was forgiven is the store's choice: the model stops here
        expected = decide(policy, model.get(key), now, cost)
        assert out == expected
        if expected.allowed:
            model[key] = expected.tat


# -- absurd inputs ---------------------------------------------------------------------------
bad_costs = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=31, max_value=10**30),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)


@FAST
@given(burst=st.integers(1, 30), cost=bad_costs, tat=st.sampled_from([None, 0.5, 1e9]))
def test_an_impossible_cost_is_a_value_error_that_names_the_cost(
    burst: int, cost: float, tat: float | None
) -> None:
    """Costs below 1, above the burst or not a number at all are refused with a
    ``ValueError`` that says why: never a silent refusal, never another exception."""
    policy = GcraPolicy(10.0, burst)
    if isinstance(cost, int) and 1 <= cost <= burst:
        cost = burst + 1
    with pytest.raises(ValueError, match="cost") as caught:
        decide(policy, tat, 1.0, cost)  # type: ignore[arg-type]
    if isinstance(cost, int) and cost > burst:
        assert "exceeds burst" in str(caught.value)
    elif isinstance(cost, int):
        assert ">= 1" in str(caught.value)
    store = InMemoryQuotaStore(clock=ManualClock(1.0))
    with pytest.raises(ValueError, match="cost"):
        store.decide_now("k", policy, cost)  # type: ignore[arg-type]
    assert len(store) == 0  # nothing stored for a request that was not decided
    assert store.decide_now("k", policy, burst).allowed  # the key's burst is intact


bad_times = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 1e20]),
    st.floats(min_value=1e11, max_value=1e308),
)


@FAST
@given(
    now=bad_times,
    tat=st.sampled_from([None, 0.0, 5.0]),
    rate=st.sampled_from([0.5, 10.0, 1000.0]),
)
def test_a_time_that_is_not_a_usable_clock_reading_is_a_value_error(
    now: float, tat: float | None, rate: float
) -> None:
    """NaN, infinite, or so large that an emission interval no longer fits in a float's
    precision (the bound would silently stop holding): a ``ValueError`` about ``now``, not
    an OverflowError, not "allowed" with an absurd ``remaining``."""
    policy = GcraPolicy(rate, 5)
    with pytest.raises(ValueError, match="now"):
        decide(policy, tat, now, 1)


@FAST
@given(bad=st.sampled_from([math.nan, math.inf, 1e300]), good=st.floats(0.0, 1e6))
def test_a_broken_clock_reading_does_not_corrupt_a_stored_key(bad: float, good: float) -> None:
    """A store whose clock returns garbage once raises, and the key decides as before."""
    policy = GcraPolicy(10.0, 3)
    clock = ManualClock(good)
    store = InMemoryQuotaStore(clock=clock)
    first = store.decide_now("k", policy, 2)
    clock._now = bad  # a broken clock: ManualClock refuses to go backwards, so poke it
    with pytest.raises(ValueError):
        store.decide_now("k", policy, 1)
    clock._now = good
    assert store.decide_now("k", policy, 1) == decide(policy, first.tat, good, 1)
    assert not store.decide_now("k", policy, 1).allowed  # the debt is still there


@FAST
@given(
    keys=st.lists(
        st.one_of(
            st.text(max_size=20),  # includes "", NUL, lone surrogates (surrogateescape)
            st.sampled_from(["", "\x00", "\udcff", "k" * 100_000]),
        ),
        min_size=1,
        max_size=6,
        unique=True,
    )
)
def test_any_string_is_a_key_of_its_own(keys: list[str]) -> None:
    """Empty, huge, NUL or non-UTF-8 keys are ordinary keys: each has its own allowance."""
    policy = GcraPolicy(1.0, 2)
    store = InMemoryQuotaStore(clock=ManualClock(7.0))
    for key in keys:
        assert store.decide_now(key, policy, 2).allowed
    for key in keys:
        refused = store.decide_now(key, policy, 1)
        assert not refused.allowed and refused.retry_after == pytest.approx(1.0)
    assert len(store) == len(keys)


@FAST
@given(
    rate=st.one_of(
        st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e-300]),
        st.floats(max_value=0.0),
    ),
    burst=st.one_of(st.integers(max_value=0), st.sampled_from([10**400, 10**9])),
)
def test_an_unusable_policy_is_a_value_error(rate: float, burst: int) -> None:
    """A policy that could not be enforced (rate not a positive number, burst below 1, or
    a burst window beyond a float) is refused when built, with a ValueError."""
    with pytest.raises(ValueError):
        GcraPolicy(rate, burst)


# -- Quota: an impossible cost does not depend on the store's health ------------------------
class FlakyStore:
    """A shared store that validates like the real ones and is up or down as told."""

    shared = True
    timeout = 0.05

    def __init__(self, clock: ManualClock) -> None:
        self.inner = InMemoryQuotaStore(clock=clock)
        self.up = True

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome:
        if not self.up:
            raise QuotaStoreUnavailable("connection refused")
        return self.inner.decide_now(key, policy, cost)


@FAST
@given(
    cost=st.one_of(st.integers(-3, 45), st.sampled_from([10**9])),
    on_failure=st.sampled_from(["open", "closed"]),
    up=st.booleans(),
    instances=st.integers(1, 8),
)
async def test_quota_refuses_an_impossible_cost_the_same_way_whether_its_store_is_up_or_down(
    cost: int, on_failure: str, up: bool, instances: int
) -> None:
    """A cost outside ``1..burst`` is a ValueError with a healthy store; it stays one while
    the store is down (fail-open must not admit it as a clamped cost, fail-closed must not
    turn a caller's error into a 503). A valid cost gets a decision either way."""
    clock = ManualClock(1000.0)
    store = FlakyStore(clock)
    quota = Quota(
        rate=100.0,
        burst=20,
        store=store,
        on_store_failure=on_failure,  # type: ignore[arg-type]
        expected_instances=instances,
        clock=clock,
        events=EventHub(),
        rng=random.Random(1),
    )
    if not up:
        store.up = False
        await quota.check("someone-else")  # the outage is noticed
        assert quota.fallback_active
    if 1 <= cost <= 20:
        d = await quota.check("k", cost)
        if up:
            assert d.backend == "shared" and d.allowed
        elif on_failure == "open":
            assert d.backend == "fallback"  # a valid cost above the local share is clamped
            assert d.allowed  # a fresh key, within its local share
        else:
            assert d.backend == "closed" and d.reason is Reason.DEPENDENCY_UNAVAILABLE
        return
    with pytest.raises(ValueError, match="cost"):
        await quota.check("k", cost)
