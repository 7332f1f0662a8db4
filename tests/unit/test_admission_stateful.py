"""Property tests of a whole `Bulkhead` under concurrent work, on virtual time (looptime).

Hypothesis draws a configuration (limit kind and bounds, queue kind, size and age bounds,
caller share, reserve, priority shares, estimator, an `OverloadManager` whose pressure moves,
the event sinks: full events + `Stats`, `Stats` alone (the tallying ledger), or none) and a
script of concurrent work: arrivals with priority, caller, operation, work-in-progress flag,
deadline or none, service time, outcome (success, failure, a downstream refusal, a timeout,
work that outlives its deadline, the deadline enforced inside the work), `try_admit` with
manual settling, and callers that cancel at random moments. The script runs on a looptime
loop, so every timer of the bulkhead (sweep, deadline timers) fires at its virtual time.

Checked, each against MISSION IDs, at the instant of each decision (a sink sees the event
synchronously), at every quiescent moment (no callback ready at the current virtual time) of
a poller, and at the end:

- A1/A6: a grant never takes in-flight over the limit in force (+ reserve, CRITICAL_PLUS
  only); a priority over its share is granted only while nothing higher holds or waits;
- A3/D7: nothing joins the queue at its size bound; no waiter outlives the age bound or its
  deadline; nothing is granted at or after its deadline; DEADLINE_TOO_SHORT only when the
  documented estimate exceeds the remaining time;
- S8/work conservation: no waiter stays queued while a slot it may use is free; no capacity
  refusal while capacity exists (`RequestShed.false_positive` never set);
- S3: no grant passes over a waiter of a higher class (priority, then work in progress)
  unless that waiter is held back by its share; FIFO/LIFO order within a class;
- A5: adaptive limits stay within [min_limit, max_limit];
- A7/S1: the overload manager's ``shed_below`` is applied exactly (refused at entry and at
  dequeue below it, never at or above it);
- O1: per (caller, operation, priority), the events and `Stats` counters equal what the
  callers saw; offered = admitted + shed + expired in queue + abandoned while waiting;
  every permit settled exactly once; in-flight and queue back to 0.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import looptime
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout import Bulkhead, Deadline, OverloadManager, Permit, Priority, Reason, Rejected, Stats
from brownout._admission.queues import CRITICAL_PLUS_RANK
from brownout._overload import DEFAULT_LEVELS
from brownout.events import (
    Event,
    EventHub,
    LimitChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
)
from brownout.limits import AIMDLimit, FixedLimit, Gradient2Limit, LatencyEstimator, VegasLimit
from brownout.queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    rank_of,
)
from brownout.signals import FunctionSignal

EPS = 1e-6
_NEW, _QUEUED, _ADMITTED, _DONE = 0, 1, 2, 3  # Permit states (_admission/permit.py)
TICK = 0.005  # the script's time grain: many things happen at the same instant


# -- the script ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    at: float
    priority: Priority
    caller: str
    operation: str
    in_progress: bool
    ttl: float | None
    service: float
    outcome: str  # ok | error | downstream | timeout | enforce | ignore (try_admit only)
    cancel_after: float | None
    nowait: bool  # try_admit + manual settling
    retry: bool = False  # attempt > 1: ranks below a first attempt of its priority (I3)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.caller, self.operation, self.priority.label)


def grains(lo: int, hi: int) -> st.SearchStrategy[float]:
    return st.integers(lo, hi).map(lambda n: round(n * TICK, 6))


JOB = st.builds(
    Job,
    at=grains(0, 50),
    priority=st.sampled_from(list(Priority)),
    caller=st.sampled_from(["a", "b", "c"]),
    operation=st.sampled_from(["read", "write"]),
    in_progress=st.booleans(),
    retry=st.booleans(),
    ttl=st.one_of(st.none(), grains(0, 60)),
    service=grains(0, 40),
    outcome=st.sampled_from(["ok", "ok", "ok", "error", "downstream", "timeout", "enforce"]),
    cancel_after=st.one_of(st.none(), st.none(), grains(0, 40)),
    nowait=st.sampled_from([False, False, False, True]),
)


@dataclass(frozen=True)
class Config:
    limit: tuple[Any, ...]
    queue: tuple[Any, ...] | None
    reserve: int
    shares: dict[Priority, float] | None
    estimator: str  # off | default | eager | wide
    estimate_every: int
    overload: tuple[tuple[float, float], ...] | None  # (at, pressure) readings
    dwell: float
    sinks: str  # events | tally | none


LIMITS = st.one_of(
    st.tuples(st.just("fixed"), st.integers(1, 4)),
    st.tuples(st.just("aimd"), st.integers(1, 3), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(
        st.sampled_from(["gradient2", "vegas"]),
        st.integers(1, 3),
        st.integers(0, 3),
        st.integers(0, 4),
    ),
)
QUEUES = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from(["fifo", "lifo", "codel", "alifo", "alifo_codel", "pcodel"]),
        st.integers(1, 5),
        st.sampled_from([0.03, 0.1, 0.4]),
        st.sampled_from([1.0, 1.0, 0.5]),
    ),
)
CONFIG = st.builds(
    Config,
    limit=LIMITS,
    queue=QUEUES,
    reserve=st.integers(0, 2),
    shares=st.sampled_from(
        [None, {Priority.SHEDDABLE: 0.5, Priority.SHEDDABLE_PLUS: 0.75}, {Priority.CRITICAL: 0.5}]
    ),
    estimator=st.sampled_from(["off", "default", "eager", "wide"]),
    estimate_every=st.sampled_from([1, 16]),
    overload=st.one_of(
        st.none(),
        st.none(),
        st.lists(
            st.tuples(grains(0, 60), st.sampled_from([0.0, 0.75, 0.85, 0.95, 1.0])),
            min_size=1,
            max_size=6,
        ).map(lambda r: tuple(sorted(r))),
    ),
    dwell=st.sampled_from([0.0, 0.05]),
    sinks=st.sampled_from(["events", "events", "tally", "none"]),
)


def make_limit(spec: tuple[Any, ...]) -> Any:
    kind = spec[0]
    if kind == "fixed":
        return FixedLimit(spec[1])
    lo, initial, hi = spec[1], spec[1] + spec[2], spec[1] + spec[2] + spec[3]
    if kind == "aimd":
        return AIMDLimit(initial, min_limit=lo, max_limit=hi, timeout=0.1)
    make = Gradient2Limit if kind == "gradient2" else VegasLimit
    return make(
        initial,
        min_limit=lo,
        max_limit=hi,
        short_window=2,
        probe_interval=0.3,
        probe_samples=3,
        rng=random.Random(7),
        early_probe_gap=2.0,
    )


def make_queue(spec: tuple[Any, ...] | None) -> Any:
    if spec is None:
        return None
    kind, size, wait, share = spec
    if kind == "fifo":
        return FifoQueue(size, wait, caller_share=share)
    if kind == "lifo":
        return LifoQueue(size, wait, caller_share=share)
    if kind == "codel":
        return CoDelQueue(size, wait, target=0.01, interval=0.05, caller_share=share)
    if kind in ("alifo", "alifo_codel"):
        return AdaptiveLifoQueue(
            size, wait, interval=0.05, codel=kind == "alifo_codel", target=0.01, caller_share=share
        )
    return PriorityCoDelQueue(size, wait, target=0.01, interval=0.05, caller_share=share)


# -- the run -------------------------------------------------------------------------------


@dataclass
class Seen:
    """What one job's caller saw."""

    permit: Permit | None = None
    entered: bool = False
    refused: Reason | None = None
    cancelled: bool = False
    exit: str = ""  # normal | error | downstream | timeout | cancelled | ignore
    ended_at: float = math.nan


