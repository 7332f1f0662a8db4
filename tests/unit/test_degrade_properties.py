"""Property tests of graceful degradation on virtual time (G1 to G4, O2).

Hypothesis draws configurations and timelines and drives the real pieces: a `StaleCache`
whose origin succeeds, fails, hangs, fails closed or is slow, read by concurrent callers that
give up, with keys invalidated and evicted (looptime); `DegradedModes` whose levels, signals
and overrides move on a `ManualClock`, checked against a model written from
docs/degradation.md; drills started and ended around fallbacks that do or do not call the
failed dependency; and `FailClosedGuard` reads whose source answers, fails, raises, hangs
or is cancelled by its caller. After each run every invariant below is checked; each names
the MISSION requirement it stands for.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import looptime
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import FailClosed, StaleCache
from brownout.events import Event, EventHub, StaleServed

FAST = settings(max_examples=200, deadline=None, derandomize=True)
HANG = 10_000.0  # "never answers" on the scale of these timelines
EPS = 1e-9


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


def hub_with_sink() -> tuple[EventHub, Sink]:
    hub = EventHub()
    sink = Sink()
    hub.subscribe(sink)
    return hub, sink


def run_on_virtual_time(main: Any) -> None:
    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


# == StaleCache (G1, G4, O2) ===================================================================

KEYS = "abc"
ORIGIN = st.tuples(
    st.sampled_from(["ok", "ok", "ok", "fail", "hang", "fail_closed"]),
    st.sampled_from([0, 2, 2, 4, 7]),  # seconds the origin takes (mostly even: ties are likely)
)
BOUNDS = st.one_of(
    st.none(),
    st.tuples(st.sampled_from([0, 2, 6]), st.sampled_from([0, 4, 12])).map(
        lambda b: (b[0], b[0] + b[1])
    ),
)
READ = st.tuples(
    st.just("read"),
    st.sampled_from(KEYS),
    st.one_of(st.none(), st.sampled_from([1, 2, 5])),  # the caller's patience
    BOUNDS,  # per-call fresh_for / max_staleness, as a degraded mode passes them
)
CACHE_OP = st.one_of(
    READ,
    READ,
    READ,
    st.tuples(st.just("origin"), st.sampled_from(KEYS), ORIGIN),
    st.tuples(st.just("invalidate"), st.sampled_from(KEYS)),
)
CACHE_CONFIG = st.fixed_dictionaries(
    {
        "max_entries": st.integers(1, 3),
        "fresh_for": st.sampled_from([0, 1, 2, 5]),
        "extra_staleness": st.sampled_from([0, 3, 10]),
        "load_timeout": st.sampled_from([None, None, 2, 5]),
        "failure_backoff": st.sampled_from([0, 1, 3]),
        "origins": st.lists(ORIGIN, min_size=len(KEYS), max_size=len(KEYS)),
    }
)


@dataclass
class Load:
    key: str
    start: float
    background: bool
    end: float | None = None
    outcome: str = ""
    task: asyncio.Task[Any] | None = None


@dataclass
class Read:
    key: str
    start: float
    fresh: float
    limit: float
    servable: tuple[Any, float] | None  # what `peek` said was servable as the call began
    value: Any = None
    age: float | None = None
    error: BaseException | None = None
    end: float | None = None


@dataclass
class CacheRun:
    config: dict[str, Any]
    loads: list[Load] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)  # in the order they returned
    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    after_give_up: list[Read] = field(default_factory=list)
    tasks_left: int = 0


def drive_cache(config: dict[str, Any], script: list[tuple[int, tuple[Any, ...]]]) -> CacheRun:
    run = CacheRun(config)
    hub, sink = hub_with_sink()
    max_entries = config["max_entries"]
    cache: StaleCache[str, tuple[str, int]] = StaleCache(
        max_entries=max_entries,
        fresh_for=config["fresh_for"],
        max_staleness=config["fresh_for"] + config["extra_staleness"],
        load_timeout=config["load_timeout"],
        failure_backoff=config["failure_backoff"],
        name="content",
        events=hub,
    )
    origin: dict[str, tuple[str, int]] = dict(zip(KEYS, config["origins"], strict=True))

    def loader_for(key: str) -> Any:
        async def load() -> tuple[str, int]:
            loop = asyncio.get_running_loop()
            me = asyncio.current_task()
            # Single flight (G1): no other load of this key is running unless it was
            # cancelled (its last caller gave up, or its key was evicted).
            for other in run.loads:
                if (
                    other.key == key
                    and other.end is None
                    and other.task is not None
                    and not other.task.cancelling()
                    and other.task is not me
                ):
                    run.problems.append(f"two loads of {key!r} at t={loop.time()}")
            op = brownout.current().operation or ""
            record = Load(key, loop.time(), op.startswith("refresh:"), task=me)
            run.loads.append(record)
            n = len(run.loads) - 1
            mode, delay = origin[key]
            try:
                await asyncio.sleep(HANG if mode == "hang" else delay)
                if mode == "fail":
                    raise ConnectionError(f"{key} origin down")
                if mode == "fail_closed":
                    raise FailClosed("authorization")
                record.outcome = "ok"
                return (key, n)
            except asyncio.CancelledError:
                record.outcome = "cancelled"
                raise
            except Exception:
                record.outcome = "failed"
                raise
            finally:
                record.end = loop.time()

        return load

    loaders = {k: loader_for(k) for k in KEYS}

    async def read(key: str, patience: int | None, bounds: tuple[int, int] | None) -> Read:
        loop = asyncio.get_running_loop()
        fresh = cache.fresh_for if bounds is None else bounds[0]
        limit = cache.max_staleness if bounds is None else bounds[1]
        peeked = cache.peek(key, max_staleness=limit)
        r = Read(key, loop.time(), fresh, limit, None if peeked is None else tuple(peeked))
        kw: dict[str, float] = (
            {} if bounds is None else {"fresh_for": fresh, "max_staleness": limit}
        )
        try:
            if patience is None:
                r.value, r.age = await cache.get(key, loaders[key], **kw)
            else:
                async with asyncio.timeout(patience):
                    r.value, r.age = await cache.get(key, loaders[key], **kw)
        except BaseException as error:  # recorded, judged below
            r.error = error
        r.end = loop.time()
        run.reads.append(r)
        return r

    def check_bounds() -> None:
        if len(cache) > max_entries:
            run.problems.append(f"{len(cache)} entries > max_entries {max_entries}")
        running_bg = sum(1 for ld in run.loads if ld.end is None and ld.background)
        if running_bg > max_entries:
            run.problems.append(f"{running_bg} background refreshes > {max_entries}")

    async def main() -> None:
        tasks: list[asyncio.Task[Read]] = []
        for dt, op in script:
            await asyncio.sleep(dt)
            check_bounds()
            if op[0] == "read":
                tasks.append(asyncio.create_task(read(op[1], op[2], op[3])))
            elif op[0] == "origin":
                origin[op[1]] = op[2]
            else:
                cache.invalidate(op[1])
            await asyncio.sleep(0)
        await asyncio.sleep(20)
        check_bounds()
        for t in tasks:  # the callers still waiting (on hung loads) go away
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Liveness (G1, D5): the origin is back; a hung refresh must not pin a key. The first
        # caller may join a hung load and give up; the next one must be answered.
        for k in KEYS:
            origin[k] = ("ok", 0)
        for k in KEYS:
            first = await read(k, 1, None)
            second = await read(k, 1, None)
            if first.error is not None and second.error is not None:
                run.problems.append(f"key {k!r} pinned: {second.error!r} after a caller gave up")
            run.after_give_up.append(second)
        await asyncio.sleep(HANG * 2)
        check_bounds()
        run.tasks_left = len(asyncio.all_tasks()) - 1
        run.events = sink.events

    run_on_virtual_time(main)
    return run


def check_cache(run: CacheRun) -> list[str]:
    bad = list(run.problems)
    served_order: dict[str, float] = {}
    answers_older_than_fresh = 0
    for r in run.reads:
        assert r.end is not None
        if r.error is not None:
            # G1/G4: a caller only gets an error when nothing servable was in memory.
            if r.servable is not None:
                bad.append(f"{r.key}@{r.start}: error {r.error!r} though {r.servable} servable")
            continue
        key, n = r.value
        load = run.loads[n]
        if key != r.key:
            bad.append(f"read of {r.key!r} answered with {r.value}")
        true_age = r.end - load.start  # the age of content counts from when its load began
        if r.age is None or abs(r.age - true_age) > 1e-6:
            bad.append(f"{r.key}@{r.end}: reported age {r.age}, content is {true_age} old")
        if r.servable is not None:
            # Something servable was in memory: answered at once, with it (G1).
            if (r.value, r.age) != r.servable or r.end != r.start:
                bad.append(f"{r.key}@{r.start}: servable {r.servable}, got {r.value, r.age}")
            if true_age > r.limit + EPS:
                bad.append(f"{r.key}@{r.end}: served {true_age} old > {r.limit}")
        else:
            # Nothing servable: the answer comes from a load running when the caller asked.
            if load.end is None or load.end < r.start or load.start > r.end:
                bad.append(f"{r.key}@{r.start}: answered by load {n} ({load}) not in flight")
        # Consistency: what callers see of one key never goes back to older content.
        if load.start < served_order.get(r.key, -math.inf):
            bad.append(f"{r.key}@{r.end}: went back to content of t={load.start}")
        served_order[r.key] = max(load.start, served_order.get(r.key, -math.inf))
        if true_age > r.fresh + EPS:
            answers_older_than_fresh += 1
    # O2: every answer older than its freshness bound is counted as stale, and only those.
    stale = [e for e in run.events if isinstance(e, StaleServed)]
    if len(stale) != answers_older_than_fresh:
        bad.append(f"{len(stale)} StaleServed for {answers_older_than_fresh} stale answers")
    if run.tasks_left:
        bad.append(f"{run.tasks_left} tasks left running")
    return bad


@FAST
@given(
    CACHE_CONFIG,
    st.lists(st.tuples(st.sampled_from([0, 0, 1, 2, 2, 4]), CACHE_OP), min_size=1, max_size=30),
)
def test_stale_cache_timelines(config: dict[str, Any], script: list[Any]) -> None:
    """G1, G4, O2: for any configuration and any timeline of reads (with per-call bounds and
    impatient callers), origin outages, hangs, slow and fail-closed loads and invalidations:
    a caller is answered from memory at once whenever something servable is there, never
    with content older than the bound; otherwise from a load that was in flight when it
    asked; the reported age is the content's age; content never goes back in time; at most
    one load per key runs; memory stays bounded; a hung refresh does not pin a key; and
    every answer older than its freshness bound is counted (StaleServed)."""
    run = drive_cache(config, script)
    bad = check_cache(run)
    assert not bad, "\n".join(bad[:20])


# == DegradedModes (G2, O2) ====================================================================


@dataclass
class ModelMode:
    """One mode as docs/degradation.md describes it (section 1 and 6)."""

    name: str
    enter_at_level: int | None
    leave_at_level: int | None
    signal: tuple[float, float | None] | None  # enter above hi; leave below lo (or not > hi)
    min_dwell: float
    max_duration: float | None
    poll_interval: float
    active: bool = False
    since: float = -math.inf
    level_demand: bool = False
    signal_demand: bool = False
    latched: bool = False  # left at max_duration; out until its trigger clears once
    forced: bool | None = None
    force_until: float = math.inf
    force_trigger: str = "manual"
    next_poll: float = -math.inf


class ModesModel:
    def __init__(self, modes: list[ModelMode], signals: dict[str, float]) -> None:
        self.modes = modes
        self.signals = signals
        self.level_trigger = "level 0"
        self.now = 0.0
        self.changes: list[tuple[str, bool, str, float]] = []
        for m in modes:
            if m.signal is None:
                m.next_poll = math.inf

    def demand(self, m: ModelMode) -> bool:
        return m.level_demand or m.signal_demand

    def change(self, m: ModelMode, active: bool, trigger: str) -> None:
        m.active = active
        m.since = self.now
        self.changes.append((m.name, active, trigger, self.now))

    def poll(self, m: ModelMode) -> None:
        m.next_poll = self.now + m.poll_interval
        assert m.signal is not None
        hi, lo = m.signal
        value = self.signals[m.name]
        if not m.signal_demand or lo is None:
            m.signal_demand = value > hi
        else:
            m.signal_demand = not value < lo

    def leave_trigger(self, m: ModelMode) -> str:
        if m.enter_at_level is not None and not m.level_demand:
            return self.level_trigger
        return "signal"

    def automatic(self, m: ModelMode) -> None:
        demand = self.demand(m)
        if not demand:
            m.latched = False
        if m.active:
            if m.max_duration is not None and self.now - m.since >= m.max_duration:
                m.latched = demand
                self.change(m, False, "max_duration")
            elif not demand and self.now - m.since >= m.min_dwell:
                self.change(m, False, self.leave_trigger(m))
        elif demand and not m.latched:
            self.change(m, True, self.level_trigger if m.level_demand else "signal")

    def released(self, m: ModelMode, trigger: str) -> None:
        # Back to automatic control; a person is not a flapping trigger: the mode ends now
        # unless a trigger asks for it, and automatic control would not have it on (a mode
        # that reached max_duration stays out until its trigger clears once).
        if m.active and (not self.demand(m) or m.latched):
            self.change(m, False, trigger)
        else:
            self.automatic(m)

    def evaluate(self, released: ModelMode | None = None, trigger: str = "") -> None:
        for m in self.modes:
            if self.now >= m.next_poll:
                self.poll(m)
            if not self.demand(m):
                m.latched = False  # the trigger cleared once, forced or not
            if m is released:
                self.released(m, trigger)
            elif m.forced is not None:
                if self.now < m.force_until:
                    if m.forced != m.active:
                        self.change(m, m.forced, m.force_trigger)
                else:
                    m.forced = None
                    m.force_until = math.inf
                    self.released(m, "force_expired")
            else:
                self.automatic(m)

    def set_level(self, level: int) -> None:
        self.level_trigger = f"level {level}"
        for m in self.modes:
            if m.enter_at_level is None:
                continue
            if level >= m.enter_at_level:
                m.level_demand = True
            elif m.leave_at_level is not None and level <= m.leave_at_level:
                m.level_demand = False
        self.evaluate()

    def force(self, name: str, on: bool | None, trigger: str, duration: float | None) -> None:
        m = next(m for m in self.modes if m.name == name)
        m.forced = on
        m.force_trigger = trigger
        if on is None:
            m.force_until = math.inf
        else:
            limit = duration if duration is not None else m.max_duration
            m.force_until = math.inf if limit is None else self.now + limit
        self.evaluate(m if on is None else None, trigger)

    def next_due(self) -> float:
        """When something changes next with no call: what a loop timer must wake up for."""
        due = math.inf
        for m in self.modes:
            due = min(due, m.next_poll)
            if m.forced is not None:
                due = min(due, m.force_until)
            elif m.active:
                if m.max_duration is not None:
                    due = min(due, m.since + m.max_duration)
                if not self.demand(m):
                    due = min(due, m.since + m.min_dwell)
        return due

    def active_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modes if m.active)


MODE_DECL = st.fixed_dictionaries(
    {
        "level": st.one_of(
            st.none(),
            st.tuples(st.integers(1, 3), st.sampled_from([None, 0])),  # enter, leave
        ),
        "signal": st.one_of(st.none(), st.tuples(st.just(0.9), st.sampled_from([None, 0.7]))),
        "min_dwell": st.sampled_from([0.0, 2.0, 5.0]),
        "max_extra": st.sampled_from([None, 1.0, 3.0, 10.0, 30.0]),  # max_duration - min_dwell
        "poll_interval": st.sampled_from([0.5, 1.0, 2.0]),
    }
)
MODE_OP = st.one_of(
    st.tuples(st.just("level"), st.integers(0, 3)),
    st.tuples(st.just("level"), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.0, 5.0, 11.0])),
    st.tuples(st.just("signal"), st.integers(0, 2), st.sampled_from([0.5, 0.8, 0.95])),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 11.0, 31.0])),
    st.tuples(
        st.just("force"),
        st.integers(0, 2),
        st.sampled_from([True, True, False, None]),
        st.sampled_from([None, 3.0, 20.0]),
        st.sampled_from(["manual", "drill"]),
    ),
    st.tuples(st.just("release"), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 2)),
    st.tuples(st.just("ask"), st.integers(0, 2)),
    st.tuples(st.just("evaluate")),
)


def declare(decls: list[dict[str, Any]]) -> tuple[list[Any], list[ModelMode], dict[str, float]]:
    from brownout import DegradedMode

    signals: dict[str, float] = {}
    real: list[Any] = []
    model: list[ModelMode] = []
    for i, d in enumerate(decls):
        name = f"m{i}"
        signals[name] = 0.5
        enter, leave = d["level"] if d["level"] is not None else (None, None)
        hi_lo = d["signal"]
        kw: dict[str, Any] = {}
        if hi_lo is not None:
            hi, lo = hi_lo
            kw["enter_when"] = lambda n=name, hi=hi: signals[n] > hi
            if lo is not None:
                kw["leave_when"] = lambda n=name, lo=lo: signals[n] < lo
        extra = d["max_extra"]
        max_duration = None if extra is None else d["min_dwell"] + extra
        real.append(
            DegradedMode(
                name,
                f"mode {i}",
                enter_at_level=enter,
                leave_at_level=leave,
                min_dwell=d["min_dwell"],
                max_duration=max_duration,
                poll_interval=d["poll_interval"],
                **kw,
            )
        )
        model.append(
            ModelMode(
                name,
                enter,
                (enter - 1 if leave is None else leave) if enter is not None else None,
                hi_lo,
                d["min_dwell"],
                max_duration,
                d["poll_interval"],
            )
        )
    return real, model, signals


def drive_modes(
    decls: list[dict[str, Any]], ops: list[tuple[Any, ...]], *, loop_timer: bool
) -> list[str]:
    from brownout import DegradedModes, Stats
    from brownout.events import DegradedModeChanged
    from brownout.testing import ManualClock

    bad: list[str] = []
    real, model_modes, signals = declare(decls)
    names = [m.name for m in model_modes]
    model = ModesModel(model_modes, signals)
    hub, sink = hub_with_sink()
    stats = Stats()
    hub.subscribe(stats)
    clock = ManualClock()

    def compare(where: str) -> None:
        got = [
            (e.mode, e.active, e.trigger, e.at)
            for e in sink.events
            if isinstance(e, DegradedModeChanged)
        ]
        if got != model.changes:
            bad.append(f"{where}: events {got[len(bad) :]} != model {model.changes}")
        active = modes.active_names()
        if active != model.active_names():
            bad.append(f"{where}: active {active} != model {model.active_names()}")
        # G2: what callers are told names exactly the active modes.
        if modes.header_value() != ", ".join(active):
            bad.append(f"{where}: header {modes.header_value()!r} for {active}")
        if modes.problem_fields() != {"degraded": list(active)}:
            bad.append(f"{where}: problem fields {modes.problem_fields()}")
        for m in model_modes:
            since = modes.since(m.name)
            if since != (m.since if m.active else None):
                bad.append(f"{where}: since({m.name}) {since} != {m.since if m.active else None}")
            if modes.forced(m.name) != m.forced:
                bad.append(f"{where}: forced({m.name}) {modes.forced(m.name)} != {m.forced}")
        # O2: Stats agrees with the announcements.
        gauge = {n: a for n, a in stats.degraded_modes.items() if a}
        if set(gauge) != set(active):
            bad.append(f"{where}: Stats degraded_modes {stats.degraded_modes} for {active}")
        entered = {n: sum(1 for c in model.changes if c[0] == n and c[1]) for n in names}
        if {n: c for n, c in entered.items() if c} != stats.degraded_activations:
            bad.append(f"{where}: activations {stats.degraded_activations} != {entered}")

    async def main() -> None:
        nonlocal modes
        loop = asyncio.get_running_loop()
        if loop_timer:
            modes = DegradedModes(real, events=hub)  # the loop's (virtual) clock and timer
        for i, op in enumerate(ops):
            where = f"op {i} {op} t={model.now}"
            kind = op[0]
            if kind == "advance":
                target = model.now + op[1]
                if loop_timer:
                    # The registry's timer makes changes on time, with nobody asking.
                    while (due := model.next_due()) <= target:
                        model.now = max(due, model.now)
                        model.evaluate()
                    await asyncio.sleep(op[1])
                    for _ in range(3):
                        await asyncio.sleep(0)  # let a timer due now fire first
                    if loop.time() != target:
                        bad.append(f"{where}: loop at {loop.time()} != {target}")
                else:
                    clock.advance(op[1])
                model.now = target
                continue
            if kind == "level":
                modes.set_level(op[1])
                model.set_level(op[1])
            elif kind == "signal":
                signals[names[op[1] % len(names)]] = op[2]
                continue  # not a call: nothing is evaluated
            elif kind in ("force", "release"):
                name = names[op[1] % len(names)]
                if kind == "release":
                    modes.release(name)
                    model.force(name, None, "manual", None)
                else:
                    modes.force(name, op[2], trigger=op[4], duration=op[3])
                    model.force(name, op[2], op[4], op[3])
            elif kind == "ask":
                m = model_modes[op[1] % len(names)]
                got = modes.active(m.name)
                model.evaluate()
                if got != m.active:
                    bad.append(f"{where}: active({m.name}) {got}")
            else:
                modes.evaluate()
                model.evaluate()
            model.evaluate()  # `compare` reads active_names(): a call, like any request's
            compare(where)
            if bad:
                return

    modes = DegradedModes(real, clock=clock, events=hub)
    if loop_timer:
        run_on_virtual_time(main)
    else:
        asyncio.run(main())
    return bad


@FAST
@given(st.lists(MODE_DECL, min_size=1, max_size=3), st.lists(MODE_OP, min_size=10, max_size=50))
def test_modes_follow_their_declared_rules(decls: list[Any], ops: list[Any]) -> None:
    """G2, O2 (ManualClock: changes are decided, and stamped, when a call observes them):
    for any declarations and any timeline of levels, signal values, overrides, releases and
    questions, a mode is on exactly when the documented rules say (enter at once; leave
    when the trigger cleared and min_dwell passed; out at max_duration until the trigger
    clears once; overrides ignore triggers and dwell and expire; releasing ends a mode no
    trigger asks for); every change is one event, with its trigger and instant; the header,
    the problem field, `since`, `forced` and Stats' gauge and activation count agree."""
    bad = drive_modes(decls, ops, loop_timer=False)
    assert not bad, "\n".join(bad[:10])


