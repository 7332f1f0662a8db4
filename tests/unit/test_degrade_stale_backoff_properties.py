"""Property tests of `StaleCache` after a load fails (G1, G4, O2), on virtual time (looptime).

test_degrade_properties.py checks invariants that hold whatever happens (nothing too old is
served, single flight, bounded memory); it does not check *when* the cache tries the origin
again. Here a brute-force model written from the rules in docs/degradation.md (section 3) and
`StaleCache`'s docstring predicts, for any configuration and timeline, every loader call (its
key, instant and kind), every answer (value and age, or which error, and when) and every
`StaleServed` event; the real cache must agree exactly. The rules it encodes:

- a value up to ``max_staleness`` old is served at once; past ``fresh_for`` it starts one
  background refresh unless one is in flight, the key is backing off, or ``max_entries``
  refreshes are in flight;
- a failed load (refresh or foreground) of a key still in memory makes its next refresh wait
  ``failure_backoff`` seconds from the failure; a success ends the backoff;
- meanwhile the stale value is served, until it is ``max_staleness`` old; past that the caller
  waits for a load (never delayed by the backoff) and gets its error if it fails;
- a load that fails closed evicts the key; ``load_timeout`` bounds every load; the last caller
  giving up cancels the load; the LRU evicts, and cancels an evicted key's refresh.

Instants are chosen so nothing the model cannot order happens at the same time: reads at whole
seconds, loads of key a/b/c ending at .5/.375/.625, load timeouts at .25, callers giving up at
.75, while ages, staleness bounds and backoff ends still land exactly on read instants.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import looptime
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import brownout
from brownout import FailClosed, StaleCache
from brownout.events import Event, EventHub, StaleServed

FAST = settings(max_examples=200, deadline=None, derandomize=True)
HANG = 10_000.0  # "never answers" on the scale of these timelines
TAIL = 12  # seconds the timeline runs on after its last step
KEYS = "abc"
OFFSET = {"a": 0.5, "b": 0.375, "c": 0.625}  # distinct instants for each key's load ends


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


def run_on_virtual_time(main: Any) -> None:
    # No I/O here: nothing can become ready while the loop idles, so the clock may jump to the
    # next timer at once (looptime's default idles 42 no-op cycles first, 4x the runtime).
    loop = looptime.new_event_loop(start=0.0, noop_cycles=1)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


# == the model ================================================================================


@dataclass
class MEntry:
    n: int  # which load of the key produced it
    loaded_at: float
    retry_at: float = -math.inf


@dataclass
class MFlight:
    key: str
    n: int
    start: float
    background: bool
    end: float
    result: str  # ok | fail | fail_closed | timeout | hang
    waiters: list[int] = field(default_factory=list)
    cancelled: bool = False


Answer = tuple[Any, ...]  # ("ok", n, age, at) | ("error", kind, at) | ("pending",)


class CacheModel:
    """docs/degradation.md section 3, one rule at a time, by brute force."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.max_entries: int = config["max_entries"]
        self.fresh_for: float = config["fresh_for"]
        self.max_staleness: float = config["fresh_for"] + config["extra_staleness"]
        self.load_timeout: float | None = config["load_timeout"]
        self.backoff: float = config["failure_backoff"]
        self.outcomes: dict[str, list[tuple[str, int]]] = config["outcomes"]
        self.entries: OrderedDict[str, MEntry] = OrderedDict()
        self.flights: dict[str, MFlight] = {}
        self.refreshing = 0
        self.calls = dict.fromkeys(KEYS, 0)
        self.loads: list[tuple[str, int, float, bool]] = []
        self.answers: dict[int, Answer] = {}
        self.stale: list[tuple[float, float, bool]] = []
        self.waiting: dict[int, tuple[MFlight, float]] = {}
        self.queue: list[tuple[float, int, Any]] = []
        self.seq = 0

    def push(self, at: float, what: Any) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (at, self.seq, what))

    def start(self, key: str, now: float, background: bool) -> MFlight:
        n = self.calls[key]
        self.calls[key] += 1
        self.loads.append((key, n, now, background))
        kind, base = self.outcomes[key][n % len(self.outcomes[key])]
        took = HANG if kind == "hang" else base + OFFSET[key]
        if self.load_timeout is not None and took > self.load_timeout:
            flight = MFlight(key, n, now, background, now + self.load_timeout, "timeout")
        elif kind == "hang":
            flight = MFlight(key, n, now, background, math.inf, "hang")
        else:
            flight = MFlight(key, n, now, background, now + took, kind)
        self.flights[key] = flight
        if background:
            self.refreshing += 1
        if math.isfinite(flight.end):
            self.push(flight.end, ("end", flight))
        return flight

    def cancel(self, flight: MFlight) -> None:
        flight.cancelled = True  # lands at once: no backoff, nothing stored
        if flight.background:
            self.refreshing -= 1
        if self.flights.get(flight.key) is flight:
            del self.flights[flight.key]

    def read(self, r: int, now: float, key: str, patience: float | None, bounds: Any) -> None:
        fresh, limit = (self.fresh_for, self.max_staleness) if bounds is None else bounds
        entry = self.entries.get(key)
        if entry is not None and now - entry.loaded_at <= limit:
            self.entries.move_to_end(key)
            age = now - entry.loaded_at
            if age > fresh:
                refreshing = key in self.flights
                if not refreshing and now >= entry.retry_at and self.refreshing < self.max_entries:
                    self.start(key, now, background=True)
                    refreshing = True
                self.stale.append((now, age, refreshing))
            self.answers[r] = ("ok", entry.n, age, now)
            return
        flight = self.flights.get(key) or self.start(key, now, background=False)
        flight.waiters.append(r)
        self.waiting[r] = (flight, fresh)
        if patience is not None:
            self.push(now + patience, ("give_up", r))

    def land(self, flight: MFlight, now: float) -> None:
        key = flight.key
        if flight.result == "ok":
            self.entries[key] = MEntry(flight.n, flight.start)
            self.entries.move_to_end(key)
            while len(self.entries) > self.max_entries:
                evicted, _ = self.entries.popitem(last=False)
                other = self.flights.get(evicted)
                if other is not None and other.background and not other.waiters:
                    self.cancel(other)
        if flight.background:
            self.refreshing -= 1
        if self.flights.get(key) is flight:
            del self.flights[key]
        if flight.result == "fail_closed":
            self.entries.pop(key, None)
        elif flight.result != "ok" and key in self.entries:
            self.entries[key].retry_at = now + self.backoff
        for r in flight.waiters:
            _, fresh = self.waiting.pop(r)
            if flight.result == "ok":
                age = now - flight.start
                self.answers[r] = ("ok", flight.n, age, now)
                if age > fresh:
                    self.stale.append((now, age, False))
            else:
                self.answers[r] = ("error", flight.result, now)
        flight.waiters.clear()

    def give_up(self, r: int, now: float) -> None:
        if r not in self.waiting:
            return
        flight, _ = self.waiting.pop(r)
        flight.waiters.remove(r)
        self.answers[r] = ("error", "give_up", now)
        if not flight.waiters:
            self.cancel(flight)

    def run(self, script: list[tuple[int, tuple[Any, ...]]]) -> float:
        now = 0.0
        for r, (dt, op) in enumerate(script):
            now += dt
            self.push(now, ("op", r, op))
        end = now + TAIL
        while self.queue and self.queue[0][0] <= end:
            at, _, what = heapq.heappop(self.queue)
            if what[0] == "op":
                _, r, op = what
                if op[0] == "read":
                    self.read(r, at, op[1], op[2], op[3])
                else:
                    self.entries.pop(op[1], None)
            elif what[0] == "end":
                if not what[1].cancelled:
                    self.land(what[1], at)
            else:
                self.give_up(what[1], at)
        for r in self.waiting:
            self.answers[r] = ("pending",)
        return end


