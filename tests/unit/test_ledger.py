"""Tallied accounting: a bulkhead counts routine outcomes in its `Ledger` while every sink
accepts tallies, and `Stats` reads exactly what per-request events would have told it (O1,
O2, O3, S8; issue 7's hot-path cost)."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from brownout import Bulkhead, Deadline, Priority, Rejected, Stats
from brownout._tally_buffer import MAX_SAMPLES, Ledger, held
from brownout.events import (
    Event,
    EventHub,
    RequestAdmitted,
    RequestCompleted,
    RequestFailed,
    RequestOffered,
    RequestsTallied,
)
from brownout.limits import FixedLimit
from brownout.testing import ManualClock

pytestmark = pytest.mark.looptime


class Recorder:
    """A per-request sink: it does not accept tallies."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


class TallyRecorder(Recorder):
    accepts_tallies = True


def observed(**kwargs: object) -> tuple[Bulkhead, Stats, EventHub]:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    b = Bulkhead("api", FixedLimit(kwargs.pop("limit", 100)), events=hub, **kwargs)  # type: ignore[arg-type]
    return b, stats, hub


async def run(b: Bulkhead, n: int, caller: str = "web", **admit: object) -> None:
    for _ in range(n):
        async with b.admit(priority=Priority.CRITICAL, caller=caller, operation="/q", **admit):  # type: ignore[arg-type]
            pass


def test_hub_tallies_only_while_every_sink_accepts_tallies() -> None:
    hub = EventHub()
    assert not hub.enabled and not hub.tallying
    stats = hub.subscribe(Stats())
    assert hub.enabled and hub.tallying
    plain = hub.subscribe(Recorder())
    assert hub.enabled and not hub.tallying
    hub.unsubscribe(plain)
    assert hub.tallying
    hub.unsubscribe(stats)
    assert not hub.enabled and not hub.tallying


async def test_counts_are_exact_and_no_routine_events_are_built() -> None:  # O1
    b, stats, hub = observed()
    seen = hub.subscribe(TallyRecorder())
    await run(b, 100)
    # nothing routine went out per request
    assert not [e for e in seen.events if not isinstance(e, RequestsTallied)]
    assert stats.count("offered") == 100  # the read flushed the ledger
    assert stats.count("admitted") == 100
    assert stats.count("completed", caller="web", operation="/q", priority="critical") == 100
    assert stats.count("completed_late") == 0
    assert stats.queue_wait["api"].count == 100  # all admitted without waiting
    assert stats.queue_wait["api"].max == 0.0
    # success latency is a sample: the first admission and one in estimate_every (16)
    assert stats.latency().count == math.ceil(100 / 16)
    assert len(seen.events) == 1 and isinstance(seen.events[0], RequestsTallied)


async def test_every_success_with_a_deadline_is_timed_and_late_ones_are_not_goodput() -> None:
    clock = ManualClock()
    b, stats, _hub = observed(clock=clock, deadline_aware=False)
    for i in range(10):
        async with b.admit(
            priority=Priority.CRITICAL,
            caller="web",
            operation="/q",
            deadline=Deadline.after(0.5, clock=clock),
        ):
            clock.advance(0.1 if i < 8 else 0.9)  # the last two finish after the deadline
    assert stats.count("completed") == 8
    assert stats.count("completed_late") == 2  # wasted work (O1)
    assert stats.latency().count == 8  # every useful success with a deadline is timed (O3)
    assert stats.latency().max == pytest.approx(0.1)
    assert stats.remaining_on_arrival["api"].count == 10  # O2
    assert stats.remaining_on_arrival["api"].max == pytest.approx(0.5)


async def test_a_per_request_sink_turns_tallying_off_and_gets_every_event() -> None:
    b, stats, hub = observed()
    await run(b, 5)
    rec = hub.subscribe(Recorder())  # flushes what was counted so far
    await run(b, 3)
    assert stats.count("completed") == 8
    assert stats.latency().count == 1 + 3  # the sampled first one, then every request
    assert sum(isinstance(e, RequestOffered) for e in rec.events) == 3
    assert sum(isinstance(e, RequestAdmitted) for e in rec.events) == 3
    assert sum(isinstance(e, RequestCompleted) for e in rec.events) == 3


async def test_unusual_outcomes_stay_events_while_tallying() -> None:
    b, stats, hub = observed(limit=1, reserve=0)
    seen = hub.subscribe(TallyRecorder())
    await run(b, 1)  # the first admission is timed; the next ones are not
    with pytest.raises(ValueError):
        async with b.admit(priority=Priority.CRITICAL, caller="web", operation="/q"):
            raise ValueError("boom")
    failed = [e for e in seen.events if isinstance(e, RequestFailed)]
    assert len(failed) == 1 and failed[0].error == "ValueError"
    assert math.isnan(failed[0].latency)  # untimed: not measured, and said so
    held = b.try_admit(priority=Priority.CRITICAL, caller="web", operation="/q")
    with pytest.raises(Rejected):
        b.try_admit(priority=Priority.SHEDDABLE, caller="bot", operation="/q")
    held.success()
    assert stats.count("failed", reason="ValueError") == 1
    assert stats.count("shed", caller="bot") == 1
    assert stats.count("offered") == 4
    assert stats.count("admitted") == 3
    assert stats.count("completed") == 2


async def test_queued_admissions_report_their_wait() -> None:  # O2
    b, stats, _hub = observed(limit=1, reserve=0)

    async def work() -> None:
        async with b.admit(priority=Priority.CRITICAL, caller="web", operation="/q"):
            await asyncio.sleep(0.05)

    await asyncio.gather(work(), work())
    assert stats.count("offered") == 2
    assert stats.count("queued") == 1
    assert stats.count("admitted") == 2
    assert stats.count("completed") == 2
    assert stats.queue_wait["api"].count == 2
    assert stats.queue_wait["api"].max == pytest.approx(0.05, abs=0.01)


