"""Declared degraded modes (G1, G2, A7): triggers, hysteresis, dwell, max duration, events,
fallbacks and caller-visible metadata, on virtual time (ManualClock, looptime)."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import DegradedMode, DegradedModes
from brownout.events import DegradedModeChanged, Event, EventHub
from brownout.testing import ManualClock


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def changes(self) -> list[tuple[str, bool, str]]:
        return [
            (e.mode, e.active, e.trigger) for e in self.events if isinstance(e, DegradedModeChanged)
        ]


class FakeManager:
    """Anything with ``.level`` and ``.subscribe(cb)``: the overload manager's shape."""

    def __init__(self) -> None:
        self.level = 0
        self.callbacks: list[Any] = []

    def subscribe(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def move(self, level: int) -> None:
        old, self.level = self.level, level
        for cb in self.callbacks:
            cb(old, level)  # the callback's arguments are not relied upon


def make(
    *modes: DegradedMode, clock: ManualClock | None = None
) -> tuple[DegradedModes, ManualClock, Recorder]:
    clock = clock or ManualClock()
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    return DegradedModes(modes, clock=clock, events=hub), clock, rec


RECS = DegradedMode(
    "recommendations",
    "hide personalised recommendations",
    enter_at_level=1,
    min_dwell=30.0,
    max_duration=600.0,
)
SEARCH = DegradedMode(
    "search-small-corpus", "search the hot shard only", enter_at_level=2, max_staleness=60.0
)


def test_declarations_are_validated() -> None:
    with pytest.raises(ValueError, match="header-safe"):
        DegradedMode("two words", "x")
    with pytest.raises(ValueError, match="description"):
        DegradedMode("a", " ")
    with pytest.raises(ValueError, match="hysteresis"):
        DegradedMode("a", "x", enter_at_level=2, leave_at_level=2)
    with pytest.raises(ValueError, match="max_duration"):
        DegradedMode("a", "x", min_dwell=10, max_duration=5)
    with pytest.raises(ValueError, match="twice"):
        DegradedModes([RECS, RECS])
    assert RECS.leave_at_level == 0  # default hysteresis: one level below
    modes, _, _ = make(RECS)
    with pytest.raises(KeyError, match="not declared"):
        modes.active("nope")


def test_follow_levels_enter_fast_leave_after_dwell() -> None:
    """G2: the overload level (the metric that starts and ends the mode) drives it."""
    modes, clock, rec = make(RECS, SEARCH)
    manager = FakeManager()
    modes.follow(manager)
    assert modes.active_names() == ()

    manager.move(1)
    assert modes.active("recommendations")
    assert not modes.active("search-small-corpus")
    manager.move(2)
    assert modes.active_names() == ("recommendations", "search-small-corpus")
    assert modes.header_value() == "recommendations, search-small-corpus"
    assert modes.problem_fields() == {"degraded": ["recommendations", "search-small-corpus"]}

    clock.advance(5)
    manager.move(0)
    # search has no dwell: leaves at once; recommendations must dwell 30 s.
    assert modes.active_names() == ("recommendations",)
    clock.advance(24.9)
    assert modes.active("recommendations")
    clock.advance(0.1)  # 30 s since it entered
    assert not modes.active("recommendations")
    assert modes.active_names() == ()
    assert rec.changes() == [
        ("recommendations", True, "level 1"),
        ("search-small-corpus", True, "level 2"),
        ("search-small-corpus", False, "level 0"),
        ("recommendations", False, "level 0"),
    ]


def test_hysteresis_band_does_not_flap() -> None:
    mode = DegradedMode("m", "x", enter_at_level=3, leave_at_level=1)
    modes, _, rec = make(mode)
    for level in (3, 2, 3, 2, 2, 3):  # oscillating inside the band keeps it on
        modes.set_level(level)
        assert modes.active("m")
    modes.set_level(1)
    assert not modes.active("m")
    modes.set_level(2)  # below the entry level: stays off
    assert not modes.active("m")
    assert [c[1] for c in rec.changes()] == [True, False]


def test_dwell_stops_flapping_on_a_noisy_level() -> None:
    mode = DegradedMode("m", "x", enter_at_level=1, min_dwell=10.0)
    modes, clock, rec = make(mode)
    for _ in range(50):  # the level flips every second for 50 s
        modes.set_level(1)
        clock.advance(0.5)
        modes.set_level(0)
        clock.advance(0.5)
        modes.active("m")
    # The level changed 100 times; the mode changes at most once per dwell period, and
    # every stay lasts at least the dwell.
    changes = [e for e in rec.events if isinstance(e, DegradedModeChanged)]
    assert 2 <= len(changes) <= 2 * 50 // 10
    for entered, left in zip(changes[::2], changes[1::2]):
        assert entered.active and not left.active
        assert left.at - entered.at >= 10.0


def test_demand_returning_within_dwell_keeps_the_mode() -> None:
    modes, clock, rec = make(RECS)
    modes.set_level(1)
    clock.advance(10)
    modes.set_level(0)
    clock.advance(10)
    modes.set_level(1)  # back before the dwell ended
    clock.advance(100)
    assert modes.active("recommendations")
    assert len(rec.changes()) == 1


def test_max_duration_ends_the_mode_and_latches_until_clear() -> None:
    modes, clock, rec = make(RECS)
    modes.set_level(2)
    clock.advance(599)
    assert modes.active("recommendations")
    clock.advance(1)
    assert not modes.active("recommendations")
    assert rec.changes()[-1] == ("recommendations", False, "max_duration")
    modes.set_level(2)  # still overloaded: does not re-enter until the trigger clears
    clock.advance(50)
    assert not modes.active("recommendations")
    modes.set_level(0)
    modes.set_level(1)
    assert modes.active("recommendations")


def test_signal_predicate_with_its_own_hysteresis() -> None:
    """A7: local pressure (here a fake memory reading) enters and leaves a mode."""
    memory = {"used": 0.5}
    mode = DegradedMode(
        "no-thumbnails",
        "serve pages without generated thumbnails",
        enter_when=lambda: memory["used"] > 0.9,
        leave_when=lambda: memory["used"] < 0.7,
        poll_interval=1.0,
    )
    modes, clock, rec = make(mode)
    assert not modes.active("no-thumbnails")
    memory["used"] = 0.95
    assert not modes.active("no-thumbnails")  # not polled again yet
    clock.advance(1)
    assert modes.active("no-thumbnails")
    memory["used"] = 0.8  # inside the band
    clock.advance(5)
    assert modes.active("no-thumbnails")
    memory["used"] = 0.6
    clock.advance(1)
    assert not modes.active("no-thumbnails")
    assert rec.changes() == [
        ("no-thumbnails", True, "signal"),
        ("no-thumbnails", False, "signal"),
    ]


def test_broken_predicate_keeps_last_answer() -> None:
    def boom() -> bool:
        raise RuntimeError("sensor down")

    modes, clock, _ = make(DegradedMode("m", "x", enter_when=boom))
    clock.advance(5)
    assert not modes.active("m")


def test_force_overrides_triggers_and_dwell() -> None:
    modes, clock, rec = make(RECS)
    modes.force("recommendations", on=True)
    assert modes.active("recommendations")
    assert modes.forced("recommendations") is True
    modes.set_level(0)
    clock.advance(100)
    assert modes.active("recommendations")
    modes.release("recommendations")  # no trigger asks for it: leaves now, dwell or not
    assert not modes.active("recommendations")
    modes.set_level(3)
    modes.force("recommendations", on=False, trigger="operator")
    assert not modes.active("recommendations")
    modes.force("recommendations", None)
    assert modes.active("recommendations")  # the level still asks for it
    assert [c[2] for c in rec.changes()] == ["manual", "manual", "level 3", "operator", "level 3"]


def test_forced_on_ends_at_max_duration() -> None:
    """A forgotten drill cannot degrade the service forever."""
    modes, clock, rec = make(RECS)
    modes.force("recommendations", on=True, trigger="drill")
    clock.advance(600)
    assert not modes.active("recommendations")
    assert modes.forced("recommendations") is None
    assert rec.changes()[-1] == ("recommendations", False, "force_expired")
    modes.force("recommendations", on=True, duration=5)
    clock.advance(5)
    assert not modes.active("recommendations")


def test_unobserved_hub_builds_no_events() -> None:
    hub = EventHub()
    modes = DegradedModes([RECS], clock=ManualClock(), events=hub)
    modes.set_level(1)  # no sink: nothing to assert but that it works and stays cheap
    assert modes.active("recommendations")


def test_follow_replaces_previous_source() -> None:
    modes, _, _ = make(RECS)
    a, b = FakeManager(), FakeManager()
    modes.follow(a)
    modes.follow(b)
    a.move(3)
    assert not modes.active("recommendations")
    b.move(1)
    assert modes.active("recommendations")
    modes.unfollow()
    b.move(0)
    assert modes.active("recommendations")  # dwell still holds it
    snap = modes.snapshot()["recommendations"]
    assert snap["active"] is True
    assert (snap["enter_at_level"], snap["leave_at_level"], snap["min_dwell"]) == (1, 0, 30.0)
    assert snap["max_duration"] == 600.0
    assert snap["description"] == "hide personalised recommendations"


async def test_fallback_swaps_async_and_sync() -> None:
    modes, _, _ = make(RECS)

    @modes.fallback("recommendations", lambda user: [])
    async def recommendations(user: str) -> list[str]:
        return [f"for {user}"]

    async def slow_fallback(user: str) -> list[str]:
        return ["popular"]

    @modes.fallback("recommendations", slow_fallback)
    async def recommendations2(user: str) -> list[str]:
        return [f"for {user}"]

    @modes.fallback("recommendations", lambda: "static")
    def banner() -> str:
        return "personal"

    assert await recommendations("ann") == ["for ann"]
    assert banner() == "personal"
    modes.force("recommendations", on=True)
    assert await recommendations("ann") == []
    assert await recommendations2("ann") == ["popular"]
    assert banner() == "static"
    assert modes.fallbacks_served("recommendations") == 3
    with pytest.raises(KeyError):
        modes.fallback("undeclared", lambda: None)


@pytest.mark.looptime
async def test_loop_timer_reports_leaving_on_time_without_requests() -> None:
    """With the loop's clock, the end of the dwell is reported even if nobody asks."""
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    modes = DegradedModes([RECS], events=hub)  # default clock: the loop's (virtual) time
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    modes.set_level(1)
    modes.set_level(0)
    await asyncio.sleep(31)
    changes = [e for e in rec.events if isinstance(e, DegradedModeChanged)]
    assert [(e.active, e.trigger) for e in changes] == [(True, "level 1"), (False, "level 0")]
    assert changes[1].at - t0 == pytest.approx(30.0)


@pytest.mark.looptime
async def test_run_polls_predicates() -> None:
    flag = {"on": False}
    modes = DegradedModes(
        [DegradedMode("m", "x", enter_when=lambda: flag["on"], poll_interval=0.5)],
        events=EventHub(),
    )
    task = asyncio.create_task(modes.run(interval=0.5))
    await asyncio.sleep(1)
    flag["on"] = True
    await asyncio.sleep(1)
    assert modes.snapshot()["m"]["active"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=3), st.floats(min_value=0, max_value=40)),
        min_size=1,
        max_size=40,
    )
)
def test_property_dwell_duration_and_demand(steps: list[tuple[int, float]]) -> None:
    """For any level history: stays last at least min_dwell (unless cut by max_duration), a
    mode is never seen active past max_duration, changes alternate, and demand is served
    unless the max_duration latch holds it out. (Without a loop timer, changes are decided,
    and stamped, when next observed.)"""
    mode = DegradedMode(
        "m", "x", enter_at_level=2, leave_at_level=0, min_dwell=10, max_duration=100
    )
    modes, clock, rec = make(mode)
    for level, dt in steps:
        modes.set_level(level)
        clock.advance(dt)
        active = modes.active("m")
        if level >= 2 and not active:
            assert rec.changes()[-1][2] == "max_duration"  # only the latch keeps it out
        since = modes.since("m")
        if since is not None:
            assert clock.now() - since < 100  # never observed active past max_duration
    modes.evaluate()
    changes = [e for e in rec.events if isinstance(e, DegradedModeChanged)]
    for i, e in enumerate(changes):
        assert e.active == (i % 2 == 0)
    for entered, left in zip(changes[::2], changes[1::2]):
        stay = left.at - entered.at
        if left.trigger != "max_duration":
            assert stay >= 10 - 1e-9