# == the real cache ===========================================================================


@dataclass
class Actual:
    loads: list[tuple[str, int, float, bool]] = field(default_factory=list)
    answers: dict[int, Answer] = field(default_factory=dict)
    stale: list[tuple[float, float, bool]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def error_kind(error: BaseException) -> str:
    if isinstance(error, FailClosed):
        return "fail_closed"
    if isinstance(error, ConnectionError):
        return "fail"
    if isinstance(error, TimeoutError):
        return "timeout"
    return repr(error)


def make_cache(config: dict[str, Any], hub: EventHub) -> StaleCache[str, tuple[str, int]]:
    return StaleCache(
        max_entries=config["max_entries"],
        fresh_for=config["fresh_for"],
        max_staleness=config["fresh_for"] + config["extra_staleness"],
        load_timeout=config["load_timeout"],
        failure_backoff=config["failure_backoff"],
        name="content",
        events=hub,
    )


def drive(config: dict[str, Any], script: list[tuple[int, tuple[Any, ...]]]) -> Actual:
    actual = Actual()
    hub = EventHub()
    sink = Sink()
    hub.subscribe(sink)
    cache = make_cache(config, hub)
    calls = dict.fromkeys(KEYS, 0)
    running: list[asyncio.Task[Any]] = []  # background loads, for the bound on them

    def loader_for(key: str) -> Any:
        async def load() -> tuple[str, int]:
            loop = asyncio.get_running_loop()
            n = calls[key]
            calls[key] += 1
            background = (brownout.current().operation or "").startswith("refresh:")
            actual.loads.append((key, n, loop.time(), background))
            me = asyncio.current_task()
            if background and me is not None:
                running.append(me)
            kind, base = config["outcomes"][key][n % len(config["outcomes"][key])]
            await asyncio.sleep(HANG if kind == "hang" else base + OFFSET[key])
            if kind == "fail":
                raise ConnectionError(f"{key} origin down")
            if kind == "fail_closed":
                raise FailClosed("authorization")
            return (key, n)

        return load

    loaders = {k: loader_for(k) for k in KEYS}

    async def read(r: int, key: str, patience: float | None, bounds: Any) -> None:
        loop = asyncio.get_running_loop()
        kw: dict[str, float] = (
            {} if bounds is None else {"fresh_for": bounds[0], "max_staleness": bounds[1]}
        )
        try:
            async with asyncio.timeout(patience) as scope:
                (key_served, n), age = await cache.get(key, loaders[key], **kw)
        except TimeoutError as error:
            kind = "give_up" if scope.expired() else error_kind(error)
            actual.answers[r] = ("error", kind, loop.time())
        except (ConnectionError, FailClosed) as error:
            actual.answers[r] = ("error", error_kind(error), loop.time())
        else:
            if key_served != key:
                actual.problems.append(f"read {r} of {key!r} answered with {key_served!r}")
            actual.answers[r] = ("ok", n, age, loop.time())

    def check_bounds(at: str) -> None:
        if len(cache) > config["max_entries"]:
            actual.problems.append(f"{at}: {len(cache)} entries > {config['max_entries']}")
        live = sum(1 for t in running if not t.done())
        if live > config["max_entries"]:
            actual.problems.append(f"{at}: {live} refreshes in flight > {config['max_entries']}")

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        for r, (dt, op) in enumerate(script):
            await asyncio.sleep(dt)
            check_bounds(f"step {r}")
            if op[0] == "read":
                tasks.append(asyncio.create_task(read(r, op[1], op[2], op[3])))
            else:
                cache.invalidate(op[1])
            await asyncio.sleep(0)  # the read runs up to its first wait before the next step
        await asyncio.sleep(TAIL)
        check_bounds("end")
        actual.stale = [
            (e.at, e.age, e.refreshing) for e in sink.events if isinstance(e, StaleServed)
        ]
        # Bounded state: when every caller has gone and every load has ended, nothing is left.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(HANG * 2)
        left = len(asyncio.all_tasks()) - 1
        # private: finished flights and the refresh count left behind show only as memory
        # and as refreshes refused later; the model checks the tasks publicly
        if left or cache._flights or cache._refreshing:
            actual.problems.append(
                f"left behind: {left} tasks, flights {list(cache._flights)}, "
                f"refreshing {cache._refreshing}"
            )

    run_on_virtual_time(main)
    for r, (_, op) in enumerate(script):
        if op[0] == "read":
            actual.answers.setdefault(r, ("pending",))
    return actual


def compare(config: dict[str, Any], script: list[tuple[int, tuple[Any, ...]]]) -> list[str]:
    model = CacheModel(config)
    model.run(script)
    actual = drive(config, script)
    bad = list(actual.problems)
    if actual.loads != model.loads:
        bad.append(
            f"loader calls (key, n, at, background):\n  {actual.loads}\n  model {model.loads}"
        )
    for r in sorted(model.answers):
        if actual.answers.get(r) != model.answers[r]:
            bad.append(f"step {r} {script[r][1]}: {actual.answers.get(r)} model {model.answers[r]}")
    if sorted(actual.stale) != sorted(model.stale):
        bad.append(f"StaleServed (at, age, refreshing): {actual.stale} model {model.stale}")
    return bad


# == strategies ===============================================================================

OUTCOME = st.tuples(
    st.sampled_from(["ok", "ok", "ok", "ok", "fail", "fail", "fail", "hang", "fail_closed"]),
    st.sampled_from([0, 0, 1, 3]),  # whole seconds; OFFSET makes each key's instants its own
)
BOUNDS = st.sampled_from([None, None, None, None, (0, 0), (30, 30), (0, 40)])
READ = st.tuples(
    st.just("read"),
    st.sampled_from("aaaabbc"),  # mostly one key, so its timeline goes on long enough
    st.sampled_from([None, None, None, 0.75, 1.75, 3.75]),  # the caller's patience
    BOUNDS,  # per-call bounds: a strict caller, or a degraded mode accepting older content
)
STEP = st.tuples(
    st.sampled_from([0, 1, 1, 1, 1, 2, 3, 5]),
    # one step in ten is an invalidation (one_of would give each branch the same share)
    st.tuples(st.integers(0, 9), READ, st.tuples(st.just("invalidate"), st.sampled_from(KEYS))).map(
        lambda t: t[2] if t[0] == 0 else t[1]
    ),
)
CONFIG = st.fixed_dictionaries(
    {
        "max_entries": st.integers(1, 3),
        "fresh_for": st.sampled_from([0, 1, 2, 4]),
        "extra_staleness": st.sampled_from([0, 3, 8, 8, 20]),
        "load_timeout": st.sampled_from([None, None, 1.25, 2.25]),
        # 0.5 and 0.75 end a backoff on a whole second (a read instant): the boundary.
        "failure_backoff": st.sampled_from([0, 0.5, 0.75, 1, 2.5, 4, 20]),
        "outcomes": st.fixed_dictionaries(
            # The first load mostly succeeds: there is something stale to serve.
            {
                k: st.lists(OUTCOME, min_size=1, max_size=6).map(
                    lambda o: [("ok", 0), *o] if len(o) % 3 else o
                )
                for k in KEYS
            }
        ),
    }
)


def one_key(fresh: int, extra: int, backoff: float, outcomes: list[Any]) -> dict[str, Any]:
    return {
        "max_entries": 1,
        "fresh_for": fresh,
        "extra_staleness": extra,
        "load_timeout": None,
        "failure_backoff": backoff,
        "outcomes": {k: outcomes for k in KEYS},
    }


DEFAULT = ("read", "a", None, None)
STRICT = ("read", "a", None, (0, 0))


@FAST
@given(CONFIG, st.lists(STEP, min_size=15, max_size=40))
# The refresh fails at 1.5; the backoff ends at 2.0 (read at 2: refreshes) or 4.0 (reads at 2
# and 3 serve stale without one; the read at 4 starts it).
@example(
    one_key(0, 20, 0.5, [("ok", 0), ("fail", 0), ("ok", 0)]), [(0, DEFAULT)] + [(1, DEFAULT)] * 3
)
@example(
    one_key(0, 20, 2.5, [("ok", 0), ("fail", 0), ("ok", 0)]), [(0, DEFAULT)] + [(1, DEFAULT)] * 5
)
# Stale is served while backing off up to exactly max_staleness (3 s); at 4 s the caller waits
# for a load, which the backoff does not delay, and gets its error.
@example(
    one_key(0, 3, 20, [("ok", 0), ("fail", 0), ("fail", 0), ("fail", 0)]),
    [(0, DEFAULT)] + [(1, DEFAULT)] * 5,
)
# A failed foreground load (a strict caller) makes the key back off; the next strict caller
# still loads at once.
@example(
    one_key(0, 20, 2.5, [("ok", 0), ("fail", 0)]),
    [(0, DEFAULT), (1, STRICT), (1, DEFAULT), (0, STRICT), (3, DEFAULT)],
)
# The LRU evicts "a" while its refresh hangs: the refresh is cancelled, and the next reader of
# "a" gets a new load instead of joining the hung one.
@example(
    one_key(0, 20, 1, [("ok", 0), ("hang", 0), ("ok", 0)]),
    [(0, DEFAULT), (1, DEFAULT), (0, ("read", "b", None, None)), (1, ("read", "a", 0.75, None))],
)
def test_stale_cache_agrees_with_the_model_after_failures(
    config: dict[str, Any], script: list[Any]
) -> None:
    """G1, G4, O2: for any configuration and timeline of reads (impatient, strict or
    degraded callers), origins that answer, fail, hang or fail closed, load timeouts,
    invalidations and LRU evictions: the cache calls the origin exactly when the model says
    (a refresh after a failure only once ``failure_backoff`` has passed, and at the first
    stale read that may), answers every caller exactly as the model does (stale content while
    backing off, until it is ``max_staleness`` old; then the load's error), counts the same
    stale answers, stays within its bounds, and leaves nothing behind."""
    bad = compare(config, script)
    assert not bad, "\n".join(bad[:12])


# == focused properties, without the model =====================================================

ONE_KEY_CONFIG = st.fixed_dictionaries(
    {
        "fresh_for": st.sampled_from([0, 1, 3]),
        "extra_staleness": st.sampled_from([2, 6, 15]),
        "failure_backoff": st.sampled_from([0, 0.5, 1, 2.5, 4, 7]),
        "fail_after": st.integers(1, 4),  # loads that succeed before the origin goes down
        "took": st.sampled_from([0, 0.5, 1.5]),  # how long the origin takes to fail
    }
)


@FAST
@given(ONE_KEY_CONFIG, st.lists(st.sampled_from([0.25, 0.5, 1, 1, 2, 3]), max_size=40))
def test_failed_refreshes_back_off_and_stale_is_served_until_max_staleness(
    config: dict[str, Any], gaps: list[float]
) -> None:
    """G1: one key, read at arbitrary instants, whose origin goes down for good. Checked
    directly on what the callers and the origin see:

    - no attempt (refresh or load) starts less than ``failure_backoff`` after a failed one
      ended, unless nothing servable was left (a caller then waits for a load);
    - a stale read at or after the end of the backoff, with no refresh in flight, starts one;
    - while the last good value is at most ``max_staleness`` old, every read gets it at once,
      with its true age; once older, every read gets the origin's error, never the value."""
    fresh = config["fresh_for"]
    limit = fresh + config["extra_staleness"]
    backoff = config["failure_backoff"]
    bad: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cache: StaleCache[str, int] = StaleCache(
            max_entries=4, fresh_for=fresh, max_staleness=limit, failure_backoff=backoff
        )
        attempts: list[list[float]] = []  # [start, end] of each loader call
        good: list[float] = []  # start of each successful load

        async def origin() -> int:
            attempt = [loop.time(), math.inf]
            attempts.append(attempt)
            n = len(attempts)
            try:
                await asyncio.sleep(0 if n <= config["fail_after"] else config["took"])
                if n > config["fail_after"]:
                    raise ConnectionError("origin down")
                good.append(attempt[0])
                return n
            finally:
                attempt[1] = loop.time()

        await cache.get("k", origin)
        for gap in gaps:
            await asyncio.sleep(gap)
            now = loop.time()
            before = len(attempts)
            in_flight = bool(attempts) and attempts[-1][1] == math.inf
            loaded_at = good[-1]
            age = now - loaded_at
            try:
                value, served_age = await cache.get("k", origin)
            except ConnectionError:
                if age <= limit:
                    bad.append(f"t={now}: error though the value is {age} <= {limit} old")
                continue
            finally:
                for _ in range(3):
                    await asyncio.sleep(0)  # a refresh that fails at once lands
            if age > limit and (served_age != 0 or good[-1] != now):
                bad.append(f"t={now}: {value, served_age}: not a new load, {age} > {limit}")
            if age <= limit:
                if served_age != age or loop.time() != now:
                    bad.append(f"t={now}: {value, served_age} instead of the {age} old value")
                failures = [a for a in attempts[:before] if a[0] not in good]
                last_failure = max((a[1] for a in failures), default=-math.inf)
                started = len(attempts) > before
                due = age > fresh and not in_flight and now >= last_failure + backoff
                if started and not due:
                    bad.append(
                        f"t={now}: refresh {last_failure} + {backoff} (in flight {in_flight})"
                    )
                if due and not started:
                    bad.append(f"t={now}: no refresh, backoff ended at {last_failure + backoff}")
        await asyncio.sleep(HANG)

    run_on_virtual_time(main)
    assert not bad, "\n".join(bad[:10])


@FAST
@given(
    st.integers(1, 4),
    st.sampled_from([None, 1.25]),
    st.lists(
        st.tuples(
            st.integers(0, 3),  # key
            st.sampled_from(["ok", "ok", "fail", "hang", "fail_closed", "invalidate"]),
            st.sampled_from([None, 0.75, 2.75]),  # the caller's patience
            st.sampled_from([0, 1, 3]),  # seconds before the read
        ),
        max_size=60,
    ),
)
# A refresh of an invalidated key hangs; another key going stale must not start a second one.
@example(
    1,
    None,
    [
        (0, "ok", None, 0),
        (0, "hang", None, 2),
        (0, "invalidate", None, 0),
        (1, "ok", None, 0),
        (1, "hang", None, 2),
    ],
)
def test_state_stays_bounded_through_failing_and_hanging_refreshes(
    max_entries: int, load_timeout: float | None, steps: list[Any]
) -> None:
    """Bounded everything (DESIGN): whatever mix of keys, failures, hangs, impatient callers
    and invalidations (a refresh of an invalidated key keeps running), at every step at most
    ``max_entries`` values and background refreshes exist, the cache's own count of refreshes
    in flight is the true one, and once every caller has gone and every load has ended no
    task, flight or count is left (a backoff keeps no state past its entry)."""
    bad: list[str] = []

    async def main() -> None:
        cache: StaleCache[int, str] = StaleCache(
            max_entries=max_entries,
            fresh_for=1,
            max_staleness=4,
            load_timeout=load_timeout,
            failure_backoff=2,
        )
        refreshes: list[asyncio.Task[Any]] = []

        def loader(mode: str) -> Any:
            async def load() -> str:
                if (brownout.current().operation or "").startswith("refresh:"):
                    me = asyncio.current_task()
                    assert me is not None
                    refreshes.append(me)
                await asyncio.sleep(HANG if mode == "hang" else 0.5)
                if mode == "fail":
                    raise ConnectionError
                if mode == "fail_closed":
                    raise FailClosed("authorization")
                return mode

            return load

        async def read(key: int, mode: str, patience: float | None) -> None:
            try:
                async with asyncio.timeout(patience):
                    await cache.get(key, loader(mode))
            except (TimeoutError, ConnectionError, FailClosed):
                pass

        tasks = []
        for key, mode, patience, dt in steps:
            await asyncio.sleep(dt)
            if mode == "invalidate":
                cache.invalidate(key)
            else:
                tasks.append(asyncio.create_task(read(key, mode, patience)))
            for _ in range(3):
                await asyncio.sleep(0)
            live = [t for t in refreshes if not t.done()]
            if len(cache) > max_entries or len(live) > max_entries:
                bad.append(f"{len(cache)} entries, {len(live)} refreshes > {max_entries}")
            # private: the count that caps refreshes has no public read; compared to the tasks
            if cache._refreshing != len(live):
                bad.append(f"the cache counts {cache._refreshing} refreshes, {len(live)} run")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(HANG * 2)
        if len(asyncio.all_tasks()) > 1 or cache._flights or cache._refreshing:
            bad.append(f"left: {asyncio.all_tasks()}, {cache._flights}, {cache._refreshing}")

    run_on_virtual_time(main)
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("backoff", [-1.0, -math.inf, math.nan])
def test_failure_backoff_must_be_a_duration(backoff: float) -> None:
    """A backoff that is not a duration is refused where it is configured, like the other
    bounds: NaN would make ``now >= retry_at`` false for ever, so one failed refresh would
    stop the key from ever being refreshed in the background again."""
    with pytest.raises(ValueError, match="failure_backoff"):
        StaleCache(max_entries=1, fresh_for=1, max_staleness=2, failure_backoff=backoff)
