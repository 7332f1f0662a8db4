"""A CPU hog: a noisy neighbour on the front's core, for the "CPU-starved front" scenario.

`cpu_hog` runs a separate Python process pinned with `os.sched_setaffinity` to the given
cores that spins without pause at nice 0: the scheduler then gives it a fair share of the
core (half of it against one busy process), the way another tenant's busy process takes a
shared machine's core. It is killed when the block ends, by an error or Ctrl-C too, and it
exits by itself within a fraction of a second if the lab dies without killing it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["HOG_SOURCE", "cpu_hog"]

HOG_SOURCE = """
import os, sys
parent = int(sys.argv[2])
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
print("SPINNING", flush=True)
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""
"""The hog's program: spin, checking every few ms that the lab is still its parent."""


@contextlib.contextmanager
def cpu_hog(cpus: list[int]) -> Iterator[int]:
    """Spin on ``cpus`` in another process while the block runs; yields the hog's pid."""
    where = ",".join(map(str, cpus))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOG_SOURCE, where, str(os.getpid())],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        # Pinned before the block starts, so the block measures a core already shared.
        if proc.stdout.readline().strip() != b"SPINNING":
            raise RuntimeError("the CPU hog failed to start")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
