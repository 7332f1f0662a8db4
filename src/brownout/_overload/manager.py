"""`OverloadManager`: local pressure -> overload level -> protective actions (A7, S1).

Like a proxy's overload manager: a few resource signals (event-loop lag, memory, file
descriptors, a bulkhead's utilization or queue age) are read periodically; the highest
pressure sets an *overload level* through thresholds with hysteresis (enter at one pressure,
leave only below a lower one, and not sooner than ``min_dwell`` after the last change, so the
level does not flap). Each level names the priorities to shed: bulkheads given this manager
(``Bulkhead(..., overload=manager)`` or `attach`) refuse work below ``shed_below`` with
``Rejected(Reason.OVERLOADED)``. Other parts (degradation) `subscribe` to level changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .._clock import Clock, default_clock
from .._priority import Priority
from ..events import EventHub, OverloadLevelChanged
from ..events import hub as default_hub
from .signals import Signal

__all__ = ["DEFAULT_LEVELS", "OverloadLevel", "OverloadManager"]

_log = logging.getLogger("brownout.overload")


@dataclass(frozen=True, slots=True)
class OverloadLevel:
    """One overload level: entered at pressure >= ``enter``, left below ``exit``; while in
    it, work of priority below ``shed_below`` is refused."""

    enter: float
    exit: float
    shed_below: Priority
    name: str = ""

    def __post_init__(self) -> None:
        if not self.exit < self.enter:
            raise ValueError("a level's exit threshold must be below its enter threshold")


DEFAULT_LEVELS: tuple[OverloadLevel, ...] = (
    OverloadLevel(0.80, 0.70, Priority.SHEDDABLE_PLUS, "pressure"),
    OverloadLevel(0.90, 0.80, Priority.CRITICAL, "overload"),
    OverloadLevel(1.00, 0.90, Priority.CRITICAL_PLUS, "critical"),
)
"""Level 1 at 80% sheds SHEDDABLE; level 2 at 90% sheds everything below CRITICAL; level 3
at 100% keeps only CRITICAL_PLUS (health checks, control traffic)."""

LevelCallback = Callable[[int, int], None]
"""Called with ``(old_level, new_level)`` on every change."""


class OverloadManager:
    """Maps signals to an overload level with hysteresis, and the level to shedding.

    ``levels`` are ordered by rising ``enter``; level 0 is normal (sheds nothing).
    ``interval``: seconds between readings when `start`-ed. ``min_dwell``: seconds a level
    holds before the manager may step *down* (stepping up is immediate).
    """

    def __init__(
        self,
        signals: Sequence[Signal],
        *,
        levels: Sequence[OverloadLevel] = DEFAULT_LEVELS,
        interval: float = 0.25,
        min_dwell: float = 1.0,
        name: str = "overload",
        clock: Clock | None = None,
        events: EventHub | None = None,
    ) -> None:
        if any(b.enter < a.enter for a, b in itertools.pairwise(levels)):
            raise ValueError("levels must be ordered by rising enter threshold")
        # NaN compares false everywhere: a NaN min_dwell would never let the level step down
        # (shedding for good), a NaN or zero interval would spin or corrupt the loop's timers.
        if not (0 < interval < math.inf and 0 <= min_dwell < math.inf):
            raise ValueError("interval must be finite and > 0, min_dwell finite and >= 0")
        self.signals = list(signals)
        self.levels = tuple(levels)
        self.interval = interval
        self.min_dwell = min_dwell
        self.name = name
        self._clock = clock if clock is not None else default_clock()
        self._events = events if events is not None else default_hub
        self.level = 0
        """The current overload level (0: normal)."""
        self.shed_below = 0
        """Bulkheads refuse priorities below this (an int of `Priority`; 0 sheds nothing)."""
        self.pressures: dict[str, float] = {}
        """The latest reading of each signal."""
        self._changed_at = -float("inf")
        self._callbacks: tuple[LevelCallback, ...] = ()
        self._complained: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    # -- reading -----------------------------------------------------------------------------
    def pressure(self) -> float:
        """Read every signal; return the highest pressure. A signal that raises is logged
        once and skipped: a broken probe must not shed traffic."""
        top = 0.0
        for s in self.signals:
            try:
                value = s.read()
            except Exception:
                if s.name not in self._complained:
                    self._complained.add(s.name)
                    _log.exception("overload signal %s failed; ignoring it", s.name)
                continue
            if value != value:  # NaN: no reading at all, treated as a failed probe
                if s.name not in self._complained:
                    self._complained.add(s.name)
                    _log.error("overload signal %s read NaN; ignoring it", s.name)
                continue
            self.pressures[s.name] = value
            if value > top:
                top = value
        return top

    def update(self) -> int:
        """Read the signals and move the level (with hysteresis); returns the level."""
        p = self.pressure()
        now = self._clock.now()
        old = self.level
        new = old
        while new < len(self.levels) and p >= self.levels[new].enter:
            new += 1
        if new == old and now - self._changed_at >= self.min_dwell:
            while new > 0 and p < self.levels[new - 1].exit:
                new -= 1
        if new != old:
            self._set(new, now)
        return self.level

    def _set(self, new: int, now: float) -> None:
        old = self.level
        self.level = new
        self.shed_below = int(self.levels[new - 1].shed_below) if new else 0
        self._changed_at = now
        if self._events.enabled:
            threshold = self.levels[max(new, old) - 1].exit
            drivers = tuple(sorted(n for n, v in self.pressures.items() if v >= threshold))
            self._events.emit(OverloadLevelChanged(now, self.name, old, new, drivers))
        for cb in self._callbacks:
            try:
                cb(old, new)
            except Exception:
                _log.exception("overload subscriber %r raised", cb)

    def force(self, level: int) -> None:
        """Set the level by hand (drills, tests, an operator's override)."""
        if not 0 <= level <= len(self.levels):
            raise ValueError(f"level must be in 0..{len(self.levels)}")
        if level != self.level:
            self._set(level, self._clock.now())

    # -- actions -----------------------------------------------------------------------------
    def subscribe(self, callback: LevelCallback) -> Callable[[], None]:
        """Call ``callback(old, new)`` on every level change; returns an unsubscribe function."""
        self._callbacks = (*self._callbacks, callback)

        def unsubscribe() -> None:
            self._callbacks = tuple(c for c in self._callbacks if c is not callback)

        return unsubscribe

    def attach(self, *bulkheads: object) -> None:
        """Make ``bulkheads`` shed by this manager's level (sets their ``overload``)."""
        for b in bulkheads:
            b.overload = self  # type: ignore[attr-defined]

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Live state for exporters: the level and each signal's latest pressure."""
        yield ("overload_level", {"source": self.name}, float(self.level))
        # A C-level copy: exporters read from other threads while the loop adds signals.
        for signal, value in list(self.pressures.items()):
            yield ("overload_pressure", {"source": self.name, "signal": signal}, value)

    def sheds(self, priority: Priority) -> bool:
        """Whether work of ``priority`` is refused at the current level."""
        return priority < self.shed_below

    # -- running -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the signal probes that need the loop and a periodic `update` task."""
        if self._task is not None:
            return
        for s in self.signals:
            start = getattr(s, "start", None)
            if callable(start):
                start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        while True:
            self.update()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Stop the periodic task and the probes, and return to level 0: nothing reads the
        signals any more, so nothing would ever lower the level (a stopped manager sheds
        nothing, as a broken probe does not)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in self.signals:
            stop = getattr(s, "stop", None)
            if callable(stop):
                stop()
        if task is not None and self.level:
            self._set(0, self._clock.now())

    async def __aenter__(self) -> OverloadManager:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"OverloadManager(level={self.level}, shed_below={self.shed_below})"
