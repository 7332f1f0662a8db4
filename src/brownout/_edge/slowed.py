"""Slowed refusals (S6): hold refusals until about the median success latency, so that a
fast refusal does not invite a faster retry."""

from __future__ import annotations

import asyncio
import heapq
import math

__all__ = ["SlowedRejections"]


class SlowedRejections:
    """Holds refusals until about the median success latency, cheaply (S6).

    Where a fast refusal invites a faster retry, answering it no sooner than a success would
    have been answered removes the incentive. Held refusals cost one future each; one loop
    timer releases them all. At most ``max_held`` are held; beyond that, refusals are answered
    at once (holding must never itself exhaust memory or file descriptors). The hold time is
    ``fraction`` x the median of the last ``window`` success latencies, within
    [``floor``, ``ceiling``] seconds; with no successes seen yet it is ``floor``.
    """

    def __init__(
        self,
        *,
        max_held: int = 1000,
        fraction: float = 1.0,
        floor: float = 0.0,
        ceiling: float = 1.0,
        window: int = 256,
    ) -> None:
        if max_held < 0 or window < 1 or not 0 <= floor <= ceiling:
            raise ValueError("need max_held >= 0, window >= 1 and 0 <= floor <= ceiling")
        self.max_held = max_held
        self.fraction = fraction
        self.floor = floor
        self.ceiling = ceiling
        self._window = window
        self._samples: list[float] = []
        self._next = 0
        self._since_sort = 0
        self._median = 0.0
        self._held: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    # the median: a ring of recent samples, re-sorted every window/8 observations
    def observe(self, latency: float) -> None:
        """Record the latency of one useful success."""
        samples = self._samples
        if len(samples) < self._window:
            samples.append(latency)
        else:
            samples[self._next] = latency
            self._next = (self._next + 1) % self._window
        self._since_sort += 1
        if self._since_sort >= max(1, self._window // 8) or len(samples) < 8:
            self._since_sort = 0
            ordered = sorted(samples)
            self._median = ordered[len(ordered) // 2]

    @property
    def median(self) -> float:
        """The current median success latency estimate (0.0 before any success)."""
        return self._median

    def hold_time(self) -> float:
        """How long the next refusal would be held."""
        t = self._median * self.fraction
        return self.floor if t < self.floor else self.ceiling if t > self.ceiling else t

    @property
    def held(self) -> int:
        """How many refusals are being held now."""
        return len(self._held)

    def hold(self) -> asyncio.Future[None] | None:
        """A future that resolves when this refusal may be answered, or ``None`` to answer
        now (nothing to wait for, or ``max_held`` reached)."""
        delay = self.hold_time()
        if delay <= 0.0 or len(self._held) >= self.max_held:
            return None
        loop = asyncio.get_running_loop()
        at = loop.time() + delay
        fut: asyncio.Future[None] = loop.create_future()
        self._seq += 1
        heapq.heappush(self._held, (at, self._seq, fut))
        if at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = at
            self._timer = loop.call_at(at, self._release)
        return fut

    def _release(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        held = self._held
        loop = asyncio.get_running_loop()
        t = loop.time()
        while held and held[0][0] <= t:
            fut = heapq.heappop(held)[2]
            if not fut.done():
                fut.set_result(None)
        if held:
            self._timer_at = held[0][0]
            self._timer = loop.call_at(self._timer_at, self._release)
