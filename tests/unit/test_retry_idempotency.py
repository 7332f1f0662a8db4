"""Outcome ledger (bounded, in memory) and Reconciler (D6, T3)."""

from __future__ import annotations

import pytest

from brownout import ManualClock
from brownout.retry import InMemoryOutcomeLedger, OutcomeRecord, OutcomeState, Reconciler


async def test_records_once_and_resolves() -> None:
    ledger = InMemoryOutcomeLedger(clock=ManualClock(5.0))
    await ledger.record_unknown("k", dependency="payments", detail="timeout")
    await ledger.record_unknown("k", dependency="payments")  # idempotent
    assert len(ledger) == 1
    rec = await ledger.get("k")
    assert rec == OutcomeRecord("k", "payments", OutcomeState.PENDING, 5.0, "timeout")
    await ledger.resolve("k", OutcomeState.APPLIED)
    assert (await ledger.pending()) == []
    got = await ledger.get("k")
    assert got is not None and got.state is OutcomeState.APPLIED


async def test_bounded_evicting_resolved_entries_first() -> None:
    ledger = InMemoryOutcomeLedger(max_entries=3)
    for k in "abc":
        await ledger.record_unknown(k, dependency="d")
    await ledger.resolve("b", OutcomeState.NOT_APPLIED)
    await ledger.record_unknown("d", dependency="d")
    assert len(ledger) == 3 and await ledger.get("b") is None
    await ledger.record_unknown("e", dependency="d")  # all pending: the oldest goes
    assert await ledger.get("a") is None and ledger.evicted == 2
    assert [r.key for r in await ledger.pending()] == ["c", "d", "e"]


async def test_reconciler_resolves_what_check_can_answer_and_gives_up_after_max_checks() -> None:
    ledger = InMemoryOutcomeLedger()
    for k in ("applied", "lost", "unsure", "boom"):
        await ledger.record_unknown(k, dependency="d")

    async def check(record: OutcomeRecord) -> OutcomeState:
        if record.key == "boom":
            raise RuntimeError("the dependency is down")
        return {
            "applied": OutcomeState.APPLIED,
            "lost": OutcomeState.NOT_APPLIED,
        }.get(record.key, OutcomeState.PENDING)

    r = Reconciler(ledger, check, max_checks=2)
    resolved = await r.run_once()
    assert {(x.key, x.state) for x in resolved} == {
        ("applied", OutcomeState.APPLIED),
        ("lost", OutcomeState.NOT_APPLIED),
    }
    assert {x.key for x in await ledger.pending()} == {"unsure", "boom"}
    await r.run_once()
    assert await r.run_once() == []
    unsure = await ledger.get("unsure")
    assert unsure is not None and unsure.checks == 2  # left for a human, no longer polled


def test_bad_bound() -> None:
    with pytest.raises(ValueError):
        InMemoryOutcomeLedger(max_entries=0)
