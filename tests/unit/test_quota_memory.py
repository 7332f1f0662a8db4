"""The in-memory quota store: bounded memory, idle keys dropped, eviction counted (F1)."""

from __future__ import annotations

import pytest

from brownout import InMemoryQuotaStore
from brownout._quota import GcraPolicy
from brownout.testing import ManualClock

POLICY = GcraPolicy(rate=10.0, burst=2)


def test_decides_on_its_clock() -> None:
    clock = ManualClock(50.0)
    store = InMemoryQuotaStore(clock=clock)
    assert store.decide_now("a", POLICY).allowed
    assert store.decide_now("a", POLICY).allowed
    refused = store.decide_now("a", POLICY)
    assert not refused.allowed
    assert refused.retry_after == pytest.approx(0.1)
    clock.advance(0.1)
    assert store.decide_now("a", POLICY).allowed
    assert store.decide_now("b", POLICY).allowed  # keys are independent


def test_idle_keys_are_swept_as_traffic_flows() -> None:
    clock = ManualClock()
    store = InMemoryQuotaStore(clock=clock)
    for i in range(100):
        store.decide_now(f"k{i}", POLICY)
    assert len(store) == 100
    clock.advance(1.0)  # every bucket is full again: the keys carry no information
    for _ in range(60):
        store.decide_now("hot", POLICY)
        clock.advance(0.1)
    assert len(store) <= 2
    assert store.evicted_idle >= 99
    assert store.evicted_active == 0


def test_never_holds_more_than_max_keys_and_counts_forgiven_debts() -> None:
    clock = ManualClock()
    store = InMemoryQuotaStore(max_keys=10, clock=clock)
    for i in range(1000):
        store.decide_now(f"caller-{i}", POLICY)
        assert len(store) <= 10
    assert store.evicted_active == 990
    clock.advance(1.0)
    for i in range(5):
        store.decide_now(f"new-{i}", POLICY)
    assert store.evicted_active == 990  # idle keys made room, nothing active was dropped


def test_refusals_do_not_store_new_keys() -> None:
    store = InMemoryQuotaStore(max_keys=1, clock=ManualClock())
    store.decide_now("a", POLICY, cost=2)
    assert not store.decide_now("a", POLICY).allowed
    assert len(store) == 1


async def test_store_protocol_is_async_too() -> None:
    store = InMemoryQuotaStore(clock=ManualClock())
    out = await store.decide("a", POLICY, 2, budget=0.01)
    assert out.allowed
    assert out.remaining == 0
    assert store.shared is False


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError):
        InMemoryQuotaStore(max_keys=0)


def test_bounded_100k_forged_keys_while_every_bucket_still_drains() -> None:
    """100,000 distinct keys (an attacker rotating API keys or caller headers) within one
    second: none is idle yet, so the store evicts the least recently used and stays at
    ``max_keys``; each eviction is counted."""
    clock = ManualClock()
    store = InMemoryQuotaStore(max_keys=1000, clock=clock)
    slow = GcraPolicy(rate=0.001, burst=1)  # a bucket drains for 1,000 s
    for i in range(100_000):
        assert store.decide_now(f"key-{i}", slow).allowed
        clock.advance(1e-5)
        assert len(store) <= 1000
    assert store.evicted_active == 99_000