@dataclass
class Run:
    config: Config
    jobs: list[Job]
    seen: list[Seen] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    stats: Stats | None = None
    bulkhead: Bulkhead | None = None


class Checker:
    """Checks the decision-time invariants (as a sink); `quiescent` checks the resting ones."""

    def __init__(self, run: Run, b: Bulkhead, manager: OverloadManager | None) -> None:
        self.run = run
        self.b = b
        self.manager = manager
        self.permits: list[tuple[Job, Permit]] = []
        self.granted: set[int] = set()
        self.was_queued: set[int] = set()
        self.stash: RequestAdmitted | None = None
        self.evicted = False
        self.gone: set[int] = set()
        lim = b.limit_algorithm
        self.bounds = (getattr(lim, "min_limit", b.limit), getattr(lim, "max_limit", b.limit))
        self.shares = run.config.shares or {}

    def bad(self, msg: str) -> None:
        self.run.violations.append(f"t={asyncio.get_running_loop().time():.6f} {msg}")

    # ground truth from the permits themselves (private: a permit's admitted/queued/done
    # state, the reserve and the tally rows have no public read; the model needs them)
    def admitted_by_priority(self) -> Counter[Priority]:
        return Counter(p.priority for _, p in self.permits if p._state == _ADMITTED)

    def waiting(self) -> list[Permit]:
        return [p for _, p in self.permits if p._state == _QUEUED and p.queued]

    def share_blocked(self, priority: Priority, extra: int = 0) -> bool:
        """Documented: a priority at its share may borrow only while nothing higher holds
        permits or waits."""
        share = self.shares.get(priority)
        if share is None:
            return False
        held = self.admitted_by_priority()
        if held[priority] - extra < share * self.b.limit:
            return False
        higher_held = any(held[q] for q in Priority if q > priority)
        higher_waits = any(w.priority > priority for w in self.waiting())
        return higher_held or higher_waits

    def emit(self, e: Event) -> None:
        try:
            self._check(e)
        except Exception as error:  # a hub swallows a sink's errors: record them
            self.bad(f"checker raised {error!r}")

    def adopt(self, job: Job, p: Permit) -> None:
        """A permit `try_admit` granted (its event came before the permit was known)."""
        self.permits.append((job, p))
        e, self.stash = self.stash, None
        if e is not None:
            self._granted(p, e, asyncio.get_running_loop().time())
        elif self.run.config.sinks == "events":
            self.bad("try_admit granted without an event")

    def _check(self, e: Event) -> None:
        self.run.events.append(e)
        newly_done = [p for _, p in self.permits if p._state == _DONE and id(p) not in self.gone]
        self.gone.update(id(p) for p in newly_done)
        b = self.b
        now = asyncio.get_running_loop().time()
        if isinstance(e, RequestAdmitted):
            new = [
                p for _, p in self.permits if p._state == _ADMITTED and id(p) not in self.granted
            ]
            if not new:  # try_admit: the permit is adopted when try_admit returns
                self.stash = e
            elif len(new) != 1:
                self.bad(f"admitted event matches {len(new)} permits")
            else:
                self._granted(new[0], e, now)
        elif isinstance(e, RequestQueued):
            for _, p in self.permits:
                if getattr(p, "queued", False) and id(p) not in self.was_queued:
                    self.was_queued.add(id(p))
            # A3; a bound that shrank (the default queue follows the limit) evicts nobody, and
            # a newcomer that evicts a lower waiter replaces it: the queue did not grow
            evicted, self.evicted = self.evicted, False
            if e.depth > b.queue.max_size and not evicted:
                self.bad(f"queue grew to {e.depth} over {b.queue.max_size}")
        elif isinstance(e, RequestShed):
            if e.reason is Reason.QUEUE_FULL:  # a waiter settled by this refusal: evicted
                self.evicted = any(id(p) in self.was_queued for p in newly_done)
            if e.false_positive:  # S8
                self.bad(f"false-positive shed {e.reason.value}")
            if e.reason is Reason.DEADLINE_TOO_SHORT:  # D7
                est = b.estimator
                need = None if est is None else est.estimates.get(e.operation)
                if need is None or e.remaining is None:
                    self.bad("deadline_too_short without an estimate or a deadline")
                else:
                    worst = (b.queue_depth + 1) * need / b.limit + need
                    if e.remaining >= worst + EPS:
                        self.bad(f"too short: {e.remaining} left >= expected {worst}")
            if e.reason is Reason.DEADLINE_EXPIRED and e.remaining:
                self.bad(f"deadline_expired with {e.remaining} left")
            # A7: the manager refuses only below shed_below; at or above it, OVERLOADED is
            # try_admit at a full bulkhead
            m = self.manager
            shed_below = -1 if m is None else m.shed_below
            full = e.reason is Reason.OVERLOADED and self.try_admit_full(e)
            if (
                e.reason is Reason.OVERLOADED
                and m is not None
                and e.priority >= shed_below
                and not full
            ):
                self.bad(f"overloaded {e.priority.label} at shed_below {shed_below}")
        elif isinstance(e, RequestExpired) and e.stage == "queue":
            if (
                now < min((p.deadline_at for p in newly_done), default=-math.inf) - EPS
            ):  # D7: at its deadline
                self.bad(f"expired in queue at {now}, before its deadline")
        elif isinstance(e, LimitChanged):
            lo, hi = self.bounds
            if not lo <= e.new <= hi:  # A5
                self.bad(f"limit {e.new} outside [{lo}, {hi}]")

    def _granted(self, p: Permit, e: RequestAdmitted, now: float) -> None:
        b = self.b
        self.granted.add(id(p))
        cp = p.priority is Priority.CRITICAL_PLUS
        bound = b.limit + (b._reserve if cp else 0)
        if p.in_flight_at_admit > bound:  # A1
            self.bad(f"grant to {p.in_flight_at_admit} in flight over {bound}")
        if b.in_flight != p.in_flight_at_admit:
            self.bad(f"in_flight_at_admit {p.in_flight_at_admit} != {b.in_flight}")
        if now >= p.deadline_at:  # D7, A3
            self.bad(f"granted at {now} past its deadline {p.deadline_at}")
        if self.manager is not None and p.priority < self.manager.shed_below:  # A7
            self.bad(f"granted {p.priority.label} while shedding below {self.manager.shed_below}")
        if not cp and self.share_blocked(p.priority, extra=1):  # A1/S5 shares
            self.bad(f"{p.priority.label} granted past its share while higher work is active")
        rank = rank_of(p.priority, p.in_progress, p.retry)
        for w in self.waiting():  # S3
            wr = rank_of(w.priority, w.in_progress, w.retry)
            if wr > rank and not self.share_blocked(w.priority):
                self.bad(f"granted rank {rank} over waiting rank {wr}")
        if id(p) in self.was_queued:
            if e.queue_wait > b.queue.max_wait + EPS:  # A3
                self.bad(f"waited {e.queue_wait} over max_wait {b.queue.max_wait}")
            kind = type(b.queue).__name__
            same = [
                w for w in self.waiting() if rank_of(w.priority, w.in_progress, w.retry) == rank
            ]
            if kind == "FifoQueue" and any(w.enqueued_at < p.enqueued_at for w in same):
                self.bad("FIFO served a newer waiter first")
            if kind == "LifoQueue" and any(w.enqueued_at > p.enqueued_at for w in same):
                self.bad("LIFO served an older waiter first")

    def try_admit_full(self, e: RequestShed) -> bool:
        """A try_admit refusal at the limit (not the manager's): the bulkhead was full."""
        b = self.b
        cp = e.priority is Priority.CRITICAL_PLUS
        return (
            b.in_flight >= b.limit + (b._reserve if cp else 0)
            or b.queue_depth > 0
            or self.share_blocked(e.priority)
        )

    def quiescent(self) -> None:
        b = self.b
        now = asyncio.get_running_loop().time()
        held = sum(1 for _, p in self.permits if p._state == _ADMITTED)
        if b.in_flight != held:
            self.bad(f"in_flight {b.in_flight} != {held} permits held")
        waiting = self.waiting()
        if b.queue_depth != len(waiting):
            self.bad(f"queue_depth {b.queue_depth} != {len(waiting)} waiters")
        lo, hi = self.bounds
        if not lo <= b.limit <= hi:
            self.bad(f"limit {b.limit} outside [{lo}, {hi}]")
        for p in waiting:  # A3: age and deadline bounds hold while it waits
            if now - p.enqueued_at > b.queue.max_wait + EPS:
                self.bad(f"waiter aged {now - p.enqueued_at} past max_wait {b.queue.max_wait}")
            if now > p.deadline_at + EPS:
                self.bad(f"waiter still queued {now - p.deadline_at} past its deadline")
        if waiting:  # S8: work conservation
            best = max(waiting, key=lambda w: rank_of(w.priority, w.in_progress, w.retry))
            cp = rank_of(best.priority, best.in_progress, best.retry) >= CRITICAL_PLUS_RANK
            room = b.limit + (b._reserve if cp else 0)
            if b.in_flight < room and not self.share_blocked(best.priority):
                self.bad(f"{best.priority.label} waits with {b.in_flight} in flight of {room}")


