"""Wait queues: bounded in size and age, priority classes, policies (A3, A4, S3, S5)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout import Priority, Reason
from brownout._admission.queues import RANKS
from brownout.queues import (
    AdaptiveLifoQueue,
    CoDelQueue,
    FifoQueue,
    LifoQueue,
    PriorityCoDelQueue,
    QueueItem,
    WaitQueue,
    rank_of,
)


def item(
    priority: Priority = Priority.CRITICAL,
    caller: str = "c",
    deadline_at: float = math.inf,
    in_progress: bool = False,
    retry: bool = False,
) -> QueueItem:
    return QueueItem(priority, caller, "op", deadline_at, in_progress, retry)


def rank(x: QueueItem) -> int:
    return rank_of(x.priority, x.in_progress, x.retry)


def test_fifo_and_lifo_order_within_a_class() -> None:
    for queue, expected in ((FifoQueue(8, 10), [0, 1, 2]), (LifoQueue(8, 10), [2, 1, 0])):
        items = [item() for _ in range(3)]
        for i, it in enumerate(items):
            assert queue.push(it, float(i)) == (None, None)
        got = [items.index(queue.pop(3.0)[0]) for _ in range(3)]  # type: ignore[arg-type]
        assert got == expected
        assert queue.pop(3.0) == (None, None)


def test_priority_then_in_progress_then_policy() -> None:
    q = FifoQueue(8, 10)
    low = item(Priority.SHEDDABLE)
    new = item(Priority.CRITICAL)
    cont = item(Priority.CRITICAL, in_progress=True)
    top = item(Priority.CRITICAL_PLUS)
    for i, it in enumerate((low, new, cont, top)):
        q.push(it, float(i))
    assert q.peek_rank() == rank_of(Priority.CRITICAL_PLUS, False)
    assert [q.pop(5.0)[0] for _ in range(4)] == [top, cont, new, low]


def test_a_retry_ranks_below_a_first_attempt_of_its_priority_only() -> None:
    """I3: at equal priority (and progress) a first attempt is served before a retry, which
    is the first victim of a full queue; a retry of a higher priority still comes first."""
    retry = item(Priority.CRITICAL, retry=True)
    first = item(Priority.CRITICAL)
    low = item(Priority.SHEDDABLE)
    cont_retry = item(Priority.CRITICAL, in_progress=True, retry=True)
    assert rank(low) < rank(retry) < rank(first) < rank(cont_retry)
    q = LifoQueue(8, 10)  # newest first inside a class: order across classes still holds
    for i, it in enumerate((first, retry, low)):
        q.push(it, float(i))
    assert [q.pop(5.0)[0] for _ in range(3)] == [first, retry, low]

    full = FifoQueue(2, 10)
    older, newer = item(retry=True), item(retry=True)
    full.push(older, 0.0)
    full.push(newer, 1.0)
    assert full.push(item(retry=True), 2.0) == (Reason.QUEUE_FULL, None)  # no rank below
    newcomer = item()
    assert full.push(newcomer, 3.0) == (None, newer)  # the newest retry goes first
    assert full.push(item(Priority.SHEDDABLE), 4.0) == (Reason.QUEUE_FULL, None)


def test_expired_items_are_dropped_at_the_head_and_counted() -> None:
    q = FifoQueue(8, 10)
    dead = item(deadline_at=1.0)
    live = item(deadline_at=10.0)
    q.push(dead, 0.0)
    q.push(live, 0.0)
    assert q.pop(2.0) == (dead, Reason.DEADLINE_EXPIRED)
    assert q.pop(2.0) == (live, None)
    assert (q.expired, q.served) == (1, 1)
    assert q.wait_times.count == 2  # time in queue recorded for every item, however it left


def test_age_bound_drops_old_items() -> None:
    q = FifoQueue(8, max_wait=0.5)
    old, young = item(), item()
    q.push(old, 0.0)
    q.push(young, 0.4)
    assert q.next_expiry(0.4) == pytest.approx(0.5)
    assert q.expire_old(0.6) == [old]
    assert q.size == 1 and q.timed_out == 1
    assert q.pop(0.7) == (young, None)


def test_full_queue_refuses_or_evicts_lowest_newest() -> None:
    q = FifoQueue(2, 10)
    a, b = item(Priority.SHEDDABLE), item(Priority.SHEDDABLE)
    q.push(a, 0.0)
    q.push(b, 1.0)
    assert q.push(item(Priority.SHEDDABLE), 2.0) == (Reason.QUEUE_FULL, None)
    vip = item(Priority.CRITICAL)
    assert q.push(vip, 3.0) == (None, b)  # the newest of the lowest class goes
    assert q.size == 2 and q.evicted == 1 and not b.queued
    assert q.pop(4.0)[0] is vip


def test_caller_share_caps_one_caller() -> None:
    q = FifoQueue(10, 10, caller_share=0.3)
    for _ in range(3):
        assert q.push(item(caller="greedy"), 0.0) == (None, None)
    assert q.push(item(caller="greedy"), 0.0) == (Reason.FAIR_SHARE, None)
    assert q.push(item(caller="other"), 0.0) == (None, None)
    assert q.caller_depth("greedy") == 3
    q.pop(0.0)
    assert q.caller_depth("greedy") == 2
    assert q.push(item(caller="greedy"), 0.0) == (None, None)


def test_codel_drops_to_target_when_queue_stands() -> None:
    q = CoDelQueue(16, max_wait=1.0)  # target 5 ms, interval 100 ms
    assert (q.target, q.interval) == (0.005, 0.1)
    q.push(item(), 0.0)
    assert q.wait_bound(0.05) == pytest.approx(0.1)  # queue emptied recently: interval
    assert not q.overloaded(0.05)
    q.push(item(), 0.09)
    assert q.overloaded(0.1)  # has not emptied for an interval
    assert q.wait_bound(0.1) == pytest.approx(0.005)
    # the bound in force applies to everything waiting
    assert len(q.expire_old(0.1)) == 2
    assert q.size == 0 and q.busy_since is None
    q.push(item(), 0.2)
    assert q.wait_bound(0.21) == pytest.approx(0.1)  # it emptied: back to interval


def test_codel_next_expiry_foresees_the_target() -> None:
    q = CoDelQueue(16, max_wait=1.0)
    q.push(item(), 0.0)
    # the bound drops to 5 ms at 0.1 s, and the item is older than that by then
    assert q.next_expiry(0.0) == pytest.approx(0.1)


def test_adaptive_lifo_switches_under_overload() -> None:
    q = AdaptiveLifoQueue(16, max_wait=10.0, interval=0.1)
    a, b = item(), item()
    q.push(a, 0.0)
    q.push(b, 0.01)
    assert q.pop(0.02)[0] is a  # FIFO while the queue keeps emptying
    c = item()
    q.push(c, 0.05)
    assert q.overloaded(0.2)
    assert q.pop(0.2)[0] is c  # LIFO: the queue has stood since 0.0
    assert q.wait_bound(0.2) == 10.0
    codel = AdaptiveLifoQueue(16, max_wait=10.0, codel=True)
    codel.push(item(), 0.0)
    assert codel.wait_bound(0.2) == pytest.approx(0.005)


def test_remove_is_lazy_but_bounded() -> None:
    q = FifoQueue(4, 100.0)
    for i in range(1000):
        it = item()
        q.push(it, float(i))
        assert q.remove(it, float(i), Reason.QUEUE_TIMEOUT)
        assert not q.remove(it, float(i))
    assert q.size == 0 and q.timed_out == 1000
    assert q._stored <= 2 * q.max_size + 16  # private: lazily removed items, memory only


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        FifoQueue(0)
    with pytest.raises(ValueError):
        FifoQueue(1, max_wait=0)
    with pytest.raises(ValueError):
        FifoQueue(1, caller_share=0)
    with pytest.raises(ValueError):
        CoDelQueue(1, target=0.2, interval=0.1)


QUEUES = st.sampled_from([FifoQueue, LifoQueue, CoDelQueue, AdaptiveLifoQueue, PriorityCoDelQueue])
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.sampled_from(list(Priority)),
            st.booleans(),
            st.sampled_from(["a", "b", "c"]),
            st.one_of(st.none(), st.floats(0.0, 2.0)),
            st.booleans(),  # a retry (I3)
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("expire")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("wait"), st.floats(0.0, 0.3)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@example(  # an enqueue time below the bound's precision: now - 0.25 == 0.0 < 3e-257
    kind=FifoQueue,
    max_size=1,
    max_wait=0.25,
    share=1.0,
    ops=[
        ("wait", 3e-257),
        ("push", Priority.CRITICAL, False, "a", None, False),
        ("wait", 0.25),
        ("expire",),
    ],
)
@example(  # I3: a retry waits behind a first attempt of its class that came after it
    kind=FifoQueue,
    max_size=2,
    max_wait=1.0,
    share=1.0,
    ops=[
        ("push", Priority.CRITICAL, False, "a", None, True),
        ("push", Priority.CRITICAL, False, "b", None, False),
        ("pop",),
        ("push", Priority.CRITICAL, False, "a", None, True),
        ("push", Priority.CRITICAL, False, "b", None, False),  # evicts the retry
        ("pop",),
    ],
)
@given(
    kind=QUEUES,
    max_size=st.integers(1, 6),
    max_wait=st.floats(0.01, 1.0),
    share=st.sampled_from([1.0, 0.5]),
    ops=OPS,
)
def test_queue_invariants(
    kind: type[WaitQueue], max_size: int, max_wait: float, share: float, ops: list[tuple]
) -> None:
    """Never above its size bound; never serves expired or over-age work; serves the best
    class first; every item is accounted for exactly once."""
    q = kind(max_size, max_wait, caller_share=share)
    now = 0.0
    live: list[QueueItem] = []
    pushed = 0
    for op in ops:
        if op[0] == "push":
            _, prio, cont, caller, ttl, retry = op
            it = item(prio, caller, math.inf if ttl is None else now + ttl, cont, retry)
            new = rank(it)
            refusal, victim = q.push(it, now)
            if refusal is None:
                pushed += 1
                live.append(it)
            else:
                assert not it.queued
                if refusal is Reason.QUEUE_FULL:
                    # refused only if nothing queued ranks below the newcomer
                    assert all(rank(x) >= new for x in live)
            if victim is not None:
                # a retry is the first victim of a first attempt of its priority (I3)
                assert rank(victim) < new
                assert rank(victim) == min(rank(x) for x in live)
                live.remove(victim)
        elif op[0] == "pop":
            best = max((rank(x) for x in live), default=-1)
            bounds = [q.wait_bound(now, r) for r in range(RANKS)]  # in force before it leaves
            got, reason = q.pop(now)
            if got is None:
                assert not live
                continue
            live.remove(got)
            assert rank(got) == best  # a retry only when no first attempt of its class waits
            if reason is None:
                assert got.deadline_at > now  # nothing expired is served
                assert now - got.enqueued_at <= bounds[best] + 1e-12
                assert bounds[best] <= q.wait_bound(now) + 1e-12  # None: the loosest
        elif op[0] == "expire":
            bounds = [q.wait_bound(now, r) for r in range(RANKS)]
            for x in q.expire_old(now):
                live.remove(x)
                assert x.enqueued_at + bounds[rank(x)] <= now
            # nothing left is over its bound (the queue's own sum: enqueue time + bound)
            assert all(x.enqueued_at + q.wait_bound(now, rank(x)) > now for x in live)
        elif op[0] == "remove":
            if live:
                victim = live[op[1] % len(live)]
                assert q.remove(victim, now)
                live.remove(victim)
        else:
            now += op[1]
        assert q.size == len(live) <= max_size
        assert all(x.queued for x in live)
        if share < 1:
            for caller in "abc":
                assert sum(1 for x in live if x.caller == caller) <= q.max_per_caller
    left = (
        q.served + q.expired + q.timed_out + q.evicted + q.removed
    )  # every item that left was counted once
    assert left + q.size == pushed


@settings(max_examples=300, deadline=None)
@given(
    kind=QUEUES,
    max_wait=st.floats(1e-6, 1.0),
    at=st.one_of(st.floats(0.0, 1e6), st.floats(0.0, 1e-200)),
)
def test_a_sweep_at_the_next_expiry_expires_the_item(
    kind: type[WaitQueue], max_wait: float, at: float
) -> None:
    """The bulkhead sweeps at `next_expiry`; the item must leave then, whatever the floats
    (else the sweep re-arms at the same instant, over and over)."""
    q = kind(4, max_wait)
    it = item()
    assert q.push(it, at) == (None, None)
    due = q.next_expiry(at)
    assert due is not None and due >= at
    assert q.expire_old(due) == [it]


# -- PriorityCoDelQueue: CoDel and adaptive LIFO per priority class (A3, A4, S3) -----------


def test_priority_codel_sheds_the_standing_class_only() -> None:
    q = PriorityCoDelQueue(16, max_wait=1.0)  # target 5 ms, interval 100 ms, LIFO when standing
    batch = [item(Priority.SHEDDABLE) for _ in range(3)]
    q.push(batch[0], 0.0)
    q.push(batch[1], 0.06)
    # interactive work keeps emptying its own class next to the batch backlog
    for t in (0.02, 0.05, 0.08):
        user = item(Priority.CRITICAL)
        q.push(user, t)
        assert q.pop(t + 0.002) == (user, None)
    q.push(batch[2], 0.099)
    late_user = item(Priority.CRITICAL)
    q.push(late_user, 0.1)
    low, crit = rank_of(Priority.SHEDDABLE, False), rank_of(Priority.CRITICAL, False)
    assert q.standing(0.1, low) and not q.standing(0.1, crit)
    # the batch backlog stood 100 ms: the short bound (the 5 ms target, or two release gaps
    # when slots free less often: here one every 30 ms)
    assert q.wait_bound(0.1, low) == q.short_bound < 0.1
    assert q.wait_bound(0.1, crit) == pytest.approx(0.1)  # interactive did not
    assert q.overloaded(0.1)
    # 20 ms later: batch older than 5 ms goes; the interactive request waiting 20 ms stays
    assert q.expire_old(0.12) == batch
    assert late_user.queued and q.size == 1
    assert q.pop(0.12) == (late_user, None)


def test_priority_codel_serves_a_standing_class_newest_first() -> None:
    q = PriorityCoDelQueue(16, max_wait=1.0)
    first, second = item(Priority.SHEDDABLE), item(Priority.SHEDDABLE)
    q.push(first, 0.0)
    q.push(second, 0.001)
    assert q.pop(0.002)[0] is first  # FIFO while the class keeps emptying
    q.push(item(Priority.SHEDDABLE), 0.05)
    newest = item(Priority.SHEDDABLE)
    q.push(newest, 0.1015)
    # the class has not emptied since 0.0: LIFO, and the 5 ms target
    assert q.pop(0.102) == (newest, None)
    assert len(q.expire_old(0.102)) == 2
    # no LIFO when asked not to
    fifo = PriorityCoDelQueue(16, lifo=False)
    a, b = item(), item()
    fifo.push(a, 0.0)
    fifo.push(b, 0.101)
    assert fifo.pop(0.102) == (a, Reason.QUEUE_TIMEOUT)  # stood: a waited past the target
    assert fifo.pop(0.102) == (b, None)


def test_priority_codel_continuations_are_their_own_class() -> None:
    # work in progress (S3) is not cut to the target because new work of its priority stands
    q = PriorityCoDelQueue(16)
    q.push(item(Priority.CRITICAL), 0.0)
    cont = item(Priority.CRITICAL, in_progress=True)
    q.push(cont, 0.095)
    assert q.wait_bound(0.12, rank_of(Priority.CRITICAL, True)) == pytest.approx(0.1)
    assert q.wait_bound(0.12, rank_of(Priority.CRITICAL, False)) == pytest.approx(0.005)
    assert len(q.expire_old(0.12)) == 1 and cont.queued


def test_priority_codel_next_expiry_foresees_the_target() -> None:
    q = PriorityCoDelQueue(16)
    q.push(item(), 0.0)
    assert q.next_expiry(0.0) == pytest.approx(0.1)  # the class stands at 0.1: 5 ms by then
    q.push(item(Priority.SHEDDABLE), 0.098)
    assert q.next_expiry(0.0) == pytest.approx(0.1)
    q.pop(0.099)  # the CRITICAL item leaves
    # the batch class became busy at 0.098: it stands at 0.198
    assert q.next_expiry(0.099) == pytest.approx(0.198)
    assert q.wait_bound(0.2) == pytest.approx(0.1)  # the loosest bound of any class
    capped = PriorityCoDelQueue(4, max_wait=0.05)
    capped.push(item(), 0.0)
    assert capped.next_expiry(0.0) == pytest.approx(0.05)  # max_wait caps the interval
    assert capped.expire_old(0.05)


def test_resize_applies_to_arrivals_and_evicts_nobody() -> None:
    q = PriorityCoDelQueue(4, caller_share=0.5)
    items = [item(caller=f"c{i}") for i in range(4)]
    for it in items:
        assert q.push(it, 0.0) == (None, None)
    q.resize(2)
    assert q.size == 4 and all(it.queued for it in items)
    assert q.max_size == 2 and q.max_per_caller == 1
    assert q.push(item(caller="x"), 0.0) == (Reason.QUEUE_FULL, None)
    q.pop(0.0)
    q.pop(0.0)
    q.pop(0.0)
    assert q.push(item(caller="x"), 0.0) == (None, None)
    q.resize(8)
    assert q.max_size == 8 and q.max_per_caller == 4
    with pytest.raises(ValueError):
        q.resize(0)
    with pytest.raises(ValueError):
        PriorityCoDelQueue(1, target=0.2, interval=0.1)
    assert "PriorityCoDelQueue" in repr(q)
    assert q.class_depth(rank_of(Priority.CRITICAL, False)) == 2
    assert q.class_busy_since(0) is None
    assert q.class_busy_since(rank_of(Priority.CRITICAL, False)) == 0.0


def test_priority_codel_a_momentary_gap_does_not_end_a_standing_period() -> None:
    crit = rank_of(Priority.CRITICAL, False)
    q = PriorityCoDelQueue(16)  # target 5 ms
    # sustained overload: the class empties for a moment (slots took every waiter at once)
    # and refills 1 ms later while the slots are still busy: the same busy period
    t = 0.0
    while t < 0.15:
        q.push(item(), t)
        q.pop(t + 0.0005)
        t += 0.0015
    q.push(item(), t)
    assert q.class_busy_since(crit) == 0.0 and q.standing(t, crit)
    # a gap of at least the target starts a new period
    q.pop(t)
    q.push(item(), t + 0.005)
    assert q.class_busy_since(crit) == pytest.approx(t + 0.005)


def test_priority_codel_service_below_a_class_ends_its_busy_period() -> None:
    # interactive at half the capacity next to a batch backlog: arrivals less than the target
    # apart, but each time batch work was served in between, so the interactive class was
    # caught up with and never stands (S3)
    crit = rank_of(Priority.CRITICAL, False)
    q = PriorityCoDelQueue(64)
    for _ in range(20):
        q.push(item(Priority.SHEDDABLE), 0.0)
    t = 0.0
    while t < 0.3:
        q.push(item(), t)
        assert q.pop(t + 0.001)[0].priority is Priority.CRITICAL  # type: ignore[union-attr]
        q.pop(t + 0.003)  # the next slot goes to batch work
        q.push(item(Priority.SHEDDABLE), t + 0.003)
        t += 0.004
    q.push(item(), t)
    assert not q.standing(t + 0.001, crit)
    assert q.wait_bound(t + 0.001, crit) == pytest.approx(0.1)


def test_priority_codel_short_bound_is_one_round_trip_of_the_work() -> None:
    # 8 slots x 160 ms: a slot frees every 20 ms when all are busy, but not evenly (an event
    # loop on a busy host frees them in bursts, once per turn); a 5 ms bound would age every
    # standing waiter out before the next burst, so a standing class may wait a round trip
    q = PriorityCoDelQueue(64)
    assert (q.short_bound, q.long_bound) == (0.005, 0.1)
    for _ in range(200):
        q.note_service(0.16, 8)
    assert q.release_gap == pytest.approx(0.02, rel=0.01)
    assert q.service_time == pytest.approx(0.16, rel=0.01)
    assert q.short_bound == pytest.approx(0.16, rel=0.01) == q.long_bound  # interval >= it
    for _ in range(200):  # 1 slot x 50 ms: two release gaps exceed one round trip
        q.note_service(0.05, 1)
    assert q.short_bound == pytest.approx(0.1, rel=0.01)
    capped = PriorityCoDelQueue(64, max_wait=0.03)
    for _ in range(200):
        capped.note_service(0.16, 8)
    assert capped.short_bound == capped.long_bound == 0.03
    fast = PriorityCoDelQueue(64)
    for _ in range(200):
        fast.note_service(0.002, 10)  # 2 ms work: the 5 ms target stands
    assert fast.short_bound == 0.005
    assert fast.long_bound == pytest.approx(0.1)


# -- bounded: 100,000 distinct callers -------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [FifoQueue, LifoQueue, CoDelQueue, AdaptiveLifoQueue, PriorityCoDelQueue],
    ids=lambda m: m.__name__,
)
def test_bounded_per_caller_counts_and_lazily_removed_items(make: type[WaitQueue]) -> None:
    """Each of 100,000 callers queues once and leaves every way an item can leave (served,
    removed from the middle, evicted, aged out): the per-caller table holds only callers
    with an item waiting, and items removed lazily never outnumber the compaction bound."""
    q = make(max_size=64, max_wait=1.0, caller_share=0.25)
    now = 0.0
    for i in range(100_000):
        p = Priority(i % 4)
        it = item(p, caller=f"c{i}")
        q.push(it, now)
        if i % 5 == 1:
            q.remove(it, now)
        elif i % 5 == 2:
            q.pop(now)
        elif i % 5 == 3:
            now += 0.2
            q.expire_old(now)
        assert q.size <= 64
        # private: per-caller counts of callers no longer waiting show only as memory
        assert len(q._per_caller) == q.size  # one item each: only waiting callers
        assert q._stored <= 2 * 64 + 16 + 1
    while q.size:
        q.pop(now)
    assert q._per_caller == {}


def test_a_class_stands_only_after_several_round_trips_of_slow_work() -> None:
    # In front of 40 ms work a class that has not emptied for 130 ms (an adaptive limit's
    # probe: two round trips at half the limit) is not a standing queue yet: its waiters keep
    # the long bound and FIFO order. Four round trips behind, it stands.
    q = PriorityCoDelQueue(max_size=64)
    for _ in range(200):
        q.note_service(0.040, 10)
    assert q.short_bound == pytest.approx(0.040, rel=0.01)
    rank = rank_of(Priority.CRITICAL, False)
    item = QueueItem(Priority.CRITICAL)
    q.push(item, 10.0)
    assert not q.standing(10.130, rank)
    assert q.wait_bound(10.130, rank) == q.long_bound
    assert q.standing(10.170, rank)
    assert q.wait_bound(10.170, rank) == q.short_bound
