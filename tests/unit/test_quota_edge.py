"""`Quota.for_edge` plugged into the edge: 429 with the decision attached, or, with
``on_quota_exceeded="demote"``, the over-quota request served at SHEDDABLE while the bulkhead
has idle capacity and refused when it has none (S2, S5)."""

from __future__ import annotations

import asyncio

import pytest

import brownout
from brownout import (
    Bulkhead,
    Classification,
    EdgePolicy,
    InMemoryQuotaStore,
    Priority,
    Quota,
    Reason,
)
from brownout._edge import Flight, Refusal
from brownout.events import EventHub
from brownout.limits import FixedLimit
from brownout.testing import ManualClock


def tenant(request: object, default: Classification) -> Classification:
    return default._replace(caller="tenant-7")


async def serve(policy: EdgePolicy) -> Priority | Refusal:
    async def call() -> Priority:
        return brownout.current().priority

    flight = Flight(asyncio.get_running_loop().time())
    out = await policy.serve(object(), call, flight, route=policy.route("/reports"))
    assert isinstance(out, Priority | Refusal)
    return out


def quota() -> Quota:
    return Quota(1.0, 1, store=InMemoryQuotaStore(clock=ManualClock()), events=EventHub())


async def test_over_quota_is_refused_with_429_and_the_decision() -> None:
    policy = EdgePolicy(
        quota=quota().for_edge(key=lambda c: c.caller), classifier=tenant, events=EventHub()
    )
    assert await serve(policy) is Priority.CRITICAL
    refused = await serve(policy)
    assert isinstance(refused, Refusal)
    assert refused.status == 429
    assert refused.reason is Reason.QUOTA
    assert refused.quota is not None and refused.quota.remaining == 0
    assert refused.retry_after is not None and refused.retry_after >= 1.0  # jittered up


async def test_over_quota_uses_idle_capacity_at_sheddable_only() -> None:
    bulkhead = Bulkhead("reports", FixedLimit(1), events=EventHub())
    policy = EdgePolicy(
        bulkhead=bulkhead,
        quota=quota().for_edge(key=lambda c: c.caller),
        on_quota_exceeded="demote",
        classifier=tenant,
        events=EventHub(),
    )
    assert await serve(policy) is Priority.CRITICAL  # within quota
    assert await serve(policy) is Priority.SHEDDABLE  # over quota, bulkhead idle: demoted
    held = bulkhead.try_admit(priority=Priority.CRITICAL)  # the bulkhead is now full
    try:
        refused = await serve(policy)  # over quota, no idle capacity: 429
        assert isinstance(refused, Refusal)
        assert refused.status == 429
    finally:
        held.ignore()


def test_a_per_caller_quota_without_a_classifier_is_refused_at_construction() -> None:
    """Without a classifier every caller is "unknown": one allowance for all of them."""
    with pytest.raises(ValueError, match="classifier"):
        EdgePolicy(quota=quota().for_edge(key=lambda c: c.caller), events=EventHub())
    # A limit shared on purpose needs none.
    EdgePolicy(quota=quota().for_edge(key=lambda c: "all", per_caller=False), events=EventHub())
