"""gunicorn: the hooks a gunicorn config file needs for a service brownout protects (W1).

    # gunicorn.conf.py
    from brownout.integrations.gunicorn import child_exit, post_fork  # noqa: F401

    # the application module, loaded in each worker after the fork
    bulkhead = ThreadBulkhead("api", worker_limit())

- `post_fork` records the worker's thread count (``threads``; 1 for the ``sync`` worker),
  so the application can size its bulkhead from it;
- `worker_capacity` is how many requests may run at once in this worker: its threads less
  ``spare`` ones kept free to refuse the excess quickly (a refusal needs a thread too);
- `worker_limit` is `brownout.limits.Gradient2Limit` capped at that capacity: the limit
  adapts to the latency it sees and never admits more than the threads can run;
- `child_exit` keeps an exited worker's brownout counts and drops its gauges in
  prometheus_client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``; without it, it
  does nothing).

These functions only read gunicorn's settings: the limit is the core's, the decisions the
bulkhead's. See docs/gunicorn.md for the settings that make overload reach the middleware.
"""

from __future__ import annotations

import os
from typing import Any

from .._admission.limits import Gradient2Limit

__all__ = ["child_exit", "post_fork", "worker_capacity", "worker_limit", "worker_threads"]

_threads: int | None = None


def post_fork(server: Any, worker: Any) -> None:
    """gunicorn's ``post_fork`` hook: note this worker's thread count (its ``threads``
    setting; the ``sync`` worker serves one request at a time whatever it says)."""
    global _threads
    threads = int(getattr(worker.cfg, "threads", 1) or 1)
    threaded = any(c.__name__ == "ThreadWorker" for c in type(worker).__mro__)
    _threads = threads if threaded else 1


def worker_threads() -> int:
    """The thread count `post_fork` recorded in this worker process.

    Raises `RuntimeError` outside a gunicorn worker, or when the application was loaded
    before the fork (``preload_app``): pass ``threads=`` to `worker_capacity` then.
    """
    if _threads is None:
        raise RuntimeError(
            "no gunicorn worker recorded in this process: set post_fork = "
            "brownout.integrations.gunicorn.post_fork in the gunicorn config and do not "
            "preload the application, or pass threads= explicitly"
        )
    return _threads


def worker_capacity(spare: int | None = None, *, threads: int | None = None) -> int:
    """How many requests this worker should run at once: ``threads`` (default: the worker's,
    see `worker_threads`) less ``spare`` threads kept free to answer refusals (default: a
    quarter of the threads, at least 1 when there are 2 or more). At least 1."""
    n = worker_threads() if threads is None else threads
    if n < 1:
        raise ValueError("threads must be >= 1")
    if spare is None:
        spare = max(1, n // 4) if n > 1 else 0
    if not 0 <= spare < n:
        raise ValueError(f"spare must be in [0, threads): got {spare} with {n} threads")
    return n - spare


def worker_limit(
    spare: int | None = None, *, threads: int | None = None, initial: int | None = None
) -> Gradient2Limit:
    """A `Gradient2Limit` that never exceeds `worker_capacity` (``spare`` and ``threads`` as
    there); it starts at ``initial`` (default: half the capacity, at least 1)."""
    cap = worker_capacity(spare, threads=threads)
    start = max(1, cap // 2) if initial is None else initial
    if not 1 <= start <= cap:
        raise ValueError(f"initial must be in [1, {cap}]")
    return Gradient2Limit(start, min_limit=1, max_limit=cap)


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn's ``child_exit`` hook (runs in the arbiter): fold the exited worker's brownout
    counts into the multiprocess archive and drop its gauges, brownout's and the
    application's (prometheus_client's ``mark_process_dead``). Does nothing when
    ``PROMETHEUS_MULTIPROC_DIR`` is unset."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from ..export.prometheus import mark_process_dead

    mark_process_dead(worker.pid)