async def test_many_callers_keep_the_ledger_and_the_series_bounded() -> None:
    b, stats, _hub = observed()
    for i in range(100_000):
        async with b.admit(priority=Priority.SHEDDABLE, caller=f"c{i}", operation="/q"):
            pass
    ledger = b.ledger
    assert ledger is not None
    assert ledger.row_count <= ledger.max_rows
    assert stats.count("completed") == 100_000  # nothing lost across compactions
    assert stats.count("offered") == 100_000
    assert stats.series_count() < 1_000
    assert len(stats.callers) <= 100


async def test_a_row_held_by_a_running_permit_survives_compaction() -> None:
    b, stats, _hub = observed()
    permit = b.admit(priority=Priority.CRITICAL, caller="long", operation="/stream")
    await permit.__aenter__()
    ledger = b.ledger
    assert ledger is not None
    for i in range(3 * ledger.max_rows):
        async with b.admit(priority=Priority.SHEDDABLE, caller=f"c{i}", operation="/q"):
            pass
    row = ledger.index["long"]["/stream"][Priority.CRITICAL]
    assert row is not None and held(row) == 1
    await permit.__aexit__(None, None, None)
    row = ledger.index["long"]["/stream"][Priority.CRITICAL]
    assert row is not None and held(row) == 0
    assert stats.count("completed", caller="long") == 1


async def test_a_sink_that_never_reads_gets_tallies_within_the_flush_interval() -> None:
    clock = ManualClock()
    hub = EventHub()
    seen = hub.subscribe(TallyRecorder())
    b = Bulkhead("api", FixedLimit(10), events=hub, clock=clock, estimate_every=1)
    for _ in range(3):
        async with b.admit(priority=Priority.CRITICAL, caller="web", operation="/q"):
            clock.advance(0.6)
    tallies = [e for e in seen.events if isinstance(e, RequestsTallied)]
    assert tallies, "a timed release past flush_interval flushes"
    assert sum(r[5] for t in tallies for r in t.rows) >= 2


async def test_a_flush_from_another_thread_loses_no_count() -> None:
    b, stats, _hub = observed()
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            stats.count("completed")

    t = threading.Thread(target=scraper)
    t.start()
    try:
        for _ in range(20):
            await run(b, 500)
            await asyncio.sleep(0)  # let the scraper thread in between batches too
    finally:
        stop.set()
        t.join()
    assert stats.count("completed") == 10_000
    assert stats.count("offered") == 10_000


async def test_tallies_folded_on_a_scrape_thread_and_events_on_the_loop_lose_nothing() -> None:
    # "admitted" arrives both ways: tallied (admitted at once) and as events (after a wait).
    b, stats, _hub = observed(limit=4, reserve=0)
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            stats.rows  # noqa: B018 - a read flushes the ledger on this thread

    async def work() -> None:
        async with b.admit(priority=Priority.CRITICAL, caller="web", operation="/q"):
            await asyncio.sleep(0)

    t = threading.Thread(target=scraper)
    t.start()
    try:
        for _ in range(100):
            await asyncio.gather(*(work() for _ in range(8)))  # 4 run, 4 wait
    finally:
        stop.set()
        t.join()
    assert stats.count("admitted") == 800
    assert stats.count("completed") == 800
    assert stats.count("queued") >= 100  # the event path was exercised every round
    assert stats.queue_wait["api"].count == 800  # zero waits tallied + real waits as events


def test_ledger_rejects_a_bad_bound() -> None:
    with pytest.raises(ValueError):
        Ledger("x", EventHub(), ManualClock(), max_rows=0)


async def test_bounded_samples_wait_for_no_reader() -> None:
    """Nobody reads and the clock never reaches ``flush_interval``: the latency and remaining
    deadline samples of 100,000 requests with deadlines are flushed at `MAX_SAMPLES`."""
    clock = ManualClock()
    hub = EventHub()
    hub.subscribe(TallyRecorder())  # accepts tallies, never reads
    b = Bulkhead("api", FixedLimit(10), events=hub, clock=clock)
    for i in range(100_000):
        deadline = Deadline.after(5.0, clock=clock)
        async with b.admit(priority=Priority.CRITICAL, caller=f"c{i}", deadline=deadline):
            pass
    ledger = b.ledger
    assert ledger is not None
    assert len(ledger.latencies) < MAX_SAMPLES
    assert len(ledger.remaining) < MAX_SAMPLES
    assert ledger.row_count <= ledger.max_rows


def test_a_sample_appended_to_the_list_a_flush_took_is_not_lost() -> None:
    """A releasing thread reads ``ledger.latencies`` and appends to it; a flush on another
    thread may run between the two. The sample lands in the next flush, not in a dropped list."""
    hub = EventHub()
    rec = TallyRecorder()
    hub.subscribe(rec)
    ledger = Ledger("api", hub, ManualClock())
    ledger.latencies.append(("/q", Priority.CRITICAL, 0.1))
    ledger.remaining.append(1.0)
    latencies, remaining = ledger.latencies, ledger.remaining  # the releasing thread's read
    ledger.flush()  # the other thread's flush
    latencies.append(("/q", Priority.CRITICAL, 0.2))  # its append, after the flush
    remaining.append(2.0)
    ledger.flush()
    tallies = [e for e in rec.events if isinstance(e, RequestsTallied)]
    assert [s for e in tallies for _, _, s in e.latencies] == [0.1, 0.2]
    assert [s for e in tallies for s in e.remaining] == [1.0, 2.0]
