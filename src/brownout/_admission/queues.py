"""Wait queues bounded in size *and* age (A3, A4).

A queue holds work that may run soon. It is small and bounded twice: by ``max_size`` items and
by ``max_wait`` seconds of waiting. Every item carries its enqueue time and deadline; an item
whose deadline has passed is dropped when it reaches the head and counted as expired, never run
late; every item's time in queue is recorded (`WaitQueue.wait_times`).

Order: items are served by priority (higher first), then work in progress before new work of
the same priority (S3), then first attempts before retries (I3), then by the queue's policy
inside that class:

- `FifoQueue`: oldest first, the fair default when the queue rarely builds.
- `LifoQueue`: newest first, so under overload the requests still likely to be useful (their
  callers are still waiting) are served, and the old ones time out.
- `CoDelQueue`: controlled delay as in Facebook's "Fail at scale": while the queue has emptied
  within the last ``interval`` (100 ms) an item may wait up to ``interval``; once it has *not*
  emptied for a whole interval (a standing queue), the allowed wait drops to ``target`` (5 ms).
- `AdaptiveLifoQueue`: FIFO normally, LIFO while overloaded (the queue has not emptied for an
  ``interval``); optionally with CoDel's allowed wait too.
- `PriorityCoDelQueue` (the `Bulkhead`'s default): CoDel and adaptive LIFO *per priority
  class*: a class's allowed wait drops to ``target`` and its order turns LIFO only once that
  class itself has not emptied for an ``interval``. Lower classes are served last, so they
  stand first and absorb the shedding; a class whose own demand fits (interactive work next to
  a batch flood) keeps the long bound and is never dropped by the short target.

Fairness (S5): ``caller_share`` caps the part of the queue one caller may hold.

The queues are synchronous data structures with explicit ``now`` arguments (no clock, no loop),
driven by `brownout.Bulkhead`; they never block and never run anything.
"""

from __future__ import annotations

import math
from collections import deque

from .._errors import Reason
from .._histogram import LatencyHistogram
from .._priority import Priority

__all__ = [
    "AdaptiveLifoQueue",
    "CoDelQueue",
    "FifoQueue",
    "LifoQueue",
    "PriorityCoDelQueue",
    "QueueItem",
    "WaitQueue",
    "priority_of_rank",
    "rank_of",
]

RANKS_PER_PRIORITY = 4
"""Service classes per priority: (retry, first attempt) x (new work, work in progress)."""
RANKS = (int(Priority.CRITICAL_PLUS) + 1) * RANKS_PER_PRIORITY
"""How many service classes there are (`rank_of` is below this)."""
_RANKS = RANKS
_STANDING_ROUND_TRIPS = 4.0
"""Round trips of the work (`PriorityCoDelQueue.short_bound`) a class must stay behind for
to count as standing, when that is longer than ``interval``."""
_IDLE = math.inf  # busy-since of an empty class: ``now - _IDLE`` is never >= an interval
CRITICAL_PLUS_RANK = int(Priority.CRITICAL_PLUS) * RANKS_PER_PRIORITY
"""The lowest rank of CRITICAL_PLUS work (a new CRITICAL_PLUS retry)."""


def rank_of(priority: Priority, in_progress: bool, retry: bool = False) -> int:
    """Service order class: priority first, then work in progress before new work (S3),
    then a first attempt before a retry (I3), so retries cannot crowd out new work."""
    return int(priority) * RANKS_PER_PRIORITY + (2 if in_progress else 0) + (0 if retry else 1)


def priority_of_rank(rank: int) -> int:
    """The priority (as an int) of service class ``rank``."""
    return rank // RANKS_PER_PRIORITY


class QueueItem:
    """One waiting unit of work: what the queue needs to order, bound and account it."""

    __slots__ = (
        "caller",
        "deadline_at",
        "enqueued_at",
        "in_progress",
        "operation",
        "priority",
        "queued",
        "retry",
    )

    def __init__(
        self,
        priority: Priority = Priority.CRITICAL,
        caller: str = "unknown",
        operation: str = "unknown",
        deadline_at: float = math.inf,
        in_progress: bool = False,
        retry: bool = False,
    ) -> None:
        self.priority = priority
        self.caller = caller
        self.operation = operation
        self.deadline_at = deadline_at
        """Absolute deadline on the queue's time base (``math.inf``: none)."""
        self.in_progress = in_progress
        self.retry = retry
        """A retry (attempt > 1): it ranks below a first attempt of its class (I3)."""
        self.enqueued_at = 0.0
        self.queued = False
        """True while the item is live in a queue; removal only flips it (lazy deletion)."""