@FAST
@given(st.lists(MODE_DECL, min_size=1, max_size=3), st.lists(MODE_OP, min_size=10, max_size=40))
def test_modes_change_on_time_with_the_loop_timer(decls: list[Any], ops: list[Any]) -> None:
    """G2, O2 (the loop's clock, virtual): leaving after the dwell, at max_duration, at the
    end of an override, and the polling of signals happen at their instant, with nobody
    asking; the events carry that instant."""
    bad = drive_modes(decls, ops, loop_timer=True)
    assert not bad, "\n".join(bad[:10])


# == Drills and fallback marks (G3, G2) ========================================================

DEPS = ("recs", "search", "prices")
DRILL_OP = st.one_of(
    st.tuples(
        st.just("start"),
        st.sets(st.integers(0, 2), max_size=2),  # modes forced on
        st.sets(st.sampled_from(DEPS), max_size=2),  # dependencies failed
        st.booleans(),  # require_fallback
    ),
    st.tuples(st.just("end")),
    st.tuples(st.just("call"), st.integers(0, 2)),
    st.tuples(st.just("call"), st.integers(0, 2)),
    st.tuples(st.just("level"), st.integers(0, 1)),
    st.tuples(st.just("bare"), st.sampled_from(DEPS)),  # a client call outside any fallback
)
# Per mode: the dependency its primary path calls, and the one its fallback calls (or None).
WIRING = st.lists(
    st.tuples(st.sampled_from(DEPS), st.one_of(st.none(), st.sampled_from(DEPS))),
    min_size=3,
    max_size=3,
)


