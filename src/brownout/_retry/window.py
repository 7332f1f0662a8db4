"""A sliding window of counters split into time buckets (the retry budget, throttle, breaker).

The window covers ``window`` seconds as ``buckets`` equal slices. Old slices are zeroed lazily
when time moves on, so reading or adding is O(1) amortised and nothing runs in the background.
Time comes from an injected `Clock`, so tests drive it with a `ManualClock`.
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

    __slots__ = ("_clock", "_head", "_n", "_slice", "_slots", "_width", "totals")

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
        self._slice = window / buckets
        self._slots = [[0] * width for _ in range(buckets)]
        self._head = int(self._clock.now() // self._slice)
        self.totals = [0] * width
        """The running totals over the window; read after `advance`."""

    @property
    def window(self) -> float:
        return self._slice * self._n

    def advance(self) -> list[int]:
        """Drop slices that fell out of the window; return the slot to add to (current slice)."""
        idx = int(self._clock.now() // self._slice)
        head = self._head
        if idx != head:
            steps = idx - head
            totals = self.totals
            if steps >= self._n or steps < 0:
                for slot in self._slots:
                    for i in range(self._width):
                        slot[i] = 0
                for i in range(self._width):
                    totals[i] = 0
            else:
                for s in range(1, steps + 1):
                    slot = self._slots[(head + s) % self._n]
                    for i in range(self._width):
                        totals[i] -= slot[i]
                        slot[i] = 0
            self._head = idx
        return self._slots[idx % self._n]

    def add(self, index: int, amount: int = 1) -> None:
        """Add ``amount`` to counter ``index`` in the current slice."""
        slot = self.advance()
        slot[index] += amount
        self.totals[index] += amount

    def sums(self) -> list[int]:
        """The totals over the window, after dropping expired slices."""
        self.advance()
        return self.totals
