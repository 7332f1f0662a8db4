"""A virtual-time asyncio event loop: ``time()`` is simulated and the loop never sleeps.

When nothing is ready, the loop's selector jumps the clock to the next timer instead of
waiting for it, so an hour of timers runs as fast as the callbacks themselves. There is no
I/O: no sockets, no subprocesses, no calls from other threads. brownout's clock reads a
running loop's ``time()`` (a subclass's own method), so every policy object runs on it
unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
from asyncio import events
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Deadlock", "VirtualLoop", "run"]

T = TypeVar("T")


class Deadlock(RuntimeError):
    """The virtual loop has nothing ready and no timer: it would wait forever."""


class _Selector:
    """What `BaseEventLoop._run_once` waits on: moves the loop's clock, waits for nothing."""

    __slots__ = ("_loop",)

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Deadlock(
                f"nothing ready and no timer at virtual time {self._loop.time():.6f}: "
                "a coroutine waits for something no callback will ever do"
            )
        if timeout > 0.0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An asyncio loop on virtual time, starting at ``start`` seconds.

    Callbacks run in the order a real loop would run them; only waiting is skipped. Use
    `run` (or ``loop.run_until_complete``); `advance` moves time by hand between runs.
    """

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._now = float(start)
        self._selector = _Selector(self)
        # Timers within this much of now are due: half a nanosecond, far below any model's
        # resolution, absorbs the float rounding of ``now + (when - now)``.
        self._clock_resolution = 1e-9
        # The heap holds (when, sequence, handle): tuples compare in C, TimerHandle's __lt__
        # is a Python call per comparison; equal times run in the order they were scheduled.
        self._sequence = itertools.count()

    def time(self) -> float:
        return self._now

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        base: Any = self  # BaseEventLoop's private state, not in its stubs
        base._check_closed()
        if base._debug:
            base._check_callback(callback, "call_at")
        timer: Any = events.TimerHandle(when, callback, args, self, context)
        heapq.heappush(base._scheduled, (when, next(self._sequence), timer))
        timer._scheduled = True
        return timer  # type: ignore[no-any-return]

    def advance(self, seconds: float) -> None:
        """Move virtual time forward (never backwards)."""
        if not seconds >= 0.0:
            raise ValueError("virtual time cannot go backwards")
        self._now += seconds

    def _run_once(self) -> None:
        # BaseEventLoop's iteration without the selector round trip and debug timing: the
        # same order (ready callbacks, then due timers), the same cancelled-timer pruning.
        base: Any = self
        scheduled: list[tuple[float, int, Any]] = base._scheduled
        ready = base._ready
        n = len(scheduled)
        if n > 100 and base._timer_cancelled_count / n > 0.5:
            kept = []
            for entry in scheduled:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            base._scheduled = scheduled = kept
            base._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0][2]._cancelled:
                base._timer_cancelled_count -= 1
                heapq.heappop(scheduled)[2]._scheduled = False
        if not ready and not base._stopping:
            if not scheduled:
                self._selector.select(None)  # raises Deadlock
            when = scheduled[0][0]
            if when > self._now:
                self._now = when
        end = self._now + self._clock_resolution
        pop = heapq.heappop
        while scheduled and scheduled[0][0] < end:
            h = pop(scheduled)[2]
            h._scheduled = False
            ready.append(h)
        if base._debug:
            for _ in range(len(ready)):
                handle = ready.popleft()
                if not handle._cancelled:
                    base._current_handle = handle
                    handle._run()
            base._current_handle = None
            return
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if not handle._cancelled:
                handle._run()

    # -- what BaseEventLoop leaves to its subclasses ----------------------------------------
    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        # call_soon_threadsafe's wake-up: nothing sleeps, so nothing to wake.
        pass

    def close(self) -> None:
        if not self.is_closed():
            self._selector.close()
        super().close()


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to its end on a fresh `VirtualLoop` (in a fresh context) and close it.

    Tasks still pending when ``main`` returns are cancelled and given one chance to finish,
    as `asyncio.run` does.
    """
    loop = VirtualLoop(start)
    try:
        task = loop.create_task(main, context=contextvars.Context())
        return loop.run_until_complete(task)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
