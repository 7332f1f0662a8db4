"""The event hub (O1): typed immutable events, cheap when unobserved, robust to broken sinks."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from brownout import Priority, Reason
from brownout.events import Event, EventHub, RequestShed


def shed() -> RequestShed:
    return RequestShed(
        1.0, "api", "checkout", Priority.CRITICAL, "alice", Reason.QUEUE_FULL, 0.2, 0.0
    )


def test_events_are_declared_frozen_for_the_type_checker() -> None:
    # Immutability is enforced by mypy --strict (run by the test command): the declaring
    # decorator is a dataclass_transform with frozen_default, so assignments are type errors.
    from brownout.events import _event

    spec = _event.__dataclass_transform__  # type: ignore[attr-defined]
    # PEP 681's runtime record of the decorator's arguments. Python 3.11's dataclass_transform
    # has no frozen_default parameter and keeps it in "kwargs"; 3.12 and later have the
    # parameter, so the key is at the top level (with False as its default).
    frozen = spec.get("frozen_default") or spec.get("kwargs", {}).get("frozen_default")
    assert frozen is True
    assert dataclasses.is_dataclass(shed())
    assert shed() == shed()
    assert hash(shed()) == hash(shed())


def test_hub_fans_out_and_reports_enabled() -> None:
    hub = EventHub()
    assert not hub.enabled
    got: list[Event] = []

    class Collect:
        def emit(self, event: Event) -> None:
            got.append(event)

    sink = hub.subscribe(Collect())
    hub.subscribe(sink)  # idempotent
    assert hub.enabled
    hub.emit(shed())
    assert len(got) == 1
    hub.unsubscribe(sink)
    assert not hub.enabled


def test_a_broken_sink_never_breaks_the_request(caplog: pytest.LogCaptureFixture) -> None:
    hub = EventHub()
    got: list[Event] = []

    class Broken:
        def emit(self, event: Event) -> None:
            raise RuntimeError("exporter down")

    class Collect:
        def emit(self, event: Event) -> None:
            got.append(event)

    hub.subscribe(Broken())
    hub.subscribe(Collect())
    with caplog.at_level(logging.ERROR, logger="brownout.events"):
        hub.emit(shed())
        hub.emit(shed())
    assert len(got) == 2
    assert sum("raised" in r.message for r in caplog.records) == 1  # logged once, not per event


def test_bounded_ledgers_of_discarded_bulkheads_are_not_kept() -> None:
    """A hub remembers the ledgers that emit on it weakly: 10,000 bulkheads made and
    discarded (per request, by mistake) leave nothing on the hub."""
    import gc

    from brownout import Bulkhead, Stats
    from brownout.limits import FixedLimit

    hub = EventHub()
    stats = hub.subscribe(Stats())
    for i in range(10_000):
        b = Bulkhead(f"b{i}", FixedLimit(1), events=hub)
        b.try_admit(caller=f"c{i}").success()  # makes its ledger
        del b
    gc.collect()
    # Held only until a flush emits what they counted. One GC pass may adopt many at once;
    # the next ledger made forces a flush once more than 64 wait.
    probe = Bulkhead("probe", FixedLimit(1), events=hub)
    probe.try_admit(caller="p").success()
    # private: tally ledgers held for a flush show only as memory (their counts are checked)
    assert len(hub._orphans) <= 65 and len(hub._ledgers) <= 66
    assert stats.count("completed") == 10_001  # a read flushes: none was lost
    del probe
    gc.collect()
    stats.count("completed")  # flushes what the probe left
    assert len(hub._ledgers) == 0 and len(hub._orphans) == 0


def test_a_discarded_bulkhead_keeps_its_uncounted_requests() -> None:
    # O1: a bulkhead dropped between two flushes (reconfigured, made per tenant) took the
    # requests its ledger had not emitted yet with it: count("offered") was 0, not 10.
    import gc

    from brownout import Bulkhead, Stats
    from brownout.limits import FixedLimit

    hub = EventHub()
    stats = hub.subscribe(Stats())
    b = Bulkhead("tenant-7", FixedLimit(4), events=hub)
    for _ in range(10):
        b.try_admit(caller="c").success()
    del b
    gc.collect()
    assert stats.count("offered", source="tenant-7") == 10
    assert stats.count("completed", source="tenant-7") == 10
