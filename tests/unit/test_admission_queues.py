"""Wait queues: bounded in size and age, priority classes, policies (A3, A4, S3, S5)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brownout import AdaptiveLifoQueue, CoDelQueue, FifoQueue, LifoQueue, Priority, Reason
from brownout.admission.queues import QueueItem, WaitQueue, rank_of


def item(
    priority: Priority = Priority.CRITICAL,
    caller: str = "c",
    deadline_at: float = math.inf,
    in_progress: bool = False,
) -> QueueItem:
    return QueueItem(priority, caller, "op", deadline_at, in_progress)


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
    assert q._stored <= 2 * q.max_size + 16


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        FifoQueue(0)
    with pytest.raises(ValueError):
        FifoQueue(1, max_wait=0)
    with pytest.raises(ValueError):
        FifoQueue(1, caller_share=0)
    with pytest.raises(ValueError):
        CoDelQueue(1, target=0.2, interval=0.1)


QUEUES = st.sampled_from([FifoQueue, LifoQueue, CoDelQueue, AdaptiveLifoQueue])
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.sampled_from(list(Priority)),
            st.booleans(),
            st.sampled_from(["a", "b", "c"]),
            st.one_of(st.none(), st.floats(0.0, 2.0)),
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("expire")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("wait"), st.floats(0.0, 0.3)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
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
            _, prio, cont, caller, ttl = op
            it = item(prio, caller, math.inf if ttl is None else now + ttl, cont)
            refusal, victim = q.push(it, now)
            if refusal is None:
                pushed += 1
                live.append(it)
            else:
                assert not it.queued
                if refusal is Reason.QUEUE_FULL:
                    # refused only if nothing queued ranks below the newcomer
                    assert all(
                        rank_of(x.priority, x.in_progress) >= rank_of(prio, cont) for x in live
                    )
            if victim is not None:
                assert rank_of(victim.priority, victim.in_progress) < rank_of(prio, cont)
                live.remove(victim)
        elif op[0] == "pop":
            best = max((rank_of(x.priority, x.in_progress) for x in live), default=-1)
            got, reason = q.pop(now)
            if got is None:
                assert not live
                continue
            live.remove(got)
            assert rank_of(got.priority, got.in_progress) == best
            if reason is None:
                assert got.deadline_at > now  # nothing expired is served
                assert now - got.enqueued_at <= q.wait_bound(now) + 1e-12
        elif op[0] == "expire":
            for x in q.expire_old(now):
                live.remove(x)
                assert now - x.enqueued_at >= q.wait_bound(now) - 1e-12
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