def drive_drills(wiring: list[tuple[str, str | None]], ops: list[tuple[Any, ...]]) -> list[str]:
    from brownout import DegradedMode, DegradedModes, depends_on
    from brownout._degrade.markers import served_by_fallback
    from brownout._edge import announced_modes
    from brownout.testing import (
        DrillFailed,
        DrillOutage,
        FallbackCalledFailedDependency,
        ManualClock,
        drill,
    )

    bad: list[str] = []
    names = [f"m{i}" for i in range(3)]
    modes = DegradedModes(
        [DegradedMode(n, f"mode {n}", enter_at_level=1, min_dwell=5.0) for n in names],
        clock=ManualClock(),
        events=EventHub(),
    )
    reached: list[tuple[str, bool]] = []  # (dependency, failed in a running drill) per call
    failed_now: set[str] = set()

    def client(dep: str) -> Any:
        @depends_on(dep)
        async def call() -> str:
            reached.append((dep, dep in failed_now))
            return f"from {dep}"

        return call

    clients = {d: client(d) for d in DEPS}
    handlers = []
    for i, (primary_dep, fallback_dep) in enumerate(wiring):

        async def fallback(i: int = i, dep: str | None = fallback_dep) -> str:
            if dep is not None:
                await clients[dep]()
            return f"fallback {i}"

        async def primary(i: int = i, dep: str = primary_dep) -> str:
            return await clients[dep]()

        handlers.append(modes.fallback(names[i], fallback)(primary))

    async def main() -> None:
        stack: list[tuple[Any, set[str], set[str], bool, list[str], dict[str, int]]] = []
        before_forced: list[dict[str, bool | None]] = []
        for op in ops:
            kind = op[0]
            if kind == "start":
                if len(stack) == 2:
                    continue
                forced = {names[i] for i in op[1]}
                before_forced.append({n: modes.forced(n) for n in names})
                d = drill(modes, *sorted(forced), failed=sorted(op[2]), require_fallback=op[3])
                d.__enter__()
                failed_now.update(op[2])
                for n in forced:
                    if not modes.active(n):
                        bad.append(f"drill started but {n} is not active")
                served = {n: modes.fallbacks_served(n) for n in names}
                stack.append((d, forced, set(op[2]), op[3], [], served))
            elif kind == "end":
                if not stack:
                    continue
                d, forced, _, require, violations, served = stack.pop()
                ran = {n: modes.fallbacks_served(n) - served[n] for n in forced}
                expect_fail = bool(violations) or (require and any(not ran[n] for n in forced))
                try:
                    d.__exit__(None, None, None)
                except DrillFailed:
                    if not expect_fail:
                        bad.append(f"drill failed with no violation: {violations}, ran {ran}")
                else:
                    if expect_fail:
                        bad.append(f"drill passed despite {violations} / ran {ran}")
                failed_now.clear()
                for _, _, f, *_ in stack:
                    failed_now.update(f)
                previous = before_forced.pop()
                for n in names:
                    if modes.forced(n) != previous[n]:
                        bad.append(f"after the drill {n} forced {modes.forced(n)} != {previous[n]}")
            elif kind == "level":
                modes.set_level(op[1])
            elif kind == "bare":
                try:
                    await clients[op[1]]()
                except DrillOutage:
                    if op[1] not in failed_now:
                        bad.append(f"DrillOutage for {op[1]}, not failed")
                else:
                    if op[1] in failed_now:
                        bad.append(f"the failed {op[1]} was reached outside a fallback")
            else:
                i = op[1]
                marks: list[str] = []
                token = served_by_fallback.set(marks)  # what the edge does per request
                active_before = modes.active(names[i])
                try:
                    answer = await handlers[i]()
                except FallbackCalledFailedDependency as error:
                    answer = None
                    if not (active_before and wiring[i][1] in failed_now):
                        bad.append(f"{error} though not a fallback calling a failed dependency")
                    for entry in stack:
                        if error.dependency in entry[2]:
                            entry[4].append(str(error))
                except DrillOutage as error:
                    answer = None
                    if active_before or error.dependency not in failed_now:
                        bad.append(f"{error!r} on the primary path of {names[i]}")
                finally:
                    served_by_fallback.reset(token)
                if active_before:
                    if answer is not None and answer != f"fallback {i}":
                        bad.append(f"{names[i]} active but answered {answer!r}")
                    if wiring[i][1] not in failed_now and answer is None:
                        bad.append(f"{names[i]}'s fallback failed though its dependency is up")
                # G2: the response names the active modes and every mode whose fallback answered.
                expected = set(modes.active_names()) | ({names[i]} if active_before else set())
                if set(announced_modes(modes, marks)) != expected:
                    bad.append(f"announced {announced_modes(modes, marks)} != {expected}")
                if marks != ([names[i]] if active_before else []):
                    bad.append(f"marks {marks} for {names[i]} (active {active_before})")
            # G3: a failed dependency is never reached while its drill runs.
            if any(failed for _, failed in reached):
                bad.append(f"a failed dependency was reached: {reached}")
            if bad:
                return
        while stack:  # end what is still running; the outcome was checked above
            d = stack.pop()[0]
            try:
                d.__exit__(None, None, None)
            except DrillFailed:
                pass
        failed_now.clear()
        # Ending the drills restores normal service: no mode forced, every dependency reached.
        for n in names:
            if modes.forced(n) is not None:
                bad.append(f"{n} still forced after every drill ended")
        for dep in DEPS:
            if await clients[dep]() != f"from {dep}":
                bad.append(f"{dep} not reachable after the drills")

    asyncio.run(main())
    return bad


