"""`BacklogMonitor`: a queue's depth and oldest age measured on a period, as gauges.

A `Publisher` measures its queue only while it publishes (and only when it has a bound); a
consumer process, or a producer that falls quiet, would export a stale reading or none. The
monitor measures on its own clock, so the gauges an autoscaler reads stay fresh.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping

from .._clock import Clock, default_clock

__all__ = ["BacklogMonitor"]

_log = logging.getLogger("brownout.durable")

BacklogMeasure = Callable[[], Awaitable[tuple[int | None, float | None]]]


class BacklogMonitor:
    """Measure queue ``queue`` with ``measure`` every ``period`` seconds (`run`, a task) and
    report ``backlog_depth`` / ``backlog_oldest_age`` gauges (`gauges`, for
    `brownout.Stats.watch`). A reading older than ``stale_after`` (default three periods) is
    not reported: an autoscaler should see no value rather than an old one. A failed
    measurement is logged and counted in ``failures``; the loop goes on."""

    def __init__(
        self,
        queue: str,
        measure: BacklogMeasure,
        *,
        period: float = 5.0,
        stale_after: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not 0 < period < math.inf:
            raise ValueError("period must be positive and finite")
        if stale_after is not None and not 0 < stale_after < math.inf:
            raise ValueError("stale_after must be None or positive and finite")
        self.queue = queue
        self.measure = measure
        self.period = period
        self.stale_after = stale_after if stale_after is not None else 3 * period
        self.clock = clock if clock is not None else default_clock()
        self.failures = 0
        self._reading: tuple[int | None, float | None] = (None, None)
        self._read_at = -math.inf

    async def sample(self) -> tuple[int | None, float | None]:
        """Measure once now (bounded by ``period``) and keep the reading."""
        try:
            reading = await asyncio.wait_for(self.measure(), self.period)
        except Exception as e:  # a broker outage must not end the monitor
            self.failures += 1
            _log.warning("backlog of %r not measured: %s: %s", self.queue, type(e).__name__, e)
            return (None, None)
        self._reading = reading
        self._read_at = self.clock.now()
        return reading

    async def run(self) -> None:
        """Measure every ``period`` seconds until cancelled."""
        while True:
            await self.sample()
            await asyncio.sleep(self.period)

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        if self.clock.now() - self._read_at > self.stale_after:
            return
        depth, age = self._reading
        labels = {"source": self.queue}
        if depth is not None:
            yield ("backlog_depth", labels, float(depth))
        if age is not None:
            yield ("backlog_oldest_age", labels, float(age))

    def __repr__(self) -> str:
        return f"BacklogMonitor(queue={self.queue!r}, period={self.period})"
