"""`LoopLag`: how late the event loop runs a callback that is due, measured by a timer probe.

The delay the loop adds to every wakeup of every request on it: a process short of CPU (a
noisy neighbour, a CFS quota, a flood of refusals to write) shows it as lateness, whatever the
work is waiting on. The `Bulkhead` reads it twice: an adaptive limit learns from the work's
latency less this delay (the loop's lag is not the dependency queueing), and while the lag is
high, work that cannot start at once is refused at once rather than queued (a queued request
costs a future and a timer and waits longer than the queue's bound says).

One probe per event loop (`loop_lag`), started on first use, ticking every ``interval``
(10 ms): about a hundred cheap callbacks a second. `observe` is the whole arithmetic, so unit
tests drive it on virtual time without a loop.
"""

from __future__ import annotations

import asyncio
import math
import weakref

__all__ = ["LoopLag", "loop_lag"]


class LoopLag:
    """Lateness of a periodic loop timer: ``mean`` (an EWMA with time constant ``smoothing``,
    seconds of loop time) and ``peak`` (the largest lateness, halving every ``smoothing``)."""

    __slots__ = (
        "__weakref__",
        "_expected",
        "_handle",
        "_loop",
        "interval",
        "lag",
        "mean",
        "peak",
        "smoothing",
        "ticks",
    )

    def __init__(self, *, interval: float = 0.01, smoothing: float = 0.1) -> None:
        if not (0 < interval < math.inf and 0 < smoothing < math.inf):  # NaN too
            raise ValueError("interval and smoothing must be positive and finite")
        self.interval = interval
        self.smoothing = smoothing
        self.lag = 0.0
        """The latest lateness, seconds."""
        self.mean = 0.0
        """Smoothed lateness, seconds: the delay a wakeup on this loop is expected to see."""
        self.peak = 0.0
        self.ticks = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expected = 0.0

    def observe(self, lateness: float, elapsed: float) -> None:
        """Record one tick that ran ``lateness`` seconds late, ``elapsed`` seconds after the
        previous one."""
        late = lateness if lateness > 0.0 else 0.0
        weight = 1.0 - math.exp(-elapsed / self.smoothing) if elapsed > 0.0 else 0.0
        self.lag = late
        self.mean += weight * (late - self.mean)
        decayed = self.peak * 0.5 ** (elapsed / self.smoothing) if elapsed > 0.0 else self.peak
        self.peak = late if late > decayed else decayed
        self.ticks += 1

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start ticking on ``loop`` (default: the running loop). Idempotent."""
        if self._handle is not None:
            return
        self._loop = loop = loop if loop is not None else asyncio.get_running_loop()
        self._expected = loop.time() + self.interval
        self._handle = loop.call_at(self._expected, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        late = now - self._expected
        self.observe(late, late + self.interval)
        self._expected = now + self.interval
        self._handle = loop.call_at(self._expected, self._tick)

    def __repr__(self) -> str:
        return f"LoopLag(mean={self.mean * 1000:.2f} ms, peak={self.peak * 1000:.2f} ms)"


_PROBES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = weakref.WeakKeyDictionary()


def loop_lag(loop: asyncio.AbstractEventLoop | None = None) -> LoopLag:
    """The shared probe of ``loop`` (default: the running loop), started on first use."""
    loop = loop if loop is not None else asyncio.get_running_loop()
    probe = _PROBES.get(loop)
    if probe is None or not probe.running:
        probe = _PROBES[loop] = LoopLag()
        probe.start(loop)
    return probe
