"""What the lab's host did during a step: CPU use per process and of the front's core.

The lab runs a service, its dependency and the load generator on one small machine, so a
figure can reflect the host rather than the service. For each step the generator reads
``/proc/<pid>/stat`` (utime + stime) of the front, the dependency, itself and a scenario's
CPU hog, and the front's core's line of ``/proc/stat``, when the step's steady state starts
and when it ends; `cpu_shares` turns two such samples into shares of one core over the
measured wall time, and `host_bound` says whether the host, not the service, bounded the step.

A step is **host-bound** when any of these held over its steady state:

- the generator was late (p99 lateness above its limit): the offered load was not offered;
- the dependency used >= 90% of a core (`SATURATED`): the stand-in for another machine ran out
  of CPU;
- the front's core was >= 95% busy (`CORE_FULL`) and CPU that none of the lab's processes on
  that core used (front, dependency where it shares the core, the scenario's hog) took >= 10%
  of it (`OUTSIDE`): with the core full, that time came out of what the lab's processes
  needed, and the lab did not put it there.

The generator's CPU share is reported but is no sign of saturation: it waits for its next send
by yielding to its event loop, whose timers have millisecond resolution, so with sends less
than about half a millisecond apart (10x of a few hundred requests/s) it spins and reads ~100%
of its core while keeping its schedule to a fraction of a millisecond. Its lateness says
whether it kept up.

A scenario's own hog is part of the scenario (it starves the front on purpose), so its share
counts with the lab's processes, not as the host's. Where ``/proc`` is missing (not Linux) the
shares are None and only the generator's lateness can make a step host-bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CORE_FULL",
    "OUTSIDE",
    "SATURATED",
    "CpuSample",
    "core_ticks",
    "cpu_shares",
    "host_bound",
    "pid_ticks",
    "read_sample",
]

SATURATED = 0.90
"""Share of one core at which the dependency counts as saturated."""
CORE_FULL = 0.95
"""Busy share of the front's core at which it counts as full."""
OUTSIDE = 0.10
"""Share of the full front core taken by processes outside the lab that makes a step host-bound."""
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def pid_ticks(stat: str) -> int:
    """utime + stime (clock ticks, all threads) from the text of ``/proc/<pid>/stat``."""
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def core_ticks(stat: str, cpu: int) -> tuple[int, int]:
    """(busy, total) clock ticks of core ``cpu`` from the text of ``/proc/stat``."""
    name = f"cpu{cpu}"
    for line in stat.splitlines():
        parts = line.split()
        if parts and parts[0] == name:
            # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time
            # is already inside user and nice.
            v = [int(x) for x in parts[1:9]] + [0] * max(0, 9 - len(parts))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    raise ValueError(f"no {name} line in /proc/stat")


@dataclass(frozen=True)
class CpuSample:
    """CPU counters at one instant (``at``: ``time.monotonic()``)."""

    at: float
    processes: dict[str, int | None] = field(default_factory=dict)
    """Clock ticks used so far per role (None: unreadable, e.g. the process is gone)."""
    core: tuple[int, int] | None = None
    """(busy, total) ticks of the front's core, or None."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_sample(processes: Iterable[tuple[str, int]], core: int | None) -> CpuSample:
    """Read the counters of ``processes`` ((role, pid) pairs) and of ``core`` now."""
    ticks: dict[str, int | None] = {}
    for role, pid in processes:
        text = _read(f"/proc/{pid}/stat")
        ticks[role] = pid_ticks(text) if text is not None else None
    core_now: tuple[int, int] | None = None
    if core is not None:
        text = _read("/proc/stat")
        if text is not None:
            try:
                core_now = core_ticks(text, core)
            except ValueError:
                core_now = None
    return CpuSample(time.monotonic(), ticks, core_now)


def cpu_shares(
    before: CpuSample,
    after: CpuSample,
    on_front_core: Iterable[str],
    ticks_per_second: float = TICKS_PER_SECOND,
) -> dict[str, Any]:
    """Shares of one core between two samples, rounded to 0.001.

    Per role: CPU seconds used / wall seconds between the samples. ``core``: the busy share of
    the front's core; ``outside``: the part of it not used by the roles in ``on_front_core``
    (the lab's processes pinned there), never below 0. A figure that cannot be had is None.
    """
    wall = after.at - before.at
    out: dict[str, Any] = {"seconds": round(wall, 3)}
    if wall <= 0:
        return out
    for role, start in before.processes.items():
        end = after.processes.get(role)
        out[role] = (
            round((end - start) / ticks_per_second / wall, 3)
            if start is not None and end is not None
            else None
        )
    core: float | None = None
    if before.core is not None and after.core is not None:
        busy = after.core[0] - before.core[0]
        total = after.core[1] - before.core[1]
        core = busy / total if total > 0 else None
    out["core"] = round(core, 3) if core is not None else None
    if core is not None:
        ours = [out.get(role) for role in on_front_core]
        if all(isinstance(x, float) for x in ours):
            out["outside"] = round(max(0.0, core - sum(x for x in ours if x is not None)), 3)
        else:
            out["outside"] = None
    return out


def host_bound(
    cpu: Mapping[str, Any] | None, generator_late: bool, lateness_ms: float
) -> list[str]:
    """Why a step is host-bound (see the module's rule), in plain words; [] when it is not."""
    reasons: list[str] = []
    if generator_late:
        reasons.append(f"generator late (p99 {lateness_ms:.1f} ms)")
    if not cpu:
        return reasons
    share = cpu.get("dependency")
    if share is not None and share >= SATURATED:
        reasons.append(f"dependency at {share:.0%} of a core")
    core, outside = cpu.get("core"), cpu.get("outside")
    if core is not None and outside is not None and core >= CORE_FULL and outside >= OUTSIDE:
        reasons.append(
            f"front's core {core:.0%} busy, {outside:.0%} of it by processes outside the lab"
        )
    return reasons