def test_follows_the_real_overload_manager() -> None:
    """Issue 3's OverloadManager drives the modes through its subscribe hook; unfollowing
    unsubscribes."""
    from brownout import OverloadManager
    from brownout.signals import FunctionSignal

    pressure = {"p": 0.0}
    clock = ManualClock()
    manager = OverloadManager(
        [FunctionSignal("memory", lambda: pressure["p"])],
        min_dwell=1.0,
        clock=clock,
        events=EventHub(),
    )
    modes, _, rec = make(RECS, SEARCH, clock=clock)
    modes.follow(manager)
    pressure["p"] = 0.85
    manager.update()
    assert modes.active_names() == ("recommendations",)
    pressure["p"] = 0.95
    manager.update()
    assert modes.active_names() == ("recommendations", "search-small-corpus")
    pressure["p"] = 0.1
    clock.advance(2)
    manager.update()
    assert manager.level == 0
    assert modes.active_names() == ("recommendations",)  # dwelling
    clock.advance(30)
    assert modes.active_names() == ()
    modes.unfollow()
    pressure["p"] = 0.95
    manager.update()
    assert modes.active_names() == ()  # no longer subscribed
    assert [c[2] for c in rec.changes()] == ["level 1", "level 2", "level 0", "level 0"]


def test_due_timers_work_on_uvloop() -> None:
    """uvloop's call_at returns a plain Handle (no ``when()``) for an instant already due; the
    lab's front runs on uvloop and crashed on the second reschedule (seen in the default lab)."""
    import uvloop

    from brownout import DegradedMode, DegradedModes

    async def scenario() -> list[str]:
        mode = DegradedMode("recs", "hide recommendations", enter_at_level=1, min_dwell=0.0002)
        modes = DegradedModes([mode])
        modes.set_level(1)
        modes.set_level(0)  # leaving is due in 0.2 ms: uvloop rounds to 0 ms, a plain Handle
        modes.evaluate()  # reschedules while that timer is still pending
        modes.set_level(1)
        await asyncio.sleep(0)
        return list(modes.active_names())

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(scenario()) == ["recs"]
    finally:
        loop.close()