@FAST
@given(WIRING, st.lists(DRILL_OP, min_size=1, max_size=30))
def test_drills_catch_fallbacks_that_call_the_failed_dependency(
    wiring: list[Any], ops: list[Any]
) -> None:
    """G3, G2: for any wiring of primaries and fallbacks to dependencies and any sequence of
    (nested) drills, calls and level changes: a failed dependency is never reached while its
    drill runs; the primary path sees the simulated outage, a fallback that calls it raises
    and fails the drill (and only then, or when a required fallback never ran); a good
    fallback answers; the response names exactly the active modes plus those whose fallback
    answered; and ending the drills restores the previous control and every dependency."""
    bad = drive_drills(wiring, ops)
    assert not bad, "\n".join(bad[:10])


# == FailClosedGuard (G4, O2) ==================================================================

GUARD_STEP = st.tuples(
    st.sampled_from(
        [
            "ok",
            "slow",  # answers in 2 s: within a 3 s timeout, past a 1 s one
            "error",
            "raises_timeout",
            "hang",
            "own_deadline",  # the source's own deadline expires inside it
            "breaker_open",
            "inner_fail_closed",  # the source reads another guarded source, which is down
            "reads_a_cache",  # the mistake: the guarded source reads through a StaleCache
        ]
    ),
    st.sampled_from([None, "deadline", "patience", "cancel"]),  # how the caller bounds it
)


