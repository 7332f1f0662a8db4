"""Overload signals and the OverloadManager (A7, S1, S3)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import Bulkhead, OverloadLevel, OverloadManager, Priority, Reason, Rejected
from brownout.events import Event, EventHub, OverloadLevelChanged
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.signals import (
    EventLoopLag,
    FileDescriptors,
    FunctionSignal,
    InFlight,
    MemoryPressure,
    QueueAge,
    cgroup_memory_limit,
)
from brownout.testing import ManualClock


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


def fake_proc(tmp_path: Path, *, cgroup: str, statm_pages: int = 1000) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "statm").write_text(f"5000 {statm_pages} 300 1 0 900 0\n")
    return proc


def test_cgroup_v2_limit_of_own_cgroup(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cgroup="0::/app.slice/svc\n")
    cg = tmp_path / "cg"
    (cg / "app.slice" / "svc").mkdir(parents=True)
    (cg / "app.slice" / "svc" / "memory.max").write_text("536870912\n")
    (cg / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc, cg) == 512 * 1024 * 1024


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cgroup="4:memory:/docker/abc\n0::/\n")
    cg = tmp_path / "cg"
    (cg / "memory" / "docker" / "abc").mkdir(parents=True)
    (cg / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert cgroup_memory_limit(proc, cg) == 1 << 30
    (cg / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_limit(proc, cg) is None  # "unlimited" in v1


def test_memory_pressure_reads_statm_against_limit(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, cgroup="0::/\n", statm_pages=2560)
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(str(100 * os.sysconf("SC_PAGE_SIZE") * 256) + "\n")
    sig = MemoryPressure(proc_root=proc, cgroup_root=cg)
    assert sig.read() == pytest.approx(2560 / (100 * 256))


def test_memory_pressure_of_this_process_is_real() -> None:
    sig = MemoryPressure()
    assert sig.resident_bytes() > 1_000_000
    assert 0.0 < sig.read() < 1.0


def test_file_descriptors_real_and_injected(tmp_path: Path) -> None:
    real = FileDescriptors()
    before = real.open_count()
    with open(__file__) as _f1, open(__file__) as _f2:
        assert real.open_count() == before + 2
    assert real.limit == FileDescriptors.soft_limit()
    fds = tmp_path / "fd"
    fds.mkdir()
    for i in range(30):
        (fds / str(i)).touch()
    assert FileDescriptors(fd_dir=fds, limit=100).read() == pytest.approx(0.3)


def test_bulkhead_signals() -> None:
    clock = ManualClock()
    b = Bulkhead("db", FixedLimit(4), FifoQueue(4, 1.0), clock=clock)
    for _ in range(3):
        b.try_admit()
    assert InFlight(b).read() == pytest.approx(0.75)
    assert InFlight(b).name == "in_flight:db"
    assert QueueAge(b, max_age=0.5).read() == 0.0


async def test_event_loop_lag_probe_sees_a_blocked_loop() -> None:
    # real time: a loop blocked for 200 ms must read as at least 100 ms of lag
    probe = EventLoopLag(interval=0.01, max_lag=0.1)
    probe.start()
    try:
        await asyncio.sleep(0.03)
        time.sleep(0.2)  # a blocking call on the loop: what the probe exists to catch
        await asyncio.sleep(0.03)
        assert probe.peak >= 0.1
        assert probe.read() >= 1.0
    finally:
        probe.stop()
    assert not probe.running


def test_event_loop_lag_peak_decays() -> None:
    probe = EventLoopLag(max_lag=0.1, half_life=1.0)
    probe.observe(0.2)
    assert probe.read() == pytest.approx(2.0)
    probe.observe(0.0, elapsed=1.0)
    assert probe.read() == pytest.approx(1.0)
    for _ in range(5):
        probe.observe(0.0, elapsed=1.0)
    assert probe.read() < 0.1


def make_manager(values: dict[str, float], **kw: object) -> tuple[OverloadManager, Recorder]:
    events = EventHub()
    rec = Recorder()
    events.subscribe(rec)
    signals = [FunctionSignal(name, lambda n=name: values[n]) for name in values]
    clock = kw.pop("clock", ManualClock())
    m = OverloadManager(signals, events=events, clock=clock, **kw)  # type: ignore[arg-type]
    return m, rec


def test_levels_with_hysteresis_and_events() -> None:
    values = {"memory": 0.5, "lag": 0.1}
    clock = ManualClock()
    m, rec = make_manager(values, clock=clock, min_dwell=0.0)
    assert m.update() == 0 and m.shed_below == 0
    values["memory"] = 0.85
    assert m.update() == 1
    assert m.shed_below == Priority.SHEDDABLE_PLUS
    values["memory"] = 0.75  # below enter (0.8) but above exit (0.7): holds
    assert m.update() == 1
    values["lag"] = 1.2  # straight to the top level
    assert m.update() == 3
    assert m.shed_below == Priority.CRITICAL_PLUS
    values.update(memory=0.1, lag=0.1)
    assert m.update() == 0
    changes = [e for e in rec.events if isinstance(e, OverloadLevelChanged)]
    assert [(e.old, e.new) for e in changes] == [(0, 1), (1, 3), (3, 0)]
    assert changes[0].signals == ("memory",)
    assert changes[1].signals == ("lag",)  # memory (0.75) is below level 3's exit


def test_min_dwell_delays_stepping_down_only() -> None:
    values = {"x": 0.95}
    clock = ManualClock()
    m, _ = make_manager(values, clock=clock, min_dwell=2.0)
    assert m.update() == 2
    values["x"] = 0.0
    clock.advance(1.0)
    assert m.update() == 2
    clock.advance(1.5)
    assert m.update() == 0


def test_broken_signal_is_ignored() -> None:
    def boom() -> float:
        raise OSError("gone")

    m = OverloadManager([FunctionSignal("bad", boom), FunctionSignal("ok", lambda: 0.85)])
    assert m.update() == 1


def test_a_signal_reading_nan_is_ignored_like_a_broken_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A NaN reading is no reading (A7): it neither sheds nor hides a real signal, it is
    logged once, and the pressure table keeps no NaN for the exporters."""
    m = OverloadManager(
        [FunctionSignal("nan", lambda: math.nan), FunctionSignal("ok", lambda: 0.85)]
    )
    assert m.update() == 1
    assert m.update() == 1
    assert m.pressures == {"ok": 0.85}
    assert [r.getMessage() for r in caplog.records].count(
        "overload signal nan read NaN; ignoring it"
    ) == 1


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: OverloadManager([], interval=0.0), id="interval-0"),
        pytest.param(lambda: OverloadManager([], interval=math.nan), id="interval-nan"),
        pytest.param(lambda: OverloadManager([], interval=math.inf), id="interval-inf"),
        pytest.param(lambda: OverloadManager([], min_dwell=math.nan), id="dwell-nan"),
        pytest.param(lambda: OverloadManager([], min_dwell=-1.0), id="dwell-negative"),
        pytest.param(lambda: EventLoopLag(interval=math.nan), id="lag-interval-nan"),
        pytest.param(lambda: EventLoopLag(max_lag=math.inf), id="lag-max-inf"),
        pytest.param(lambda: EventLoopLag(half_life=math.nan), id="lag-half-life-nan"),
        pytest.param(lambda: MemoryPressure(limit_bytes=math.nan), id="memory-nan"),  # type: ignore[arg-type]
        pytest.param(lambda: FileDescriptors(limit=math.nan), id="fds-nan"),  # type: ignore[arg-type]
        pytest.param(
            lambda: QueueAge(Bulkhead("q", FixedLimit(1)), max_age=math.nan), id="age-nan"
        ),
        pytest.param(
            lambda: QueueAge(Bulkhead("q", FixedLimit(1)), max_age=math.inf), id="age-inf"
        ),
    ],
)
def test_overload_settings_that_would_switch_shedding_off_or_on_for_good_are_refused(
    build: object,
) -> None:
    """A NaN min_dwell never steps down (sheds for good); a zero or NaN interval spins the
    loop or corrupts its timers; a NaN or infinite scale reads as no pressure, ever."""
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_subscribers_and_force() -> None:
    m, _ = make_manager({"x": 0.0})
    seen: list[tuple[int, int]] = []
    unsubscribe = m.subscribe(lambda old, new: seen.append((old, new)))
    m.force(2)
    assert m.sheds(Priority.SHEDDABLE_PLUS) and not m.sheds(Priority.CRITICAL)
    unsubscribe()
    m.force(0)
    assert seen == [(0, 2)]
    with pytest.raises(ValueError):
        m.force(9)
    with pytest.raises(ValueError):
        OverloadLevel(0.5, 0.6, Priority.CRITICAL)