class WaitQueue:
    """Base queue: bounded in size and age, ordered by priority class, FIFO inside a class.

    ``max_size``: most items waiting at once. ``max_wait``: longest any item may wait (s).
    ``caller_share``: the fraction of ``max_size`` one caller may hold (1.0: no cap).
    """

    lifo_policy = False
    """Serve the newest item of a class first."""

    def __init__(self, max_size: int = 64, max_wait: float = 1.0, *, caller_share: float = 1.0):
        if not 1 <= max_size < math.inf:
            raise ValueError("max_size must be at least 1 (and finite)")
        if not 0 < max_wait < math.inf:  # A3: a queue is bounded in age too (NaN refused)
            raise ValueError("max_wait must be positive and finite")
        if not 0 < caller_share <= 1:
            raise ValueError("caller_share must be in (0, 1]")
        self.max_size = int(max_size)
        self.max_wait = float(max_wait)
        self.caller_share = caller_share
        self.max_per_caller = max(1, math.floor(caller_share * max_size))
        self._fair = caller_share < 1.0
        self._per_caller: dict[str, int] = {}
        self._classes: list[deque[QueueItem]] = [deque() for _ in range(_RANKS)]
        self._stored = 0  # live + lazily deleted items held in the deques
        self._top = -1  # no class above this one holds anything (scan start)
        self.size = 0
        """Items waiting now."""
        self.busy_since: float | None = None
        """When the queue last became non-empty (``None`` while empty)."""
        self._counts = [0] * _RANKS  # live items per class
        self._class_busy = [_IDLE] * _RANKS  # when each class last became non-empty
        # A class that empties and gets a new item within ``_memory`` seconds, while no
        # service reached a lower class, continues its busy period (see PriorityCoDelQueue).
        self._memory = 0.0
        self._emptied_at = [-math.inf] * _RANKS
        self._served_at = [-math.inf] * _RANKS  # when each class last had an item served
        self.release_gap = 0.0
        """Smoothed service time over the limit: how often a slot frees when all are busy
        (fed by the `Bulkhead` through `note_service`, on the releases it times)."""
        self.service_time = 0.0
        """Smoothed service time of the work this queue holds (one round trip), as timed by
        the `Bulkhead`: event-loop lag and all, since that is what a waiter waits through."""
        self._stood_since = [_IDLE] * _RANKS
        self.wait_times = LatencyHistogram()
        """Time in queue of every item that left the queue, however it left (A4)."""
        self.served = 0
        self.expired = 0
        self.timed_out = 0
        self.evicted = 0
        self.removed = 0
        self.refused_full = 0
        self.refused_fair = 0

    # -- policy hooks ----------------------------------------------------------------------
    def overloaded(self, now: float) -> bool:
        """Whether the queue counts as overloaded (used by adaptive policies)."""
        return False

    def wait_bound(self, now: float, rank: int | None = None) -> float:
        """How long an item (of class ``rank``) may wait, decided now (the age bound in force).

        With ``rank=None``: the loosest bound any waiting item has now. Its class cannot empty
        while it is in it, so an item's bound does not loosen for that reason; a queue whose
        bounds follow the measured service time (``scales_with_service``) may still raise
        them while it waits, never past ``max_wait``. A `Bulkhead` gives a waiter a deadline
        timer of its own only when its deadline comes before the bound at entry, so under
        such a queue a deadline that passes later is enforced by the sweep, at most
        ``max_wait`` after entry (the edge's own deadline timer cancels the request anyway).
        """
        return self.max_wait

    def _lifo(self, now: float, rank: int) -> bool:
        return self.lifo_policy

    def class_depth(self, rank: int) -> int:
        """Items of service class ``rank`` (see `rank_of`) waiting now."""
        return self._counts[rank]

    def class_busy_since(self, rank: int) -> float | None:
        """When class ``rank`` last became non-empty (``None`` while it is empty)."""
        busy = self._class_busy[rank]
        return None if busy == _IDLE else busy

    def resize(self, max_size: int) -> None:
        """Change the size bound (a `Bulkhead` whose limit moves resizes its default queue).

        Shrinking evicts nobody: the new bound applies to arrivals, so nothing joins while the
        queue is at or above it, and the waiters already in drain or age out.
        """
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.max_size = int(max_size)
        self.max_per_caller = max(1, math.floor(self.caller_share * max_size))

    # -- operations ------------------------------------------------------------------------
    def push(self, item: QueueItem, now: float) -> tuple[Reason | None, QueueItem | None]:
        """Add ``item``. Returns ``(refusal, evicted)``.

        ``refusal`` is `Reason.FAIR_SHARE` or `Reason.QUEUE_FULL` when the item was not
        added. When the queue is full and the newcomer ranks above the lowest-ranked waiter,
        the newest of those lowest-ranked waiters is evicted (returned) so that a higher
        priority is never refused while a lower one waits in its place (and a retry is the
        first victim for a first attempt of its priority, I3).
        """
        fair = self._fair
        if fair and self._per_caller.get(item.caller, 0) >= self.max_per_caller:
            self.refused_fair += 1
            return Reason.FAIR_SHARE, None
        victim: QueueItem | None = None
        rank = item.priority * 4 + (2 if item.in_progress else 0) + (0 if item.retry else 1)
        if self.size >= self.max_size:
            victim = self._evict_below(rank, now)
            if victim is None:
                self.refused_full += 1
                return Reason.QUEUE_FULL, None
        item.enqueued_at = now
        item.queued = True
        self._classes[rank].append(item)
        counts = self._counts
        n = counts[rank]
        if not n:
            self._class_busy[rank] = self._stood_since[rank] if self._continues(rank, now) else now
        counts[rank] = n + 1
        if rank > self._top:
            self._top = rank
        self._stored += 1
        if self.size == 0:
            self.busy_since = now
        self.size += 1
        if fair:
            self._per_caller[item.caller] = self._per_caller.get(item.caller, 0) + 1
        return None, victim

    scales_with_service = False
    """Whether `note_service` matters (the `Bulkhead` skips the call otherwise)."""

    def note_service(self, service_time: float, limit: int) -> None:
        """One finished request's service time at ``limit`` concurrent slots: a slot frees
        every ``service_time / limit`` when all are busy (`release_gap`, smoothed)."""
        self.release_gap += (service_time / limit - self.release_gap) * 0.1
        self.service_time += (service_time - self.service_time) * 0.1
        self._on_release_gap()

    def _on_release_gap(self) -> None:
        """The release gap moved (hook for queues whose bounds scale with it)."""

    def _continues(self, rank: int, now: float) -> bool:
        """Whether class ``rank``, empty now, resumes its last busy period on a new item: it
        emptied less than ``_memory`` ago and no service went to a lower class since (which
        would show the class was caught up with)."""
        emptied = self._emptied_at[rank]
        if now - emptied >= self._memory:
            return False
        served = self._served_at
        return all(served[r] <= emptied for r in range(rank))

    def _evict_below(self, rank: int, now: float) -> QueueItem | None:
        for r in range(rank):
            d = self._classes[r]
            while d:
                victim = d.pop()
                self._stored -= 1
                if victim.queued:
                    self._leave(victim, now)
                    self.evicted += 1
                    return victim
        return None

    def _leave(self, item: QueueItem, now: float) -> None:
        item.queued = False
        self.size -= 1
        if self.size == 0:
            self.busy_since = None
        rank = item.priority * 4 + (2 if item.in_progress else 0) + (0 if item.retry else 1)
        n = self._counts[rank] - 1
        self._counts[rank] = n
        if not n:
            self._emptied_at[rank] = now
            self._stood_since[rank] = self._class_busy[rank]
            self._class_busy[rank] = _IDLE
        self.wait_times.observe(now - item.enqueued_at)
        if self._fair:
            n = self._per_caller[item.caller] - 1
            if n:
                self._per_caller[item.caller] = n
            else:
                del self._per_caller[item.caller]

    def peek_rank(self) -> int:
        """Rank of the class that would be served next (-1 when empty)."""
        if self.size == 0:
            return -1
        for r in range(self._top, -1, -1):
            d = self._classes[r]
            while d:
                if d[0].queued:
                    return r
                d.popleft()
                self._stored -= 1
            if r == self._top:
                self._top = r - 1
        return -1  # pragma: no cover - size > 0 guarantees a live item

    def pop(self, now: float) -> tuple[QueueItem | None, Reason | None]:
        """Take the next item. ``(item, None)``: serve it. ``(item, reason)``: it was dropped
        at the head (`Reason.DEADLINE_EXPIRED` or `Reason.QUEUE_TIMEOUT`), never to run.
        ``(None, None)``: empty."""
        if self.size == 0:
            return None, None
        dynamic = type(self)._lifo is not WaitQueue._lifo
        classes = self._classes
        counts = self._counts
        for r in range(self._top, -1, -1):
            d = classes[r]
            if d:
                lifo = self._lifo(now, r) if dynamic else self.lifo_policy
            while d:
                item = d.pop() if lifo else d.popleft()
                self._stored -= 1
                if not item.queued:
                    continue
                # the bound in force while it waited (decided before it leaves its class)
                too_old = item.enqueued_at + self.wait_bound(now, r) < now
                dead = item.deadline_at <= now
                # leave the queue (inlined _leave: this is the hand-off path)
                item.queued = False
                size = self.size - 1
                self.size = size
                if size == 0:
                    self.busy_since = None
                n = counts[r] - 1
                counts[r] = n
                if not n:
                    self._emptied_at[r] = now
                    self._stood_since[r] = self._class_busy[r]
                    self._class_busy[r] = _IDLE
                self.wait_times.observe(now - item.enqueued_at)
                if self._fair:
                    n = self._per_caller[item.caller] - 1
                    if n:
                        self._per_caller[item.caller] = n
                    else:
                        del self._per_caller[item.caller]
                if dead:
                    self.expired += 1
                    return item, Reason.DEADLINE_EXPIRED
                if too_old:
                    self.timed_out += 1
                    return item, Reason.QUEUE_TIMEOUT
                self.served += 1
                self._served_at[r] = now
                return item, None
            if r == self._top:
                self._top = r - 1
        return None, None  # pragma: no cover

    def remove(self, item: QueueItem, now: float, reason: Reason | None = None) -> bool:
        """Take ``item`` out wherever it is (timer fired, caller gave up). O(1) amortized.

        ``reason`` counts it: `Reason.DEADLINE_EXPIRED` as expired, `Reason.QUEUE_TIMEOUT` as
        timed out, anything else (or ``None``) as removed. False if it was not queued.
        """
        if not item.queued:
            return False
        self._leave(item, now)
        if reason is Reason.DEADLINE_EXPIRED:
            self.expired += 1
        elif reason is Reason.QUEUE_TIMEOUT:
            self.timed_out += 1
        else:
            self.removed += 1
        if self._stored > 2 * self.max_size + 16:
            self._compact()
        return True

    def _compact(self) -> None:
        stored = 0
        for r in range(_RANKS):
            d = self._classes[r]
            if d:
                live = deque(i for i in d if i.queued)
                self._classes[r] = live
                stored += len(live)
        self._stored = stored

    def oldest_age(self, now: float) -> float:
        """Age of the oldest waiting item (0.0 when empty)."""
        oldest = self.oldest_enqueued()
        return 0.0 if oldest is None else now - oldest

    def oldest_enqueued(self) -> float | None:
        """Enqueue time of the oldest waiting item (``None`` when empty)."""
        if self.size == 0:
            return None
        oldest = math.inf
        for d in self._classes:
            while d and not d[0].queued:
                d.popleft()
                self._stored -= 1
            if d and d[0].enqueued_at < oldest:
                oldest = d[0].enqueued_at
        return None if oldest == math.inf else oldest

    def peek_oldest_enqueued(self) -> float | None:
        """`oldest_enqueued` without tidying the queue: for exporters, which may read from
        another thread (a Prometheus server's) while the loop works the queue. Each deque is
        copied in one C call, atomic against the loop under the GIL; queues are small."""
        oldest = math.inf
        for d in list(self._classes):
            for item in list(d):
                if item.queued:
                    if item.enqueued_at < oldest:
                        oldest = item.enqueued_at
                    break
        return None if oldest == math.inf else oldest

    def next_expiry(self, now: float) -> float | None:
        """Earliest time at which some waiting item may exceed the age bound (``None``: empty).

        A sweeper checks `expire_old` then, instead of one timer per item.
        """
        if self.size == 0:
            return None
        at = math.inf
        for r in range(_RANKS):
            d = self._classes[r]
            while d and not d[0].queued:
                d.popleft()
                self._stored -= 1
            if d:
                due = d[0].enqueued_at + self.wait_bound(now, r)
                if due < at:
                    at = due
        return None if at == math.inf else at

    def expire_old(self, now: float) -> list[QueueItem]:
        """Remove and return every item older than the age bound in force now (A3).

        The bound is the same for all items of a class at a given moment and items enter each
        class in age order, so only the oldest end of each class needs looking at.
        """
        out: list[QueueItem] = []
        if self.size == 0:
            return out
        for r in range(_RANKS):
            d = self._classes[r]
            if not d:
                continue
            bound = self.wait_bound(now, r)
            # the same sum as `next_expiry`, so a sweep at the time it gave always expires
            while d and (not d[0].queued or d[0].enqueued_at + bound <= now):
                item = d.popleft()
                self._stored -= 1
                if item.queued:
                    self._leave(item, now)
                    self.timed_out += 1
                    out.append(item)
        return out

    def caller_depth(self, caller: str) -> int:
        """Items ``caller`` has waiting (tracked only when ``caller_share`` < 1)."""
        return self._per_caller.get(caller, 0)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_size={self.max_size}, max_wait={self.max_wait})"