def run_script(config: Config, jobs: list[Job]) -> Run:
    run = Run(config, sorted(jobs, key=lambda j: j.at))
    jobs = run.jobs

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = EventHub()
        pressure = [0.0]
        manager = None
        if config.overload is not None:
            manager = OverloadManager(
                [FunctionSignal("p", lambda: pressure[0])],
                min_dwell=config.dwell,
                events=hub,
            )
        est: LatencyEstimator | None = None
        if config.estimator == "eager":
            est = LatencyEstimator(min_samples=1)
        elif config.estimator == "wide":
            est = LatencyEstimator(min_samples=2, k=1.0)
        b = Bulkhead(
            "stateful",
            make_limit(config.limit),
            make_queue(config.queue),
            reserve=config.reserve,
            events=hub,
            estimator=est,
            overload=manager,
            deadline_aware=config.estimator != "off",
            estimate_every=config.estimate_every,
            shares=config.shares,
        )
        run.bulkhead = b
        checker = Checker(run, b, manager)
        if config.sinks != "none":
            run.stats = Stats()
            hub.subscribe(run.stats)
        if config.sinks == "events":
            hub.subscribe(checker)
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                await asyncio.sleep(TICK)
                for _ in range(20):  # let this instant settle
                    if not loop._ready:  # type: ignore[attr-defined]
                        break
                    await asyncio.sleep(0)
                else:
                    continue
                due = loop._scheduled  # type: ignore[attr-defined]
                if due and min(h.when() for h in due) <= loop.time():
                    continue
                checker.quiescent()

        async def pressures() -> None:
            assert manager is not None and config.overload is not None
            for at, value in config.overload:
                await asyncio.sleep(max(0.0, at - loop.time()))
                pressure[0] = value
                manager.update()
                expected = 0
                for i, level in enumerate(DEFAULT_LEVELS):
                    if manager.level > i:
                        expected = int(level.shed_below)
                if manager.shed_below != expected:
                    checker.bad(f"level {manager.level} sheds below {manager.shed_below}")

        async def job(i: int, j: Job) -> None:
            seen = run.seen[i]
            deadline = None if j.ttl is None else Deadline.after(j.ttl)
            if j.nowait:
                await nowait(j, seen, deadline)
                return
            p = b.admit(
                priority=j.priority,
                caller=j.caller,
                operation=j.operation,
                deadline=deadline,
                in_progress=j.in_progress,
                retry=j.retry,
            )
            seen.permit = p
            checker.permits.append((j, p))
            try:
                async with p:
                    seen.entered = True
                    await work(j, deadline)
            except Rejected as e:
                if not seen.entered:
                    seen.refused = e.reason
                else:
                    seen.exit = "downstream"
            except asyncio.CancelledError:
                seen.cancelled = True
                seen.exit = "cancelled"
                fut = getattr(p, "_future", None)
                if not seen.entered and fut is not None and fut.done() and not fut.cancelled():
                    # refused first, cancelled before it heard: the refusal is what happened
                    refusal = fut.exception()
                    if isinstance(refusal, Rejected):
                        seen.refused = refusal.reason
            except TimeoutError:
                seen.exit = "timeout"
            except ValueError:
                seen.exit = "error"
            else:
                seen.exit = "normal"
            seen.ended_at = loop.time()

        async def work(j: Job, deadline: Deadline | None) -> None:
            if j.outcome == "enforce" and deadline is not None:
                async with asyncio.timeout(deadline.remaining()):
                    await asyncio.sleep(j.service)
                return
            await asyncio.sleep(j.service)
            if j.outcome == "error":
                raise ValueError("boom")
            if j.outcome == "downstream":
                raise Rejected(Reason.OVERLOADED, "downstream")
            if j.outcome == "timeout":
                raise TimeoutError

        async def nowait(j: Job, seen: Seen, deadline: Deadline | None) -> None:
            try:
                p = b.try_admit(
                    priority=j.priority,
                    caller=j.caller,
                    operation=j.operation,
                    deadline=deadline,
                    in_progress=j.in_progress,
                    retry=j.retry,
                )
            except Rejected as e:
                seen.refused = e.reason
                seen.ended_at = loop.time()
                return
            seen.permit = p
            checker.adopt(j, p)
            seen.entered = True
            try:
                await asyncio.sleep(j.service)
            except asyncio.CancelledError:
                seen.cancelled = True
                seen.exit = "cancelled"
                p.settle_raised(asyncio.CancelledError)
                p.settle_raised(asyncio.CancelledError)  # a second settle is a no-op
                seen.ended_at = loop.time()
                return
            if j.outcome == "error":
                p.failed("ValueError")
                seen.exit = "error"
            elif j.outcome in ("timeout", "enforce"):
                p.dropped()
                seen.exit = "timeout"
            elif j.outcome == "downstream":
                p.ignore()
                seen.exit = "ignore"
            else:
                p.success()
                seen.exit = "normal"
            p.success()  # a second settle is a no-op
            seen.ended_at = loop.time()

        tasks = []
        side = [asyncio.create_task(poll())]
        if manager is not None:
            side.append(asyncio.create_task(pressures()))
        for i, j in enumerate(jobs):
            run.seen.append(Seen())
            await asyncio.sleep(max(0.0, j.at - loop.time()))
            t = asyncio.create_task(job(i, j))
            tasks.append(t)
            if j.cancel_after is not None:
                loop.call_later(j.cancel_after, t.cancel)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.5)  # past every age bound: stray timers would fire now
        done.set()
        await asyncio.gather(*side)
        if b.in_flight or b.queue_depth:
            checker.bad(f"left behind: {b.in_flight} in flight, {b.queue_depth} queued")
        for _, p in checker.permits:
            if p._state != _DONE:
                checker.bad(f"permit never settled: {p!r}")
        if b.ledger is not None:
            hub.flush()
            from brownout._tally_buffer import held

            if any(held(r) for _, _, _, r in b.ledger._rows()):
                checker.bad("ledger rows still hold permits")

    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return run