def drive_guard(timeout: float | None, steps: list[tuple[str, str | None]]) -> list[str]:
    from brownout import DeadlineExceeded, FailClosedGuard, Reason, Rejected, Stats
    from brownout.events import GuardFailedClosed

    bad: list[str] = []
    hub, sink = hub_with_sink()
    stats = Stats()
    hub.subscribe(stats)
    guard = FailClosedGuard("authorization", timeout=timeout, events=hub)
    payments = FailClosedGuard("payment-state", events=hub)
    cache: StaleCache[str, str] = StaleCache(max_entries=4, fresh_for=60, max_staleness=3600)
    calls = 0

    async def down() -> str:
        raise ConnectionError("payments down")

    async def source(behaviour: str) -> str:
        nonlocal calls
        calls += 1
        token = f"allow:{calls}"
        if behaviour == "slow":
            await asyncio.sleep(2)
        elif behaviour == "error":
            raise ConnectionError("authz unreachable")
        elif behaviour == "raises_timeout":
            raise TimeoutError
        elif behaviour == "hang":
            await asyncio.sleep(HANG)
        elif behaviour == "own_deadline":
            async with brownout.deadline(0.5):
                await asyncio.sleep(1)
        elif behaviour == "breaker_open":
            raise Rejected(Reason.BREAKER_OPEN, "authz breaker open", retry_after=5)
        elif behaviour == "inner_fail_closed":
            await payments.call(down)
        elif behaviour == "reads_a_cache":

            async def load() -> str:
                return token

            return (await cache.get("authz", load)).value
        return token

    async def main() -> None:
        loop = asyncio.get_running_loop()
        expected_events = 0
        for behaviour, bound in steps:
            if behaviour == "hang" and bound is None and timeout is None:
                bound = "patience"  # nobody bounds it: it would wait for HANG
            before = calls
            start = loop.time()
            task = asyncio.create_task(guard.call(source, behaviour))
            ended: list[float] = []
            task.add_done_callback(lambda _t, ended=ended: ended.append(loop.time()))
            outcome: Any
            try:
                if bound == "deadline":
                    async with brownout.deadline(1.5):
                        outcome = await asyncio.shield(task)
                elif bound == "patience":
                    async with asyncio.timeout(1.5):
                        outcome = await asyncio.shield(task)
                elif bound == "cancel":
                    await asyncio.sleep(1.5)
                    task.cancel()
                    outcome = await task
                else:
                    outcome = await task
            except BaseException as error:  # judged below
                outcome = error
            if not task.done():  # the caller gave up: the call goes with it (D5)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            took = ended[0] - start
            where = f"{behaviour}/{bound} timeout={timeout}"
            answers = behaviour == "ok" or (
                behaviour == "slow"
                and (timeout is None or timeout > 2)
                and bound not in ("deadline", "patience", "cancel")
            )
            caller_left = (
                bound in ("deadline", "patience", "cancel")
                and behaviour in ("hang", "slow")
                and (timeout is None or timeout > 1.5)
            )
            if answers:
                # The source's answer to *this* call, never a remembered one.
                if outcome != f"allow:{before + 1}":
                    bad.append(f"{where}: {outcome!r} instead of this call's answer")
            elif caller_left:
                # The caller's own deadline or cancellation: not a value, not the guard's.
                if bound == "deadline" and not isinstance(outcome, DeadlineExceeded):
                    bad.append(f"{where}: {outcome!r} for the caller's deadline")
                if bound == "patience" and not isinstance(outcome, TimeoutError):
                    bad.append(f"{where}: {outcome!r} for the caller's timeout")
                if bound == "cancel" and not isinstance(outcome, asyncio.CancelledError):
                    bad.append(f"{where}: {outcome!r} for the caller's cancellation")
                if isinstance(outcome, FailClosed):
                    bad.append(f"{where}: the caller's own bound was reported as FailClosed")
            else:
                # G4: every failure of the source fails closed, with the typed 503 error.
                if not isinstance(outcome, FailClosed):
                    bad.append(f"{where}: {outcome!r} instead of FailClosed")
                elif outcome.reason is not Reason.DEPENDENCY_UNAVAILABLE:
                    bad.append(f"{where}: FailClosed with reason {outcome.reason}")
                else:
                    expected_events += 1
                if behaviour == "hang" and timeout is not None and abs(took - timeout) > 1e-6:
                    bad.append(f"{where}: failed closed after {took}, not at the timeout")
            counted = [e for e in sink.events if isinstance(e, GuardFailedClosed)]
            mine = [e for e in counted if e.what == "authorization"]
            # O2: every refusal of this guard is counted once (the inner guard counts its own).
            if len(mine) != expected_events:
                bad.append(f"{where}: {len(mine)} GuardFailedClosed for {expected_events}")
                return
        total = sum(
            v for (what, _), v in stats.guard_failed_closed.items() if what == "authorization"
        )
        if total != expected_events:
            bad.append(f"Stats counted {total} refusals of {expected_events}")
        if len(cache):
            bad.append("a guarded value was cached")

    run_on_virtual_time(main)
    return bad