class FifoQueue(WaitQueue):
    """Oldest first within a priority class; bounded in size and age."""


class LifoQueue(WaitQueue):
    """Newest first within a priority class: under overload the freshest requests, whose
    callers are most likely still waiting, are served; old ones age out."""

    lifo_policy = True


class _IntervalQueue(WaitQueue):
    """A queue that watches how long it has stood without emptying (CoDel's ``interval``);
    standing a full interval is overload, and the allowed wait may drop to ``target``."""

    def __init__(
        self,
        max_size: int,
        max_wait: float,
        *,
        target: float,
        interval: float,
        caller_share: float,
    ) -> None:
        super().__init__(max_size, max_wait, caller_share=caller_share)
        if not 0 < target <= interval < math.inf:
            raise ValueError("need 0 < target <= interval < inf")
        self.target = target
        self.interval = interval

    def overloaded(self, now: float) -> bool:
        busy = self.busy_since
        return busy is not None and now - busy >= self.interval

    def _expiry(self, now: float, codel: bool) -> float | None:
        oldest = self.oldest_enqueued()
        if oldest is None:
            return None
        at = oldest + self.wait_bound(now)
        busy = self.busy_since
        if codel and busy is not None and not self.overloaded(now):
            # when the queue has stood for a full interval the bound drops to the target
            at = min(at, max(busy + self.interval, oldest + min(self.target, self.max_wait)))
        return at


