"""How a bulkhead divides a fixed pool of threads: running, queued, spare (A1, A3).

A request served by a thread pool (a gunicorn ``gthread`` worker, a WSGI server's threads)
holds its thread from the moment the pool picks it up: while it runs, while it waits in the
bulkhead's queue, and while it is refused. So the pool's threads are split three ways:

- ``running``: the bulkhead's limit never goes above it;
- ``queued``: the bulkhead's queue never holds more (a queued thread is a thread not refusing);
- ``spare``: never held by the bulkhead. They take the excess off the pool's own queue, which
  nothing can refuse, and answer it at once. Too few, and under a flood that queue grows
  faster than they drain it: refusals then wait as long as the work.

By default half the threads are spare, and a quarter of the rest is queue.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ThreadSplit", "split_threads"]


@dataclass(frozen=True, slots=True)
class ThreadSplit:
    """``threads`` split into ``running`` + ``queued`` + ``spare``."""

    threads: int
    running: int
    queued: int

    @property
    def spare(self) -> int:
        """Threads the bulkhead never holds: they answer the refusals."""
        return self.threads - self.running - self.queued


def split_threads(threads: int, spare: int | None = None, queued: int | None = None) -> ThreadSplit:
    """Split a pool of ``threads`` (see the module).

    ``spare`` defaults to half the threads (at least 1 from 2 threads on; 0 for one thread,
    which serves one request at a time whatever the bulkhead does); ``queued`` to a quarter
    of the threads left (0 below 4). At least one thread runs. Raises `ValueError` for
    sizes that leave none.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1: got {threads}")
    if spare is None:
        spare = max(1, threads // 2) if threads > 1 else 0
    if not 0 <= spare < threads:
        raise ValueError(f"spare must be in [0, threads): got {spare} with {threads} threads")
    rest = threads - spare
    if queued is None:
        queued = rest // 4
    if not 0 <= queued < rest:
        raise ValueError(
            f"queued must be in [0, {rest}): {threads} threads less {spare} spare leave {rest}"
        )
    return ThreadSplit(threads, rest - queued, queued)