# -- O1: what the callers saw, what the events and Stats say --------------------------------


def expected_counts(run: Run) -> Counter[tuple[str, tuple[str, str, str], str]]:
    """(kind, key, reason) -> count, derived from what each caller saw (documented mapping)."""
    out: Counter[tuple[str, tuple[str, str, str], str]] = Counter()
    for j, s in zip(run.jobs, run.seen, strict=True):
        k = j.key
        out[("offered", k, "")] += 1
        p = s.permit
        if s.refused is not None:
            if s.refused is Reason.DEADLINE_EXPIRED and hasattr(p, "enqueued_at"):
                out[("expired", k, "queue")] += 1  # it waited: expired in the queue
            else:
                out[("shed", k, s.refused.value)] += 1
            continue
        assert p is not None
        d_at = p.deadline_at
        granted = hasattr(p, "in_flight_at_admit")
        late = s.ended_at >= d_at
        if not granted:  # cancelled while it waited
            assert s.cancelled
            out[("expired", k, "queue") if late else ("abandoned", k, "")] += 1
            continue
        out[("admitted", k, "")] += 1
        if s.exit == "normal":
            out[("completed_late", k, "") if s.ended_at > d_at else ("completed", k, "")] += 1
        elif s.exit in ("error", "downstream"):
            out[("failed", k, "")] += 1
        elif s.exit == "timeout":
            out[("expired", k, "running") if late else ("failed", k, "")] += 1
        elif s.exit == "cancelled":
            out[("expired", k, "running") if late else ("abandoned", k, "")] += 1
        elif s.exit == "ignore":
            out[("ignored", k, "")] += 1  # the caller reports the outcome (see Permit.ignore)
        else:
            raise AssertionError(f"unclassified {s}")
    return out