class CoDelQueue(_IntervalQueue):
    """Controlled delay (Fail at Scale): allowed wait is ``interval`` while the queue has
    emptied within the last ``interval``, and ``target`` once it has stood for a full interval.

    Defaults: ``target`` 5 ms, ``interval`` 100 ms. ``max_wait`` still caps both.
    """

    def __init__(
        self,
        max_size: int = 64,
        max_wait: float = 1.0,
        *,
        target: float = 0.005,
        interval: float = 0.1,
        caller_share: float = 1.0,
    ) -> None:
        super().__init__(
            max_size, max_wait, target=target, interval=interval, caller_share=caller_share
        )

    def wait_bound(self, now: float, rank: int | None = None) -> float:
        bound = self.target if self.overloaded(now) else self.interval
        return bound if bound < self.max_wait else self.max_wait

    def next_expiry(self, now: float) -> float | None:
        return self._expiry(now, codel=True)


class AdaptiveLifoQueue(_IntervalQueue):
    """FIFO while the queue keeps emptying, LIFO once it has not emptied for ``interval``
    (overload), so fresh requests are served while stale ones age out. With ``codel=True``
    the allowed wait also drops to ``target`` while overloaded (Facebook's combination)."""

    def __init__(
        self,
        max_size: int = 64,
        max_wait: float = 1.0,
        *,
        interval: float = 0.1,
        codel: bool = False,
        target: float = 0.005,
        caller_share: float = 1.0,
    ) -> None:
        super().__init__(
            max_size, max_wait, target=target, interval=interval, caller_share=caller_share
        )
        self.codel = codel

    def _lifo(self, now: float, rank: int) -> bool:
        return self.overloaded(now)

    def wait_bound(self, now: float, rank: int | None = None) -> float:
        if self.codel and self.overloaded(now) and self.target < self.max_wait:
            return self.target
        return self.max_wait

    def next_expiry(self, now: float) -> float | None:
        return self._expiry(now, codel=self.codel)


