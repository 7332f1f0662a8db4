"""gunicorn: the hooks a gunicorn config file needs for a service brownout protects (W1).

    # gunicorn.conf.py
    from brownout.integrations.gunicorn import child_exit, post_fork, pre_request  # noqa: F401

    # the application module, loaded in each worker after the fork
    bulkhead = worker_bulkhead("api")

- `post_fork` records the worker's thread count (``threads``; 1 for the ``sync`` worker),
  so the application can size its bulkhead from it;
- `worker_bulkhead` is the `brownout.ThreadBulkhead` sized to those threads
  (`ThreadBulkhead.for_threads`): an adaptive limit and a short queue that together hold at
  most half of them, the other half kept free to refuse the excess at once (a refusal needs
  a thread too, and a request gunicorn has accepted waits for one where nothing refuses it);
- `worker_capacity` is how many requests may run at once in this worker, and
  `worker_limit` a `brownout.limits.Gradient2Limit` capped at it, for a bulkhead of your own;
- `pre_request` lets the WSGI middleware close the connection a 503 goes out on, at most
  `CLOSES_PER_SECOND` times a second per worker: each worker has its own limit, and a client
  pool that reuses its most recently freed connection keeps sending to the worker that
  refuses fastest while another has room; a closed connection is opened again and the
  kernel hands it to whichever worker accepts first;
- `child_exit` keeps an exited worker's brownout counts and drops its gauges in
  prometheus_client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``; without it, it
  does nothing).

These functions only read gunicorn's settings: the sizes are the core's
(`brownout._admission.thread_split`), the decisions the bulkhead's. See docs/gunicorn.md for
the settings that make overload reach the middleware.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .._admission.limits import Gradient2Limit
from .._admission.thread_bulkhead import ThreadBulkhead
from .._admission.thread_split import split_threads
from .wsgi import on_capacity_refusal

__all__ = [
    "CLOSES_PER_SECOND",
    "ConnectionCloser",
    "child_exit",
    "post_fork",
    "pre_request",
    "worker_bulkhead",
    "worker_capacity",
    "worker_limit",
    "worker_threads",
]

_threads: int | None = None

CLOSES_PER_SECOND = 50.0
"""Enough to move a keep-alive pool off a refusing worker in well under a second; few enough
that a 10x flood does not turn into a flood of new connections."""


class ConnectionCloser:
    """Marks the gunicorn request on this thread to be closed after its answer, at most
    ``per_second`` times a second (``clock``: seconds, monotonic)."""

    def __init__(
        self, per_second: float = CLOSES_PER_SECOND, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not per_second > 0:
            raise ValueError("per_second must be > 0")
        self._interval = 1.0 / per_second
        self._clock = clock
        self._next = float("-inf")
        self._local = threading.local()

    def note(self, req: Any) -> None:
        """Remember ``req`` as the request this thread serves."""
        self._local.req = req

    def __call__(self) -> None:
        req = getattr(self._local, "req", None)
        if req is None:
            return
        t = self._clock()
        if t < self._next:
            return
        # Unlocked: two threads racing here close one connection more, which is harmless.
        self._next = t + self._interval
        req.must_close = True  # gunicorn answers "Connection: close" and closes after it


_closer = ConnectionCloser()


def pre_request(worker: Any, req: Any) -> None:
    """gunicorn's ``pre_request`` hook: lets the WSGI middleware close the connection of a
    request it refuses with a 503 (see `ConnectionCloser`), so keep-alive clients spread
    over the workers. It replaces gunicorn's default hook, which only logs at debug level."""
    _closer.note(req)
    on_capacity_refusal(_closer)


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


def worker_bulkhead(
    name: str,
    spare: int | None = None,
    *,
    threads: int | None = None,
    queued: int | None = None,
    max_wait: float = 0.1,
    initial: int | None = None,
) -> ThreadBulkhead:
    """The `ThreadBulkhead` for this worker: `ThreadBulkhead.for_threads` with ``threads``
    (default: the worker's, see `worker_threads`); ``spare``, ``queued``, ``max_wait`` and
    ``initial`` as there (defaults: half the threads spare, a quarter of the rest queued,
    at most 0.1 s each)."""
    n = worker_threads() if threads is None else threads
    return ThreadBulkhead.for_threads(
        name, n, spare=spare, queued=queued, max_wait=max_wait, initial=initial
    )


def worker_capacity(
    spare: int | None = None, *, threads: int | None = None, queued: int | None = None
) -> int:
    """How many requests this worker should run at once: ``threads`` (default: the worker's,
    see `worker_threads`) less ``spare`` threads kept free to answer refusals (default: half
    the threads, at least 1 when there are 2 or more) and ``queued`` ones the bulkhead's
    queue may hold (default: a quarter of the rest). At least 1."""
    n = worker_threads() if threads is None else threads
    return split_threads(n, spare, queued).running


def worker_limit(
    spare: int | None = None,
    *,
    threads: int | None = None,
    queued: int | None = None,
    initial: int | None = None,
) -> Gradient2Limit:
    """A `Gradient2Limit` that never exceeds `worker_capacity` (``spare``, ``threads`` and
    ``queued`` as there); it starts at ``initial`` (default: half the capacity, at least 1).
    Give its bulkhead a queue of at most ``queued`` places, or use `worker_bulkhead`."""
    cap = worker_capacity(spare, threads=threads, queued=queued)
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