def event_counts(run: Run) -> Counter[tuple[str, tuple[str, str, str], str]]:
    out: Counter[tuple[str, tuple[str, str, str], str]] = Counter()
    for e in run.events:
        if not isinstance(e, RequestOffered | RequestAdmitted | RequestShed | RequestExpired) and (
            not isinstance(e, RequestCompleted | RequestFailed | RequestAbandoned)
        ):
            continue
        k = (e.caller, e.operation, e.priority.label)
        if isinstance(e, RequestOffered):
            out[("offered", k, "")] += 1
        elif isinstance(e, RequestAdmitted):
            out[("admitted", k, "")] += 1
        elif isinstance(e, RequestShed):
            out[("shed", k, e.reason.value)] += 1
        elif isinstance(e, RequestExpired):
            out[("expired", k, e.stage)] += 1
        elif isinstance(e, RequestCompleted):
            out[("completed", k, "") if e.useful else ("completed_late", k, "")] += 1
        elif isinstance(e, RequestFailed):
            out[("failed", k, "")] += 1
        else:
            out[("abandoned", k, "")] += 1
    return out


def stats_counts(stats: Stats, keys: set[tuple[str, str, str]]) -> Counter[Any]:
    """The same counts read through `Stats.count` (by label), for the keys the script used."""
    out: Counter[tuple[str, tuple[str, str, str], str]] = Counter()
    plain = ("offered", "admitted", "completed", "completed_late", "failed", "abandoned")
    for key in keys:
        caller, op, pr = key
        labels = {"caller": caller, "operation": op, "priority": pr}
        for kind in plain:
            n = stats.count(kind, **labels)
            if n:
                out[(kind, key, "")] += n
        for stage in ("queue", "running"):
            n = stats.count("expired", reason=stage, **labels)
            if n:
                out[("expired", key, stage)] += n
        for reason in Reason:
            n = stats.count("shed", reason=reason.value, **labels)
            if n:
                out[("shed", key, reason.value)] += n
    return out