@pytest.mark.looptime
async def test_discarded_modes_registry_stops_polling_and_announcing() -> None:
    """G2: the loop timer of a registry nobody holds any more must not keep it alive, polling
    its predicates and emitting mode changes for ever (a reconfigured service leaks one per
    reload)."""
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    calls: list[float] = []
    flag = {"on": False}

    def signal() -> bool:
        calls.append(asyncio.get_running_loop().time())
        return flag["on"]

    modes = DegradedModes(
        [DegradedMode("m", "hide m", enter_when=signal, poll_interval=0.1)], events=hub
    )
    await asyncio.sleep(0.35)
    assert calls  # polled while in use
    del modes
    gc.collect()
    seen = len(calls)
    flag["on"] = True
    await asyncio.sleep(1.0)
    assert len(calls) == seen
    assert rec.events == []


def test_a_drill_does_not_restart_a_mode_that_reached_max_duration() -> None:
    """G2: at max_duration a mode leaves and stays out until its trigger clears once. A drill
    (or an operator) that forces it on and then releases it must not leave it on: it used
    to stay active, silently, for another max_duration (found by test_degrade_properties)."""
    modes, clock, rec = make(RECS)
    modes.set_level(2)
    clock.advance(600)
    assert not modes.active("recommendations")  # max_duration: out, latched
    modes.force("recommendations", on=True, trigger="drill")
    assert modes.active("recommendations")
    clock.advance(5)
    modes.release("recommendations")  # the level still asks, but the latch holds it out
    assert not modes.active("recommendations")
    assert rec.changes()[-2:] == [
        ("recommendations", True, "drill"),
        ("recommendations", False, "manual"),
    ]
    modes.set_level(0)
    modes.set_level(1)  # the trigger cleared once: the mode may enter again
    assert modes.active("recommendations")


