"""A sliding window of counters split into time buckets (the retry budget, throttle, breaker).

The window covers ``window`` seconds as ``buckets`` equal slices. Old slices are zeroed lazily
when time moves on, so reading or adding is O(1) amortised and nothing runs in the background.
Time comes from an injected `Clock`, so tests drive it with a `ManualClock`. No lock of its
own: each owner (budget, throttle, breaker) holds its lock around a read-and-update.

Slices are found by ``now // slice``, but a count's expiry is also kept as a time: the float
``t + window`` can land a hair short of the slice boundary ``now // slice`` needs to cross
(``100 + 1/3 + 1/3`` divided by ``1/3`` floors to 301, the index of ``100 + 1/3``), so the
index alone could keep a count a whole window after it was added. Each slice therefore
remembers when its newest count expires, and the oldest slice still counted is dropped once
the clock reaches that time.
"""

from __future__ import annotations

import math

from .._clock import Clock, default_clock

__all__ = ["SlidingCounters"]


class SlidingCounters:
    """``width`` running totals over the last ``window`` seconds, in ``buckets`` slices.

    The totals include the current (partial) slice, so they cover between
    ``window - window/buckets`` and ``window`` seconds of history.
    """

    __slots__ = (
        "_clock",
        "_expires",
        "_head",
        "_n",
        "_slice",
        "_slots",
        "_width",
        "_window",
        "totals",
    )

    def __init__(
        self,
        width: int,
        *,
        window: float = 10.0,
        buckets: int = 10,
        clock: Clock | None = None,
    ) -> None:
        # (NaN fails too; an infinite window would never slide: counts would never expire)
        if not (0 < window < math.inf and 1 <= buckets < math.inf and width >= 1):
            raise ValueError("window must be finite and > 0, buckets >= 1 and width >= 1")
        self._clock = clock or default_clock()
        self._n = buckets
        self._width = width
        self._window = window
        self._slice = window / buckets
        self._slots = [[0] * width for _ in range(buckets)]
        # When each slice's newest count is a whole window old (inf: nothing to expire).
        self._expires = [math.inf] * buckets
        self._head = int(self._clock.now() // self._slice)
        self.totals = [0] * width
        """The running totals over the window; read after `advance`."""

    @property
    def window(self) -> float:
        return self._window

    def _drop(self, now: float) -> int:
        """Zero the slices that left the window at ``now``; return ``now``'s slice index."""
        idx = int(now // self._slice)
        head = self._head
        n = self._n
        totals = self.totals
        if idx != head:
            steps = idx - head
            if steps >= n or steps < 0:
                for slot in self._slots:
                    for i in range(self._width):
                        slot[i] = 0
                for i in range(self._width):
                    totals[i] = 0
                for s in range(n):
                    self._expires[s] = math.inf
            else:
                for s in range(1, steps + 1):
                    pos = (head + s) % n
                    slot = self._slots[pos]
                    for i in range(self._width):
                        totals[i] -= slot[i]
                        slot[i] = 0
                    self._expires[pos] = math.inf
            self._head = idx
        # The oldest slice still counted (the current one when there is one slice): rounding
        # can leave ``idx`` one short of dropping it when its counts are a whole window old.
        oldest = (idx + 1) % n
        if now >= self._expires[oldest]:
            slot = self._slots[oldest]
            for i in range(self._width):
                totals[i] -= slot[i]
                slot[i] = 0
            self._expires[oldest] = math.inf
        return idx

    def advance(self) -> list[int]:
        """Drop slices that fell out of the window; return the slot to add to (current slice).

        The caller adds to the slot (and to `totals`) right away: the slot's counts are taken
        to be added now, and expire a whole window from now."""
        now = self._clock.now()
        pos = self._drop(now) % self._n
        self._expires[pos] = now + self._window
        return self._slots[pos]

    def add(self, index: int, amount: int = 1) -> None:
        """Add ``amount`` to counter ``index`` in the current slice."""
        slot = self.advance()
        slot[index] += amount
        self.totals[index] += amount

    def sums(self) -> list[int]:
        """The totals over the window, after dropping expired slices."""
        self._drop(self._clock.now())
        return self.totals