def check_o1(run: Run) -> list[str]:
    bad: list[str] = []
    want = expected_counts(run)
    want_visible = Counter({key: n for key, n in want.items() if key[0] != "ignored"})
    if run.config.sinks == "events":
        got = event_counts(run)
        if got != want_visible:
            bad.append(f"events {dict(got - want_visible)} vs seen {dict(want_visible - got)}")
    if run.stats is not None:
        got = stats_counts(run.stats, {k for (_, k, _) in want})
        if got != want_visible:
            bad.append(f"stats {dict(got - want_visible)} vs seen {dict(want_visible - got)}")
    # conservation per key, on what the callers saw
    keys = {k for (_, k, _) in want}
    for k in keys:
        n = {
            kind: sum(v for (kd, kk, _), v in want.items() if kd == kind and kk == k)
            for kind in (
                "offered",
                "admitted",
                "shed",
                "completed",
                "completed_late",
                "failed",
                "ignored",
            )
        }
        exp_q = want[("expired", k, "queue")]
        exp_r = want[("expired", k, "running")]
        ab = want[("abandoned", k, "")]
        settled = n["completed"] + n["completed_late"] + n["failed"] + exp_r + n["ignored"]
        ab_after = n["admitted"] - settled
        ab_before = ab - ab_after
        if n["offered"] != n["admitted"] + n["shed"] + exp_q + ab_before or ab_before < 0:
            bad.append(f"O1 conservation broken for {k}: {n}, expired {exp_q}/{exp_r}, ab {ab}")
    return bad


