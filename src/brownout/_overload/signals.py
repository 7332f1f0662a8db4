"""Local resource pressure signals (A7, S1): what the `OverloadManager` watches.

Every signal answers ``read() -> float``: its *pressure*, 0.0 when idle and 1.0 at its limit
(it may exceed 1.0). Signals read real process values (``/proc``, cgroups, ``getrlimit``);
each takes the paths or callables it reads from as arguments, so tests can inject values.

- `EventLoopLag`: how late a periodic loop timer fires (a loop timer probe): the lag every
  request on the loop suffers.
- `MemoryPressure`: resident memory against the cgroup limit (v2 ``memory.max`` or v1
  ``memory.limit_in_bytes``), else physical RAM.
- `FileDescriptors`: open descriptors (``/proc/self/fd``) against ``RLIMIT_NOFILE``.
- `InFlight` and `QueueAge`: a bulkhead's utilization and the age of its oldest waiter.
- `FunctionSignal`: any callable, for tests and custom measures.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "EventLoopLag",
    "FileDescriptors",
    "FunctionSignal",
    "InFlight",
    "MemoryPressure",
    "QueueAge",
    "Signal",
    "cgroup_memory_limit",
]


@runtime_checkable
class Signal(Protocol):
    """A named pressure reading: 0.0 idle, 1.0 at the limit."""

    @property
    def name(self) -> str: ...

    def read(self) -> float: ...


class FunctionSignal:
    """A signal computed by any callable (custom measures, tests)."""

    __slots__ = ("_fn", "name")

    def __init__(self, name: str, fn: Callable[[], float]) -> None:
        self.name = name
        self._fn = fn

    def read(self) -> float:
        return float(self._fn())


class EventLoopLag:
    """Event-loop lag from a timer probe: schedule a callback every ``interval`` seconds and
    measure how late it runs. Pressure = lag / ``max_lag`` (default 100 ms is 1.0).

    The reading is the larger of the latest lag and a decaying peak (halving every
    ``half_life`` seconds, default 1 s), so one long stall is not forgotten at the next
    on-time tick. `start` it on the running loop
    (or use it through `OverloadManager.start`); `stop` cancels the timer.
    """

    name = "event_loop_lag"

    def __init__(
        self, *, interval: float = 0.05, max_lag: float = 0.1, half_life: float = 1.0
    ) -> None:
        if not all(0 < x < math.inf for x in (interval, max_lag, half_life)):  # NaN too
            raise ValueError("interval, max_lag and half_life must be positive and finite")
        self.interval = interval
        self.half_life = half_life
        self.max_lag = max_lag
        self.lag = 0.0
        """The latest measured lag in seconds."""
        self.peak = 0.0
        """A decaying peak of recent lags in seconds."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expected = 0.0

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start probing on ``loop`` (default: the running loop). Idempotent."""
        if self._handle is not None:
            return
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._expected = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._expected, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def running(self) -> bool:
        return self._handle is not None

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        self.observe(now - self._expected, now - self._expected + self.interval)
        self._expected = now + self.interval
        self._handle = loop.call_at(self._expected, self._tick)

    def observe(self, lag: float, elapsed: float | None = None) -> None:
        """Record one lag measurement taken ``elapsed`` seconds after the previous one
        (default: one interval). The probe calls this; tests may too."""
        lag = lag if lag > 0.0 else 0.0
        if elapsed is None:
            elapsed = self.interval
        self.lag = lag
        self.peak = max(lag, self.peak * 0.5 ** (elapsed / self.half_life))

    def read(self) -> float:
        return max(self.lag, self.peak) / self.max_lag


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def cgroup_memory_limit(
    proc_root: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup"
) -> int | None:
    """The memory limit of this process's cgroup in bytes, or ``None`` when unlimited.

    cgroup v2: ``memory.max`` of the process's own cgroup (from ``/proc/self/cgroup``),
    else of the mount's root; v1: ``memory/<own cgroup>/memory.limit_in_bytes``, else the
    mount root's (inside a container the mount root usually *is* the container's cgroup).
    A v1 "unlimited" value (a huge number beyond physical memory) counts as no limit.
    """
    proc = Path(proc_root)
    root = Path(cgroup_root)
    candidates: list[Path] = []
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            rel = parts[2].lstrip("/")
            if not rel:
                continue
            if parts[0] == "0" and parts[1] == "":
                candidates.append(root / rel / "memory.max")
            elif "memory" in parts[1].split(","):
                candidates.append(root / "memory" / rel / "memory.limit_in_bytes")
    except OSError:
        pass
    candidates += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    physical = _physical_memory()
    for path in candidates:
        value = _read_int(path)
        if value is not None and value > 0 and (physical <= 0 or value < physical):
            return value
    return None


class MemoryPressure:
    """Resident memory against the memory limit (cgroup, else physical RAM).

    ``usage`` (bytes, a callable) defaults to the resident set size from
    ``{proc_root}/self/statm``; ``limit_bytes`` defaults to `cgroup_memory_limit`, else the
    machine's physical memory. Pressure = usage / limit.
    """

    name = "memory"

    def __init__(
        self,
        *,
        limit_bytes: int | None = None,
        usage: Callable[[], int] | None = None,
        proc_root: str | Path = "/proc",
        cgroup_root: str | Path = "/sys/fs/cgroup",
    ) -> None:
        self._statm = Path(proc_root) / "self" / "statm"
        if limit_bytes is None:
            limit_bytes = cgroup_memory_limit(proc_root, cgroup_root) or _physical_memory()
        if not 0 < limit_bytes < math.inf:
            raise ValueError("no memory limit could be determined; pass limit_bytes")
        self.limit_bytes = limit_bytes
        self._usage = usage if usage is not None else self.resident_bytes
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def resident_bytes(self) -> int:
        """Resident set size of this process from ``statm`` (0 when unreadable)."""
        try:
            return int(self._statm.read_text().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return 0

    def read(self) -> float:
        return self._usage() / self.limit_bytes


class FileDescriptors:
    """Open file descriptors (entries of ``fd_dir``) against the soft ``RLIMIT_NOFILE``.

    Running out of descriptors stops a server from accepting even health checks (S7).
    """

    name = "file_descriptors"

    def __init__(
        self,
        *,
        fd_dir: str | Path = "/proc/self/fd",
        limit: int | None = None,
        count: Callable[[], int] | None = None,
    ) -> None:
        self._fd_dir = Path(fd_dir)
        if limit is None:
            limit = self.soft_limit()
        if not 0 < limit < math.inf:
            raise ValueError("limit must be positive and finite")
        self.limit = limit
        self._count = count if count is not None else self.open_count

    @staticmethod
    def soft_limit() -> int:
        """The soft RLIMIT_NOFILE (1,048,576 when unlimited or unknown)."""
        try:
            import resource

            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
            return 1 << 20
        if soft == resource.RLIM_INFINITY or soft <= 0:
            return 1 << 20
        return int(soft)

    def open_count(self) -> int:
        """Descriptors open now (0 when ``fd_dir`` cannot be listed)."""
        try:
            return len(os.listdir(self._fd_dir))
        except OSError:
            return 0

    def read(self) -> float:
        return self._count() / self.limit


class _BulkheadLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def limit(self) -> int: ...

    def oldest_queue_age(self) -> float: ...


class InFlight:
    """A bulkhead's utilization: in-flight over its limit."""

    def __init__(self, bulkhead: _BulkheadLike) -> None:
        self._bulkhead = bulkhead
        self.name = f"in_flight:{bulkhead.name}"

    def read(self) -> float:
        b = self._bulkhead
        return b.in_flight / max(1, b.limit)


class QueueAge:
    """Age of a bulkhead's oldest waiter over ``max_age`` seconds."""

    def __init__(self, bulkhead: _BulkheadLike, max_age: float) -> None:
        if not 0 < max_age < math.inf:  # NaN or inf would read as no pressure, ever
            raise ValueError("max_age must be positive and finite")
        self._bulkhead = bulkhead
        self.max_age = max_age
        self.name = f"queue_age:{bulkhead.name}"

    def read(self) -> float:
        return self._bulkhead.oldest_queue_age() / self.max_age