async def test_bulkhead_sheds_below_the_level_and_keeps_critical_plus() -> None:
    values = {"memory": 0.0}
    m, _ = make_manager(values)
    b = Bulkhead("api", FixedLimit(8), FifoQueue(8, 1.0))
    m.attach(b)
    values["memory"] = 1.0
    m.update()
    for priority in (Priority.SHEDDABLE, Priority.SHEDDABLE_PLUS, Priority.CRITICAL):
        with pytest.raises(Rejected) as info:
            async with b.admit(priority=priority):
                pass
        assert info.value.reason is Reason.OVERLOADED
    async with b.admit(priority=Priority.CRITICAL_PLUS):  # health checks still answered (S7)
        pass


@pytest.mark.looptime
async def test_manager_runs_periodically() -> None:
    values = {"x": 0.0}
    m, _ = make_manager(values, clock=None, interval=0.25)
    async with m:
        await asyncio.sleep(0.1)
        assert m.level == 0
        values["x"] = 0.9
        await asyncio.sleep(0.3)
        assert m.level == 2
    assert m.level == 0  # stopped: back to level 0 ...
    values["x"] = 0.9
    await asyncio.sleep(1.0)
    assert m.level == 0  # ... and no periodic update runs any more


def test_manager_gauges() -> None:
    m, _ = make_manager({"memory": 0.85})
    m.update()
    assert list(m.gauges()) == [
        ("overload_level", {"source": "overload"}, 1.0),
        ("overload_pressure", {"source": "overload", "signal": "memory"}, 0.85),
    ]


