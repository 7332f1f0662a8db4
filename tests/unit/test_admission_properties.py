"""Property tests of the Bulkhead's invariants under random traffic (A1, A3, S3, S8, D7).

A random sequence of arrivals (priority, deadline, work-in-progress flag, caller),
completions and clock advances runs against a bulkhead on a `ManualClock`. After every step:
in-flight never exceeds the limit (plus the CRITICAL_PLUS reserve, for CRITICAL_PLUS only);
nothing whose deadline passed is admitted; the queue stays within its bounds; a higher
priority is never refused or left waiting while a lower one is admitted in its place; and
CRITICAL_PLUS is admitted at once while lower work saturates the bulkhead.
"""

from __future__ import annotations

import asyncio
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import Bulkhead, Deadline, Priority, Reason, Rejected
from brownout.events import Event, EventHub, RequestAdmitted, RequestShed
from brownout.limits import FixedLimit
from brownout.queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    QueueItem,
    priority_of_rank,
    rank_of,
)
from brownout.testing import ManualClock

ARRIVE = st.tuples(
    st.just("arrive"),
    st.sampled_from(list(Priority)),
    st.booleans(),
    st.sampled_from(["a", "b"]),
    st.one_of(st.none(), st.floats(0.01, 0.8), st.floats(0.01, 3.0)),
)
OPS = st.lists(
    st.one_of(
        ARRIVE,
        ARRIVE,
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.6)),
    ),
    max_size=50,
)


class Watcher:
    """A sink that checks ordering invariants at the instant each decision is made."""

    def __init__(self, bulkhead_ref: list[Bulkhead]) -> None:
        self.ref = bulkhead_ref
        self.violations: list[str] = []

    def queued_ranks(self) -> list[int]:
        q = self.ref[0].queue
        # private: the queue's per-class order has no public read (only its head's rank)
        return [
            rank_of(i.priority, i.in_progress, i.retry) for d in q._classes for i in d if i.queued
        ]

    def emit(self, event: Event) -> None:
        if isinstance(event, RequestAdmitted):
            # nothing of higher priority may still be waiting when anything is granted
            best = max(self.queued_ranks(), default=-1)
            if best >= 0 and priority_of_rank(best) > event.priority:
                self.violations.append(f"admitted {event.priority} over waiting rank {best}")
        if isinstance(event, RequestShed) and event.false_positive:
            self.violations.append(f"false positive shed: {event.reason}")  # S8
        if isinstance(event, RequestShed) and event.reason is Reason.QUEUE_FULL:
            lowest = min(self.queued_ranks(), default=99)
            if lowest != 99 and priority_of_rank(lowest) < event.priority:
                self.violations.append(f"refused {event.priority} while {lowest} waits")


@settings(max_examples=150, deadline=None)
@given(
    limit=st.integers(1, 4),
    reserve=st.integers(0, 2),
    max_size=st.integers(1, 5),
    kind=st.sampled_from([FifoQueue, LifoQueue, CoDelQueue, AdaptiveLifoQueue, PriorityCoDelQueue]),
    shares=st.sampled_from([None, {Priority.SHEDDABLE: 0.5, Priority.SHEDDABLE_PLUS: 0.75}]),
    ops=OPS,
)
def test_bulkhead_invariants(
    limit: int,
    reserve: int,
    max_size: int,
    kind: type,
    shares: dict[Priority, float] | None,
    ops: list[tuple],
) -> None:
    asyncio.run(_run(limit, reserve, max_size, kind, shares, ops))


