"""Shed logs: one structured record per shed, sampled, with interval summaries (O4, S8)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from brownout import Priority, Reason
from brownout.events import EventHub, RequestOffered, RequestShed, hub
from brownout.export.logging import ShedLog
from brownout.testing import ManualClock


def shed(at, caller="alice", op="search", reason=Reason.QUEUE_FULL, fp=False):
    return RequestShed(
        at=at,
        source="api",
        operation=op,
        priority=Priority.SHEDDABLE,
        caller=caller,
        reason=reason,
        remaining=0.25,
        queue_wait=0.04,
        false_positive=fp,
    )


def records(caplog, event):
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def test_each_shed_is_a_structured_record(caplog):
    caplog.set_level(logging.INFO, logger="brownout.shed")
    log = ShedLog()
    log.emit(shed(0.0))
    log.emit(
        RequestOffered(
            at=0.0,
            source="api",
            operation="x",
            priority=Priority.CRITICAL,
            caller="c",
            remaining=None,
        )
    )  # ignored
    [r] = records(caplog, "shed")
    assert r.name == "brownout.shed"
    assert (r.caller, r.operation, r.priority, r.reason) == (
        "alice",
        "search",
        "sheddable",
        "queue_full",
    )
    assert r.remaining == 0.25
    assert r.queue_wait == 0.04
    assert "caller=alice" in r.getMessage()
    assert "reason=queue_full" in r.getMessage()


def test_a_flood_is_sampled_and_the_summary_counts_what_was_suppressed(caplog):
    caplog.set_level(logging.INFO, logger="brownout.shed")
    log = ShedLog(rate=5.0, burst=10, interval=10.0)
    for i in range(10_000):  # 10,000 refusals within one second
        log.emit(shed(i / 10_000, caller=f"tenant{i % 7}"))
    logged = len(records(caplog, "shed"))
    assert 10 + 4 <= logged <= 10 + 5  # the burst, plus ~1 s of refill at 5/s
    log.emit(shed(10.5, caller="late"))  # next interval: the previous one is summarized
    [summary] = records(caplog, "shed_summary")
    assert summary.shed == 10_000
    assert summary.logged == logged
    assert summary.suppressed == 10_000 - logged
    assert summary.by_reason == {"queue_full": 10_000}
    assert len(summary.top_callers) == 5
    assert sum(summary.top_callers.values()) < 10_000
    assert summary.levelno == logging.INFO
    assert log.total_suppressed == 10_000 - logged


def test_false_positive_makes_the_summary_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="brownout.shed")
    clock = ManualClock(5.0)
    log = ShedLog(clock=clock)
    log.emit(shed(1.0, fp=True))
    log.flush()
    [summary] = records(caplog, "shed_summary")
    assert summary.levelno == logging.WARNING
    assert summary.false_positive == 1
    assert summary.interval == 4.0
    log.flush()  # nothing shed since: no empty summary
    assert len(records(caplog, "shed_summary")) == 1


def test_silent_logger_costs_no_formatting(caplog):
    caplog.set_level(logging.ERROR, logger="brownout.shed")
    log = ShedLog()
    log.emit(shed(0.0))
    assert caplog.records == []
    assert log.logged == 1


def test_invalid_settings():
    with pytest.raises(ValueError):
        ShedLog(interval=0)


@pytest.mark.looptime
async def test_run_writes_summaries_after_the_burst_ends(caplog):
    caplog.set_level(logging.INFO, logger="brownout.shed")
    events = EventHub()
    log = ShedLog(interval=10.0)
    events.subscribe(log)
    task = asyncio.create_task(log.run())
    loop = asyncio.get_running_loop()
    for _ in range(3):
        events.emit(shed(loop.time()))
    await asyncio.sleep(25)
    [summary] = records(caplog, "shed_summary")
    assert summary.shed == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hub is not events


def test_bounded_summary_tables_under_100k_distinct_callers_and_operations(caplog):
    """The per-interval summary counts at most 1,000 callers and operations each, the rest
    as "other"; the token bucket keeps the log volume to ``burst`` + ``rate`` x seconds."""
    caplog.set_level(logging.INFO, logger="brownout.shed")
    log = ShedLog(rate=5.0, burst=20, interval=10.0)
    for i in range(100_000):
        log.emit(shed(i / 100_000, caller=f"tenant-{i}", op=f"/items/{i}"))
        assert len(log.by_caller) <= 1001 and len(log.by_operation) <= 1001
    assert log.by_caller["other"] == 99_000
    assert log.logged <= 20 + 5
    log.flush()
    assert log.by_caller == {} and log.by_operation == {}


def test_a_shed_caller_named_other_is_not_the_summary_overflow(caplog):
    """O4: past the summary's 1,000 callers, the rest count as "other"; a real caller named
    "other" keeps its own count, as "_other" (`brownout._stats.label_value`)."""
    caplog.set_level(logging.INFO, logger="brownout.shed")
    log = ShedLog(rate=5.0, burst=20, interval=100.0)
    log.emit(shed(0.0, caller="other"))
    for i in range(1_200):
        log.emit(shed(i / 1_000, caller=f"tenant-{i}"))
    log.emit(shed(1.5, caller="other"))
    assert log.by_caller["_other"] == 2
    assert log.by_caller["other"] == 1_200 - 999  # the tenants beyond the 1,000 slots
    assert sum(log.by_caller.values()) == log.shed == 1_202
