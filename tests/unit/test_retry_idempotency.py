"""Outcome ledger (bounded, in memory) and Reconciler (D6, T3)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

import brownout
from brownout import Dependency, InMemoryOutcomeLedger, OutcomeState, Reconciler
from brownout._retry import OutcomeRecord
from brownout._retry.idempotency import Check
from brownout.testing import ManualClock
from brownout.wire import new_idempotency_key


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
    assert ledger.dropped_pending == 1  # b was resolved; a was still pending
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


async def test_bounded_100k_unknown_outcomes_keep_max_entries_at_a_small_cost_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage of a payments dependency turns every call into an unknown outcome: 100,000
    distinct keys. The ledger keeps ``max_entries``, resolved entries evicted first, and
    finding the entry to evict does not scan the ledger (a scan per record took ~1 ms at
    10,000 pending entries, on the event loop, for every call during the outage)."""
    caplog.set_level(logging.ERROR, logger="brownout.retry")  # one warning per dropped key
    ledger = InMemoryOutcomeLedger(max_entries=10_000)
    for i in range(100_000):
        await ledger.record_unknown(f"order-{i}", dependency="payments")
        if i % 3 == 0:
            await ledger.resolve(f"order-{i}", OutcomeState.APPLIED)
    # (Its cost is not timed here: before the heap this loop took 100 s, after it 1 s.)
    assert len(ledger) == 10_000
    assert ledger.evicted == 90_000
    pending = await ledger.pending(limit=10_000)
    assert len(pending) >= 9_999  # the resolved ones went first
    resolved_evicted = 33_334 - (10_000 - len(pending))
    assert ledger.dropped_pending == 90_000 - resolved_evicted
    assert pending[-1].key == "order-99998"  # (99,999 was resolved)
    # private: the eviction heap's stale rows cost memory but show nowhere public
    assert len(ledger._resolved) <= 2 * ledger.max_entries


async def test_bounded_keys_resolved_again_and_again_leave_no_trail() -> None:
    # A key resolved, set back to pending and resolved again, over and over, pushed a heap
    # row each time; with the ledger never full, none was popped.
    ledger = InMemoryOutcomeLedger(max_entries=100)
    await ledger.record_unknown("order-1", dependency="payments")
    for _ in range(10_000):
        await ledger.resolve("order-1", OutcomeState.APPLIED)
        await ledger.resolve("order-1", OutcomeState.PENDING)
    assert len(ledger) == 1
    # private: the eviction heap's stale rows cost memory but show nowhere public
    assert len(ledger._resolved) <= 2 * ledger.max_entries
    await ledger.record_unknown("order-2", dependency="payments")
    assert (await ledger.get("order-1")) is not None


def test_bad_bound() -> None:
    with pytest.raises(ValueError):
        InMemoryOutcomeLedger(max_entries=0)


# -- D6 / T3: recording and reconciling unknown outcomes ---------------------------------------


@pytest.mark.looptime
async def test_entries_left_for_a_human_do_not_starve_newer_ones() -> None:
    ledger = InMemoryOutcomeLedger()
    for key in ("stuck-1", "stuck-2", "fresh"):
        await ledger.record_unknown(key, dependency="shop")

    async def check(record: OutcomeRecord) -> OutcomeState:
        return OutcomeState.PENDING if record.key.startswith("stuck") else OutcomeState.APPLIED

    reconciler = Reconciler(ledger, check, batch=2, max_checks=1)
    for _ in range(3):
        await reconciler.run_once()
    fresh = await ledger.get("fresh")
    assert fresh is not None and fresh.state is OutcomeState.APPLIED


class _FlakyLedger(InMemoryOutcomeLedger):
    failures = 1

    async def pending(self, limit: int = 100) -> list[OutcomeRecord]:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("ledger store blipped")
        return await super().pending(limit)


@pytest.mark.looptime
async def test_reconciler_run_survives_a_ledger_blip() -> None:
    ledger = _FlakyLedger()
    await ledger.record_unknown("k", dependency="shop")

    async def check(record: OutcomeRecord) -> OutcomeState:
        return OutcomeState.APPLIED

    task = asyncio.create_task(Reconciler(ledger, check).run(interval=1.0))
    await asyncio.sleep(2.5)
    try:
        assert not task.done(), task.exception()
        record = await ledger.get("k")
        assert record is not None and record.state is OutcomeState.APPLIED
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- issue 24: a later unknown outcome for a resolved key ------------------------------------