async def _run(
    limit: int,
    reserve: int,
    max_size: int,
    kind: type,
    shares: dict[Priority, float] | None,
    ops: list[tuple],
) -> None:
    clock = ManualClock(100.0)
    events = EventHub()
    ref: list[Bulkhead] = []
    watcher = Watcher(ref)
    events.subscribe(watcher)
    b = Bulkhead(
        "prop",
        FixedLimit(limit),
        kind(max_size, 1.0),
        reserve=reserve,
        clock=clock,
        events=events,
        shares=shares,
    )
    ref.append(b)
    running: list[asyncio.Event] = []
    outcomes: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    async def work(priority: Priority, cont: bool, caller: str, deadline: Deadline | None) -> None:
        release = asyncio.Event()
        try:
            async with b.admit(
                priority=priority, in_progress=cont, caller=caller, deadline=deadline
            ) as permit:
                # admitted: never expired, never beyond the limit
                assert deadline is None or clock.now() < deadline.at, "expired work admitted"
                bound = limit + reserve if priority is Priority.CRITICAL_PLUS else limit
                assert permit.in_flight_at_admit <= bound, "limit exceeded"
                running.append(release)
                await release.wait()
            outcomes.append("done")
        except Rejected as e:
            outcomes.append(e.reason.value)

    async def settle() -> None:
        for _ in range(4):
            await asyncio.sleep(0)

    for op in ops:
        if op[0] == "arrive":
            _, priority, cont, caller, ttl = op
            deadline = None if ttl is None else Deadline.after(ttl, clock=clock)
            saturated_by_lower = b.in_flight < b.limit + reserve and all(
                r < rank_of(priority, False) for r in watcher.queued_ranks()
            )
            before = len(running)
            heard = len(outcomes)
            tasks.append(asyncio.create_task(work(priority, cont, caller, deadline)))
            await settle()
            if priority is Priority.CRITICAL_PLUS and saturated_by_lower:
                # CRITICAL_PLUS gets in at once while lower work saturates the bulkhead,
                # unless its own deadline is too short for the work (D7 applies to it too)
                new = outcomes[heard:]
                too_short = "deadline_too_short" in new or "deadline_expired" in new
                assert len(running) == before + 1 or too_short, "CRITICAL_PLUS was not admitted"
        elif op[0] == "finish":
            if running:
                running.pop(op[1] % len(running)).set()
                await settle()
        else:
            clock.advance(op[1])
        assert b.in_flight <= limit + reserve
        assert b.in_flight == len(running)
        assert b.queue_depth <= max_size
        assert not watcher.violations, watcher.violations
    # drain everything: nothing is lost, every request got an answer
    while running:
        running.pop().set()
        await settle()
    clock.advance(10.0)  # past every age bound and deadline
    if b.queue_depth:
        # private: runs the expiry sweep now instead of waiting on the loop's timer
        b._run_sweep(asyncio.get_running_loop())
        await settle()
    while running:
        running.pop().set()
        await settle()
    await asyncio.gather(*tasks)
    assert len(outcomes) == len(tasks)
    assert b.in_flight == 0 and b.queue_depth == 0
    assert math.isfinite(b.oldest_queue_age())


class ScriptedLimit:
    """An adaptive limit that walks through scripted values, one per finished request."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self._limit = self.values.pop(0)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def adaptive(self) -> bool:
        return True

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        if self.values:
            self._limit = self.values.pop(0)
        return self._limit


@settings(max_examples=100, deadline=None)
@given(limits=st.lists(st.integers(1, 6), min_size=1, max_size=30), ops=OPS)
def test_default_queue_follows_a_moving_limit(limits: list[int], ops: list[tuple]) -> None:
    """The default queue (PriorityCoDelQueue) tracks the limit; nothing joins it at or over
    its bound; grants respect the limit in force; ordering and S8 invariants hold."""
    asyncio.run(_run_moving(limits, ops))


async def _run_moving(limits: list[int], ops: list[tuple]) -> None:
    clock = ManualClock(100.0)
    events = EventHub()
    ref: list[Bulkhead] = []
    watcher = Watcher(ref)
    events.subscribe(watcher)
    b = Bulkhead("moving", ScriptedLimit(limits), clock=clock, events=events, reserve=1)
    ref.append(b)
    joined_over: list[str] = []

    class Grants:
        def emit(self, event: Event) -> None:
            if (
                isinstance(event, RequestAdmitted)
                and event.priority is not Priority.CRITICAL_PLUS
                and b.in_flight > b.limit
            ):
                joined_over.append(f"in flight {b.in_flight} > limit {b.limit}")

    events.subscribe(Grants())
    q = b.queue
    push = q.push

    def checked_push(item: QueueItem, now: float) -> tuple[Reason | None, QueueItem | None]:
        # a shrunk bound evicts nobody, but the queue never grows while at or over it
        before = q.size
        out = push(item, now)
        if q.size > before and q.size > q.max_size:
            joined_over.append(f"grew to {q.size} over bound {q.max_size}")
        return out

    q.push = checked_push  # type: ignore[method-assign]
    running: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []

    async def work(priority: Priority, cont: bool, caller: str, deadline: Deadline | None) -> None:
        release = asyncio.Event()
        try:
            async with b.admit(
                priority=priority, in_progress=cont, caller=caller, deadline=deadline
            ):
                assert deadline is None or clock.now() < deadline.at, "expired work admitted"
                running.append(release)
                await release.wait()
        except Rejected:
            pass

    async def settle() -> None:
        for _ in range(4):
            await asyncio.sleep(0)

    for op in ops:
        if op[0] == "arrive":
            _, priority, cont, caller, ttl = op
            deadline = None if ttl is None else Deadline.after(ttl, clock=clock)
            tasks.append(asyncio.create_task(work(priority, cont, caller, deadline)))
            await settle()
        elif op[0] == "finish":
            if running:
                running.pop(op[1] % len(running)).set()
                await settle()
        else:
            clock.advance(op[1])
            if b.queue_depth:
                b._run_sweep(asyncio.get_running_loop())
                await settle()
        assert b.queue.max_size == max(1, b.limit)
        assert not joined_over, joined_over
        assert not watcher.violations, watcher.violations
    while running:
        running.pop().set()
        await settle()
    clock.advance(10.0)
    if b.queue_depth:
        b._run_sweep(asyncio.get_running_loop())
        await settle()
    while running:
        running.pop().set()
        await settle()
    await asyncio.gather(*tasks)
    assert b.in_flight == 0 and b.queue_depth == 0