@pytest.mark.looptime
async def test_stopped_overload_manager_stops_shedding() -> None:
    """A7: a stopped manager reads no signal any more; it must not keep shedding at the level
    it last saw (nothing would ever lower it), and its subscribers must hear the level drop."""
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    pressure = {"x": 1.0}
    m = OverloadManager([FunctionSignal("x", lambda: pressure["x"])], interval=0.25, events=hub)
    api = Bulkhead("api", FixedLimit(4), FifoQueue(4, 1.0))
    m.attach(api)
    async with m:
        await asyncio.sleep(0.5)
        assert m.level == 3
    assert m.level == 0 and m.shed_below == 0
    async with api.admit(priority=Priority.SHEDDABLE):  # not refused as OVERLOADED
        pass
    changes = [(e.old, e.new) for e in rec.events if isinstance(e, OverloadLevelChanged)]
    assert changes[-1] == (3, 0)


DOC_TABLE = {0: set(), 1: {Priority.SHEDDABLE}, 2: {Priority.SHEDDABLE, Priority.SHEDDABLE_PLUS}}
DOC_TABLE[3] = DOC_TABLE[2] | {Priority.CRITICAL}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    dwell=st.sampled_from([0.0, 0.5]),
    steps=st.lists(
        st.tuples(st.floats(0.0, 1.2), st.sampled_from([0.0, 0.1, 0.3, 0.6])), max_size=40
    ),
)
def test_levels_follow_the_documented_thresholds_and_shed_the_table(
    dwell: float, steps: list[tuple[float, float]]
) -> None:
    """A7/S1 on random pressure: up at once to the highest level entered; down only below
    the exit thresholds and not before ``min_dwell``; each level sheds exactly the priorities
    of the table in docs/admission.md, and every change is one event."""
    values = {"x": 0.0}
    clock = ManualClock()
    m, rec = make_manager(values, clock=clock, min_dwell=dwell)
    levels = m.levels
    changed_at = -math.inf
    changes = 0
    for pressure, gap in steps:
        clock.advance(gap)
        values["x"] = pressure
        old = m.level
        new = m.update()
        if new > old:
            assert pressure >= levels[new - 1].enter
        if new < old:
            assert clock.now() - changed_at >= dwell
            assert all(pressure < levels[i].exit for i in range(new, old))
        if new > 0 and new <= old:
            assert pressure >= levels[new - 1].exit or clock.now() - changed_at < dwell
        assert new == len(levels) or pressure < levels[new].enter
        if new != old:
            changed_at = clock.now()
            changes += 1
        assert {p for p in Priority if m.sheds(p)} == DOC_TABLE[new]
    assert len([e for e in rec.events if isinstance(e, OverloadLevelChanged)]) == changes