def test_a_trigger_that_clears_during_an_override_lets_go_of_the_latch() -> None:
    """G2: "stays out until its trigger has cleared once" holds while a mode is forced off
    too: the level fell and rose again during the override, so on release the mode enters.
    It used to stay out, the clearing unseen because the override skipped the latch."""
    modes, clock, rec = make(RECS)
    modes.set_level(2)
    clock.advance(600)
    assert not modes.active("recommendations")  # latched out
    modes.force("recommendations", on=False, trigger="operator")
    modes.set_level(0)
    modes.set_level(2)
    modes.release("recommendations")
    assert modes.active("recommendations")
    assert rec.changes()[-1] == ("recommendations", True, "level 2")


def test_a_reader_on_another_thread_only_reads() -> None:
    # A Prometheus server thread reads gauges while the loop drives the modes: it ran
    # evaluate() there, polling predicates and switching modes (emitting events) off the loop.
    polled_on: set[int] = set()
    flag = {"on": False}

    def signal() -> bool:
        polled_on.add(threading.get_ident())
        return flag["on"]

    modes, clock, rec = make(DegradedMode("m", "x", enter_when=signal, poll_interval=0.1))
    list(modes.gauges())  # the owner's thread: evaluates (polls) as before
    assert polled_on == {threading.get_ident()}
    flag["on"] = True
    clock.advance(1.0)
    seen: list[Any] = []
    reader = threading.Thread(target=lambda: seen.append((list(modes.gauges()), modes.snapshot())))
    reader.start()
    reader.join(10)
    assert polled_on == {threading.get_ident()}, "a predicate was polled on the reader's thread"
    gauges, snapshot = seen[0]
    assert ("degraded_mode_active", {"mode": "m"}, 0.0) in gauges  # as last evaluated
    assert snapshot["m"]["active"] is False and rec.events == []
    modes.evaluate()  # the loop's turn: now it switches
    assert modes.active("m")
