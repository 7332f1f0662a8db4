"""Monotonic clocks.

brownout never measures a duration with wall-clock time. Async code reads the running event
loop's clock (``loop.time()``), so that tests can run the real code on virtual time (e.g.
``looptime``) and the simulator can drive the same policy objects on a virtual loop. Outside a
running loop (threads, sync code) the default clock falls back to ``time.monotonic()``, which is
the time base of the standard asyncio and uvloop loops.
"""

from __future__ import annotations

import time
from asyncio import AbstractEventLoop, BaseEventLoop, Task, _get_running_loop
from asyncio import current_task as _asyncio_current_task
from asyncio import tasks as _tasks
from collections.abc import Callable
from threading import get_ident
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Clock",
    "LoopClock",
    "ManualClock",
    "MonotonicClock",
    "current_task_of",
    "default_clock",
    "loop_and_time",
    "loop_or_none",
    "now",
    "running_loop",
]


@runtime_checkable
class Clock(Protocol):
    """Anything that tells monotonic time in seconds."""

    def now(self) -> float:
        """Return the current monotonic time in seconds."""
        ...


_STOCK_TIME = BaseEventLoop.time

# (loop, its class, thread id, the loop's time function): the last loop found running.
# On CPython 3.11, `asyncio._get_running_loop()` makes a getpid() system call on every call. A
# stock loop records the thread running it in ``_thread_id`` (None once stopped), so a loop
# whose ``_thread_id`` is this thread *is* this thread's running loop (one loop runs per thread
# at a time). A mismatch (another thread, a stopped loop, no loop) takes the slow path and
# refreshes the cache. Only stock loops are cached; a stock loop's `time()` is
# ``time.monotonic()``, called directly; a subclass that overrides `time()` (virtual time, e.g.
# looptime) is read through its own method. The class is checked on every hit because looptime
# switches a loop's ``__class__`` between runs; a ``time`` attribute set on the instance makes
# the loop uncacheable. The cache keeps the last loop alive until another replaces it.
_running: tuple[Any, Any, int, Callable[[], float]] | None = None


def _remember(loop: AbstractEventLoop) -> Callable[[], float]:
    """Cache ``loop`` as this thread's running loop if it is cacheable; its time function."""
    global _running
    if isinstance(loop, BaseEventLoop) and "time" not in vars(loop):
        cls = type(loop)
        fn = time.monotonic if cls.time is _STOCK_TIME else loop.time
        _running = (loop, cls, get_ident(), fn)
        return fn
    return loop.time


def _slow_now() -> float:
    loop = _get_running_loop()
    if loop is None:
        return time.monotonic()
    if isinstance(loop, BaseEventLoop):
        return _remember(loop)()
    return loop.time()  # (uvloop and other loops of their own: never cached)


def running_loop() -> AbstractEventLoop:
    """The running event loop: `asyncio.get_running_loop()`, cheaper on CPython 3.11.

    There, every `asyncio.get_running_loop()` makes a getpid() system call; this answers from
    the clock's cache of the running loop when it is valid (see the comment on ``_running``).
    Raises `RuntimeError` when no loop runs in this thread, as asyncio does.
    """
    loop = loop_or_none()
    if loop is None:
        raise RuntimeError("no running event loop")
    return loop


def loop_or_none() -> AbstractEventLoop | None:
    """`running_loop`, or None outside a loop (asyncio's ``_get_running_loop``, cached)."""
    cached = _running
    if cached is not None:
        loop: AbstractEventLoop = cached[0]
        if cached[0]._thread_id == cached[2] == get_ident():
            return loop
    found = _get_running_loop()
    if isinstance(found, BaseEventLoop):
        _remember(found)
    return found


def loop_and_time() -> tuple[AbstractEventLoop, float]:
    """The running loop and its time, from one look at the cache: `running_loop()` and
    ``loop.time()`` in one call (an edge starts each request's stopwatch with it). Raises
    `RuntimeError` when no loop runs in this thread."""
    cached = _running
    if cached is not None:
        loop = cached[0]
        if loop._thread_id == cached[2] == get_ident() and type(loop) is cached[1]:
            return loop, cached[3]()
    # The miss, in this one frame: every request under uvloop takes it (nothing to cache).
    found = _get_running_loop()
    if found is None:
        raise RuntimeError("no running event loop")
    if isinstance(found, BaseEventLoop):
        return found, _remember(found)()
    return found, found.time()


def now() -> float:
    """Monotonic now: the running loop's time when there is one, else ``time.monotonic()``."""
    cached = _running
    if cached is not None:
        loop = cached[0]
        if loop._thread_id == cached[2] == get_ident() and type(loop) is cached[1]:
            return cached[3]()
    return _slow_now()


def _task_lookup() -> Callable[[AbstractEventLoop], Task[Any] | None]:
    # CPython 3.11's `asyncio.current_task` is a Python function around a dictionary lookup
    # (``_current_tasks.get(loop)``); the lookup alone saves a frame per request. Later
    # versions implement it in C (or keep tasks per thread): use it as it is.
    registry = getattr(_tasks, "_current_tasks", None)
    if isinstance(registry, dict) and getattr(_asyncio_current_task, "__code__", None) is not None:
        return registry.get
    return _asyncio_current_task


current_task_of: Callable[[AbstractEventLoop], Task[Any] | None] = _task_lookup()
"""The task running on ``loop`` (which must be running): `asyncio.current_task(loop)`."""


class LoopClock:
    """The default clock: the running loop's time, or ``time.monotonic()`` outside a loop."""

    __slots__ = ()

    # The module function itself (no wrapper frame on the hot path).
    now = staticmethod(now)

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

    def sleep(self, seconds: float) -> None:
        """What a blocking wait on this clock does: time moves on, nobody waits."""
        self.advance(seconds if seconds > 0 else 0.0)

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