class PriorityCoDelQueue(WaitQueue):
    """Controlled delay and adaptive LIFO *per priority class* (the `Bulkhead` default).

    Each service class (priority, then work in progress; see `rank_of`) runs its own CoDel:
    while the class has emptied within the last ``interval`` its items may wait up to
    ``interval`` and are served oldest first; once the class has *not* emptied for a whole
    interval (its own standing queue: its demand exceeds what it gets), its allowed wait drops
    to ``target`` and, with ``lifo=True``, its newest items are served first (Facebook's
    adaptive LIFO + CoDel), so the requests whose callers are still waiting run and the stale
    ones are refused quickly instead of run late.

    Why per class (S3): classes are served strictly by rank, so lower priorities stand first
    and absorb the shedding. CRITICAL work next to a SHEDDABLE flood keeps emptying its own
    class, keeps the ``interval`` bound and is never dropped by the short target because
    batch work waits; the target reaches a class only when that class *alone* overloads the
    bulkhead. A whole-queue CoDel (`CoDelQueue`) instead cuts everyone to 5 ms as soon as the
    batch backlog stands, and drops interactive requests that met a few ms of jitter.

    "Emptied" means caught up with: a class that empties for a moment and refills within
    ``target`` while no lower class was served meanwhile (every slot still busy: stale items
    aged out together, or slots freeing at once took every waiter) continues its busy period.

    The bounds scale with the work: a standing class may always wait one round trip of the work
    it queues for (its service time, and at least two *release gaps*, service time / limit, fed
    by the `Bulkhead` from the requests it times), and the interval bound is never below that; a
    class counts as standing once it has not emptied for ``interval`` or four such round trips,
    whichever is longer (a burst of a couple of round trips, such as an adaptive limit's probe,
    is not a standing queue). In front of 1 ms work the 5 ms target stands; in front of a slow
    dependency (1 s x 4 slots: a slot frees every 250 ms) a 5 ms or 100 ms bound would age every
    waiter out before any slot frees and leave slots idle while work is refused; and in front of
    25 ms work on a saturated host, whose event loop frees slots in bursts once per 10-20 ms
    turn, a 5 ms bound refuses every waiter before the next burst.

    Defaults: ``target`` 5 ms, ``interval`` 100 ms (CoDel's), ``lifo`` on; ``max_wait`` (1 s)
    still caps both bounds, ``max_size`` the depth (a `Bulkhead` keeps its default queue as
    long as its current limit).
    """

    def __init__(
        self,
        max_size: int = 64,
        max_wait: float = 1.0,
        *,
        target: float = 0.005,
        interval: float = 0.1,
        lifo: bool = True,
        caller_share: float = 1.0,
    ) -> None:
        super().__init__(max_size, max_wait, caller_share=caller_share)
        if not 0 < target <= interval < math.inf:
            raise ValueError("need 0 < target <= interval < inf")
        self.target = target
        self.interval = interval
        self.lifo = lifo
        # A class empty for a moment has not necessarily drained: under sustained overload
        # a standing class empties whenever its stale items age out together, or slots
        # freeing at once take every waiter, and refills at the next arrival while every
        # slot is still busy. Such a gap continues the busy period (as CoDel stays in its
        # dropping state). A gap of at least the target, or service going to a lower class
        # meanwhile (capacity to spare for this class), starts a new one.
        self._memory = target
        # the bounds in force: ``max_wait`` caps both
        self._short = min(target, self.max_wait)
        self._long = min(interval, self.max_wait)
        self._standing = interval  # how long a class must not empty to be standing

    scales_with_service = True

    def _on_release_gap(self) -> None:
        # A standing class must be allowed to wait for the next slot or two: with a bound
        # shorter than the gap between slot releases (a slow dependency: 80 ms x 8 slots frees
        # one every 10 ms) every waiter ages out before a slot frees, and slots go idle while
        # work is refused. Nor shorter than one round trip of the work: slots do not free
        # evenly. An event loop that takes 10-20 ms per turn (its host's CPU saturated, by a
        # flood of refusals to write, say) frees them in bursts, once per turn; a bound
        # shorter than a turn has refused every waiter by then, and the freed slots idle
        # until new requests are read. The queue is one round trip deep (the `Bulkhead`
        # default), so no waiter that could be served in turn is refused; the stale ones
        # still go at that bound, not the interval. Both measured, not configured; the
        # interval at least the target.
        # (Run on every timed release: comparisons, not min/max calls, written to pick as
        # min/max would.)
        short = 2.0 * self.release_gap
        if short < self.service_time:
            short = self.service_time
        if short < self.target:
            short = self.target
        max_wait = self.max_wait
        interval = self.interval
        self._short = max_wait if max_wait < short else short
        self._memory = short
        long = short if short > interval else interval
        self._long = max_wait if max_wait < long else long
        # Standing means not caught up for several round trips of the work, not for 100 ms
        # of it: in front of 40 ms work, an adaptive limit's probe (its limit pinned at half
        # for two round trips) kept a critical class from emptying for ~130 ms, flipped it
        # to the short bound and LIFO, and refused its oldest waiters.
        standing = _STANDING_ROUND_TRIPS * short
        self._standing = standing if standing > interval else interval

    @property
    def short_bound(self) -> float:
        """The allowed wait of a standing class now: ``target``, or two release gaps when
        slots free less often than that (see `release_gap`), capped by ``max_wait``."""
        return self._short

    @property
    def long_bound(self) -> float:
        """The allowed wait of a class that keeps emptying: ``interval`` (at least
        `short_bound`), capped by ``max_wait``."""
        return self._long

    def standing(self, now: float, rank: int) -> bool:
        """Whether class ``rank`` has not emptied for a full interval (its own overload)."""
        return now - self._class_busy[rank] >= self._standing

    def overloaded(self, now: float) -> bool:
        """Some class has a standing queue."""
        interval = self._standing
        return any(now - busy >= interval for busy in self._class_busy)

    def _lifo(self, now: float, rank: int) -> bool:
        return self.lifo and now - self._class_busy[rank] >= self._standing

    def wait_bound(self, now: float, rank: int | None = None) -> float:
        if rank is None:
            return self._long  # the loosest bound any class can have
        return self._short if now - self._class_busy[rank] >= self._standing else self._long

    def next_expiry(self, now: float) -> float | None:
        if self.size == 0:
            return None
        at = math.inf
        interval = self._standing
        short = self._short
        for r in range(_RANKS):
            d = self._classes[r]
            while d and not d[0].queued:
                d.popleft()
                self._stored -= 1
            if not d:
                continue
            oldest = d[0].enqueued_at
            busy = self._class_busy[r]
            if now - busy >= interval:
                due = oldest + short
            else:
                # the bound drops to the target when the class has stood a full interval
                due = min(oldest + self._long, max(busy + interval, oldest + short))
            if due < at:
                at = due
        return None if at == math.inf else at

    def __repr__(self) -> str:
        return (
            f"PriorityCoDelQueue(max_size={self.max_size}, max_wait={self.max_wait}, "
            f"target={self.target}, interval={self.interval}, lifo={self.lifo})"
        )