async def test_a_new_unknown_for_a_resolved_key_is_pending_again() -> None:
    """Reconciled NOT_APPLIED, resent by hand with the same key, and the resend timed out
    too: the resend may have applied it. The ledger kept the old resolution and dropped the
    new unknown, so nobody reconciled it."""
    clock = ManualClock(1.0)
    ledger = InMemoryOutcomeLedger(clock=clock)
    await ledger.record_unknown("order-7", dependency="payments", detail="read timeout")
    await ledger.record_unknown("order-8", dependency="payments")
    await ledger.note_check("order-7")
    await ledger.resolve("order-7", OutcomeState.NOT_APPLIED)
    clock.advance(5.0)
    await ledger.record_unknown("order-7", dependency="payments", detail="timeout again")
    rec = await ledger.get("order-7")
    assert rec is not None and rec.state is OutcomeState.PENDING  # was: still NOT_APPLIED
    assert rec == OutcomeRecord(
        "order-7",
        "payments",
        OutcomeState.PENDING,
        6.0,  # the new attempt's, so it queues behind older unknowns
        "timeout again",
        checks=0,  # a new question for the reconciler
        previous=OutcomeState.NOT_APPLIED,  # what was known before this attempt
    )
    assert [r.key for r in await ledger.pending()] == ["order-8", "order-7"]
    resolved = await Reconciler(ledger, _always(OutcomeState.APPLIED)).run_once()
    assert [(r.key, r.state) for r in resolved] == [
        ("order-8", OutcomeState.APPLIED),
        ("order-7", OutcomeState.APPLIED),
    ]


async def test_a_new_unknown_for_a_key_left_for_a_human_is_checked_again() -> None:
    """Pending, checked ``max_checks`` times without an answer (left for a human), then a new
    attempt with the same key is unknown too: that attempt is new, so its checks start again
    (before, the record kept ``checks == max_checks`` and nobody looked at the new attempt)."""
    ledger = InMemoryOutcomeLedger(clock=ManualClock(1.0))
    asked: list[str] = []

    async def check(record: OutcomeRecord) -> OutcomeState:
        asked.append(record.key)
        return OutcomeState.PENDING

    reconciler = Reconciler(ledger, check, max_checks=2)
    await ledger.record_unknown("order-9", dependency="payments", detail="read timeout")
    for _ in range(3):
        await reconciler.run_once()
    assert asked == ["order-9", "order-9"]  # left for a human
    await ledger.record_unknown("order-9", dependency="payments", detail="timeout again")
    rec = await ledger.get("order-9")
    assert rec == OutcomeRecord(
        "order-9", "payments", OutcomeState.PENDING, 1.0, "read timeout", checks=0
    )  # the first record stands, its checks start again
    await reconciler.run_once()
    assert asked == ["order-9"] * 3


async def test_a_reopened_key_is_evicted_in_its_new_place() -> None:
    ledger = InMemoryOutcomeLedger(max_entries=3)
    for k in "abc":
        await ledger.record_unknown(k, dependency="d")
    await ledger.resolve("a", OutcomeState.APPLIED)
    await ledger.record_unknown("a", dependency="d")  # newest now, pending
    await ledger.resolve("b", OutcomeState.APPLIED)
    await ledger.resolve("a", OutcomeState.APPLIED)
    await ledger.record_unknown("d", dependency="d")  # b is the oldest resolved entry
    assert await ledger.get("b") is None and await ledger.get("a") is not None
    assert ledger.dropped_pending == 0


def _always(state: OutcomeState) -> Check:
    async def check(record: OutcomeRecord) -> OutcomeState:
        return state

    return check


# -- issue 24: idempotency keys must not be guessable ----------------------------------------


async def test_generated_keys_do_not_predict_each_other_across_dependencies() -> None:
    """Keys were one per-process random prefix plus a counter shared by every `Dependency`:
    a key seen by one third party gave the keys sent to another (same prefix, next
    numbers). Each key must be unguessable on its own."""
    seen: dict[str, list[str]] = {"maps": [], "payments": []}

    async def send(name: str) -> None:
        key = brownout.current().idempotency_key
        assert key is not None
        seen[name].append(key)

    maps, payments = Dependency("maps"), Dependency("payments")
    for _ in range(50):
        await maps.call(send, "maps")  # mutations: keyed
        await payments.call(send, "payments")
    keys = seen["maps"] + seen["payments"] + [new_idempotency_key() for _ in range(50)]
    assert len(set(keys)) == len(keys) == 150
    for key in keys:  # 128 random bits, and a valid header value
        assert len(key) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", key), key
    for a in seen["maps"]:
        for b in seen["payments"]:
            # Two random hex keys share 9 leading digits with probability 16**-9 (2,500
            # pairs: about 4e-8); the old keys shared 25 (the process's prefix and "-").
            assert _shared_prefix(a, b) < 9, (a, b)
    for name, sent in seen.items():
        # Not a sequence: every position varies from key to key (50 draws from 16 symbols
        # leave 6 or fewer distinct with probability ~4e-18; a prefix and counter keep most
        # positions fixed).
        for i in range(22):
            assert len({k[i] for k in sent}) > 6, (name, i, sent[:3])


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