def _job(at: float, priority: Priority, service: float) -> Job:
    return Job(at, priority, "a", "read", False, None, service, "ok", None, False)


@settings(max_examples=120, deadline=None, derandomize=True)
@example(  # the level rises while SHEDDABLE waits: refused when it leaves the queue (A7)
    config=Config(
        ("fixed", 1), ("fifo", 4, 0.4, 1.0), 0, None, "off", 1, ((0.02, 0.85),), 0.0, "events"
    ),
    jobs=[_job(0.0, Priority.CRITICAL, 0.05), _job(0.01, Priority.SHEDDABLE, 0.0)],
)
@example(  # a held-back waiter ages out: the waiter behind it gets the free slot at once
    config=Config(
        ("fixed", 4),
        ("fifo", 4, 0.03, 1.0),
        0,
        {Priority.CRITICAL: 0.5},
        "off",
        1,
        None,
        0.0,
        "events",
    ),
    jobs=[
        _job(0.0, Priority.CRITICAL, 0.2),
        _job(0.0, Priority.CRITICAL, 0.2),
        _job(0.0, Priority.CRITICAL_PLUS, 0.2),
        _job(0.01, Priority.CRITICAL, 0.0),
        _job(0.02, Priority.SHEDDABLE_PLUS, 0.0),
    ],
)
@given(config=CONFIG, jobs=st.lists(JOB, min_size=6, max_size=30))
def test_bulkhead_under_concurrent_work_on_virtual_time(config: Config, jobs: list[Job]) -> None:
    run = run_script(config, jobs)
    problems = run.violations + check_o1(run)
    assert not problems, "\n".join(problems[:10])