@FAST
@given(st.sampled_from([None, 1.0, 3.0]), st.lists(GUARD_STEP, min_size=1, max_size=12))
def test_guard_fails_closed_and_counts(timeout: float | None, steps: list[Any]) -> None:
    """G4, O2: whatever the source does (answers, is slow, raises, hangs past the guard's
    timeout, hits its own deadline, meets an open breaker, reads another guarded source that
    is down, or wrongly reads through a cache) and however the caller bounds the call: an
    answer is the source's answer to this call; every failure of the source is FailClosed
    (503, dependency_unavailable), at the guard's timeout for a hang; the caller's own
    deadline, timeout or cancellation propagates as itself; every refusal is counted once
    (GuardFailedClosed, Stats); nothing guarded is cached."""
    bad = drive_guard(timeout, steps)
    assert not bad, "\n".join(bad[:10])


BURST_CONFIG = st.fixed_dictionaries(
    {
        "max_entries": st.integers(1, 2),
        "fresh_for": st.sampled_from([0, 1]),
        "extra_staleness": st.sampled_from([0, 1]),
        "load_timeout": st.sampled_from([None, 3]),
        "failure_backoff": st.just(1),
        "origins": st.lists(
            st.tuples(st.sampled_from(["ok", "ok", "fail", "hang"]), st.sampled_from([2, 4])),
            min_size=len(KEYS),
            max_size=len(KEYS),
        ),
    }
)
BURST_OP = st.one_of(
    st.tuples(
        st.just("read"), st.sampled_from(KEYS), st.sampled_from([None, None, 1, 3]), st.none()
    ),
    st.tuples(st.just("invalidate"), st.sampled_from(KEYS)),
)


@FAST
@given(BURST_CONFIG, st.lists(st.tuples(st.sampled_from([0, 1, 2]), BURST_OP), max_size=25))
def test_stale_cache_concurrent_readers_of_short_lived_content(
    config: dict[str, Any], script: list[Any]
) -> None:
    """G1, O2: the same invariants where content is short-lived and loads are slow, so most
    callers wait for a load and many join one in flight while other keys land and evict:
    every caller that joins a load gets that load's value with that load's age."""
    run = drive_cache(config, script)
    bad = check_cache(run)
    assert not bad, "\n".join(bad[:20])
