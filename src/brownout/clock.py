"""Monotonic clocks.

brownout never measures a duration with wall-clock time. Async code reads the running event
loop's clock (``loop.time()``), so that tests can run the real code on virtual time (e.g.
``looptime``) and the simulator can drive the same policy objects on a virtual loop. Outside a
running loop (threads, sync code) the default clock falls back to ``time.monotonic()``, which is
the time base of the standard asyncio and uvloop loops.
"""

from __future__ import annotations

import time
from asyncio import _get_running_loop
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "LoopClock", "ManualClock", "MonotonicClock", "default_clock", "now"]


@runtime_checkable
class Clock(Protocol):
    """Anything that tells monotonic time in seconds."""

    def now(self) -> float:
        """Return the current monotonic time in seconds."""
        ...


def now() -> float:
    """Monotonic now: the running loop's time when there is one, else ``time.monotonic()``."""
    loop = _get_running_loop()
    if loop is not None:
        return loop.time()
    return time.monotonic()


class LoopClock:
    """The default clock: the running loop's time, or ``time.monotonic()`` outside a loop."""

    __slots__ = ()

    def now(self) -> float:
        loop = _get_running_loop()
        if loop is not None:
            return loop.time()
        return time.monotonic()

    def __repr__(self) -> str:
        return "LoopClock()"


class MonotonicClock:
    """``time.monotonic()`` regardless of any running loop (for threads and sync code)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: deterministic unit tests of timing logic."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; time never goes backwards."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        self._now += seconds

    def set(self, value: float) -> None:
        if value < self._now:
            raise ValueError("a monotonic clock cannot go backwards")
        self._now = value

    def __repr__(self) -> str:
        return f"ManualClock(now={self._now!r})"


_DEFAULT = LoopClock()


def default_clock() -> Clock:
    """The process-wide default clock (a `LoopClock`)."""
    return _DEFAULT
