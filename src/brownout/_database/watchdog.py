"""`Watchdog`: one timer for all the statements running under a policy, not one each.

A statement with a budget registers ``(when, expire, arg)`` under its task; one loop timer is
armed for the earliest registration and, when it fires, calls ``expire(arg)`` for whatever
is overdue (the adapter's cancel: the task's, or a cancel request to the server) and re-arms
for the next. A statement that ends removes its registration; the timer is left armed (a
later wake-up finds nothing overdue), so a statement costs a dict write and a dict pop, not
a timer of its own. One registration set per event loop: a policy may serve several loops
(threads, or one loop after another).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

__all__ = ["LoopWatchdog", "Watchdog"]

_running_loop = asyncio.get_running_loop
_EARLY = 1e-6  # a timer may fire this much before its time: overdue all the same

Expire = Callable[[Any], object]


class LoopWatchdog:
    """The registrations of one event loop and its one timer."""

    __slots__ = ("_at", "_handle", "loop", "running")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.running: dict[object, tuple[float, Expire, Any]] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf

    def watch(self, key: object, budget: float, expire: Expire, arg: Any) -> None:
        """Call ``expire(arg)`` in ``budget`` seconds unless `done` (``key``) comes first.
        ``key`` (the task) runs one watched statement at a time."""
        when = self.loop.time() + budget
        self.running[key] = (when, expire, arg)
        if when < self._at:
            self._arm(when)

    def done(self, key: object) -> bool:
        """The statement under ``key`` ended: ``False`` when it had expired already."""
        return self.running.pop(key, None) is not None

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = when
        self._handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._at = math.inf
        running = self.running
        if not running:
            return
        now = self.loop.time() + _EARLY
        soonest = math.inf
        overdue = []
        for key, entry in running.items():
            when = entry[0]
            if when <= now:
                overdue.append(key)
            elif when < soonest:
                soonest = when
        for key in overdue:
            _, expire, arg = running.pop(key)
            expire(arg)  # the adapter's cancel: quick, and raises nothing
        if soonest < math.inf:
            self._arm(soonest)

    def __len__(self) -> int:
        return len(self.running)


class Watchdog:
    """Statement timers for one policy: a `LoopWatchdog` per event loop, made on first use.

    A statement calls `watch` (in a coroutine) and then the returned dog's ``done``."""

    __slots__ = ("_dogs",)

    def __init__(self) -> None:
        self._dogs: dict[asyncio.AbstractEventLoop, LoopWatchdog] = {}

    def watch(self, key: object, budget: float, expire: Expire, arg: Any) -> LoopWatchdog:
        """`LoopWatchdog.watch` on the running loop's dog, which is returned."""
        loop = _running_loop()
        dog = self._dogs.get(loop)
        if dog is None:
            dog = self.for_loop(loop)
        dog.watch(key, budget, expire, arg)
        return dog

    def for_loop(self, loop: asyncio.AbstractEventLoop) -> LoopWatchdog:
        dog = self._dogs.get(loop)
        if dog is None:
            # Loops come and go (one per test, one per thread): drop the closed ones' dogs.
            for old in list(self._dogs):  # a copy: another thread's loop may add its own
                if old.is_closed():
                    self._dogs.pop(old, None)
            dog = self._dogs.setdefault(loop, LoopWatchdog(loop))
        return dog

    def __len__(self) -> int:
        """Statements watched now, over all loops."""
        return sum(len(dog) for dog in list(self._dogs.values()))
