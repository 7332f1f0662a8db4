"""A virtual-time model of a server with a concurrency knee, to test limits against.

`KneeServer` has ``workers`` parallel workers (the knee: below it latency is the service
time, above it requests wait in the server's own FIFO queue, so latency grows linearly with
concurrency), an optional bound on that internal queue (beyond it requests are rejected
quickly: drops), multiplicative noise on service times and a ``slowdown`` factor that can
change over time. `run_saturated` drives a `Limit` against it with more demand than it can
take (a client that always keeps ``limit`` requests in flight) and records the limit over
time. Deterministic (seeded), discrete-event, no event loop: a minute of traffic at
thousands of requests per second takes a fraction of that to run.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from .limits import Limit

__all__ = ["KneeServer", "LimitTrace", "run_saturated"]


class KneeServer:
    """A server with ``workers`` parallel workers and a FIFO queue in front of them.

    ``service_time``: seconds per request at no load (times ``slowdown``, times uniform noise
    in ``1 +/- noise``). ``max_queue``: requests that may wait inside the server (``None``:
    unbounded); beyond it a request is rejected after ``reject_time`` (a drop).
    """

    def __init__(
        self,
        workers: int,
        service_time: float,
        *,
        max_queue: int | None = None,
        noise: float = 0.1,
        reject_time: float = 0.001,
        seed: int = 0,
    ) -> None:
        self.workers = workers
        self.service_time = service_time
        self.max_queue = max_queue
        self.noise = noise
        self.reject_time = reject_time
        self.slowdown = 1.0
        self._rng = random.Random(seed)
        self.busy = 0
        self.waiting: deque[int] = deque()

    def service(self) -> float:
        """Draw one service time."""
        n = self.noise
        return self.service_time * self.slowdown * (1.0 + n * (2.0 * self._rng.random() - 1.0))


@dataclass
class LimitTrace:
    """The limit over time: ``(time, limit, probing)`` every ``step`` seconds, and totals."""

    points: list[tuple[float, int, bool]] = field(default_factory=list)
    completed: int = 0
    dropped: int = 0
    completions: list[int] = field(default_factory=list)
    """Requests completed by each point's time (cumulative), for `throughput`."""

    def window(self, start: float, end: float, *, skip_probes: bool = True) -> list[int]:
        """Limits recorded in ``[start, end)``, without probe periods unless asked."""
        return [
            lim
            for t, lim, probing in self.points
            if start <= t < end and not (skip_probes and probing)
        ]

    def throughput(self, start: float, end: float) -> float:
        """Completed requests per second between the points nearest ``start`` and ``end``."""
        times = [t for t, _, _ in self.points]
        i, j = bisect.bisect_left(times, start), bisect.bisect_left(times, end) - 1
        if j <= i:
            raise ValueError("the window holds fewer than two points")
        return (self.completions[j] - self.completions[i]) / (times[j] - times[i])


def _stall_windows(
    stalls: tuple[float, float] | None, duration: float, seed: int
) -> list[tuple[float, float]]:
    """Disjoint ``[start, end)`` windows of host stalls: Poisson starts at ``rate``/s."""
    if stalls is None:
        return []
    rate, length = stalls
    rng = random.Random(seed)
    windows: list[tuple[float, float]] = []
    t = rng.expovariate(rate)
    while t < duration:
        if windows and t <= windows[-1][1]:
            windows[-1] = (windows[-1][0], t + length)
        else:
            windows.append((t, t + length))
        t += rng.expovariate(rate)
    return windows


def run_saturated(
    limit: Limit,
    server: KneeServer,
    duration: float,
    *,
    slowdowns: tuple[tuple[float, float], ...] = (),
    host_lags: tuple[tuple[float, float], ...] = (),
    stalls: tuple[float, float] | None = None,
    stall_seed: int = 0,
    step: float = 0.1,
) -> LimitTrace:
    """Drive ``limit`` against ``server`` for ``duration`` virtual seconds of saturating load.

    ``slowdowns``: ``(at, factor)`` pairs; from ``at`` on, service times are ``factor`` times
    the base. The client keeps exactly ``limit.limit`` requests in flight at every instant.

    The protected process's own host, whatever the concurrency (a CPU it shares with
    other work): ``host_lags`` ``(at, seconds)`` pairs add that long to every request from
    ``at`` on, after the server's worker is done with it (the worker is not held: more of
    them in flight, not fewer, keep the server busy); ``stalls`` ``(rate, seconds)`` freeze
    the host at Poisson moments (``rate`` per second, seeded by ``stall_seed``), so every
    request that would complete during a stall completes when it ends.
    """
    trace = LimitTrace()
    # (time, seq, worker_done, id, start, n, dropped): worker_done events free a worker; the
    # others hand a sample to the limit.
    events: list[tuple[float, int, bool, int, float, int, bool]] = []
    seq = 0
    now = 0.0
    in_flight = 0
    pending = sorted(slowdowns)
    lags = sorted(host_lags)
    lag = 0.0
    windows = _stall_windows(stalls, duration, stall_seed)
    window_starts = [w[0] for w in windows]
    next_point = 0.0
    starts: dict[int, tuple[float, int]] = {}

    def start_service(req: int, at: float) -> None:
        nonlocal seq
        seq += 1
        start, n = starts[req]
        heapq.heappush(events, (at + server.service(), seq, True, req, start, n, False))

    def completes_at(t: float) -> float:
        i = bisect.bisect_right(window_starts, t) - 1
        if i >= 0 and t < windows[i][1]:
            return windows[i][1]
        return t

    def admit(at: float) -> None:
        nonlocal seq, in_flight
        while in_flight < limit.limit:
            in_flight += 1
            seq += 1
            req = seq
            starts[req] = (at, in_flight)
            if server.busy < server.workers:
                server.busy += 1
                start_service(req, at)
            elif server.max_queue is None or len(server.waiting) < server.max_queue:
                server.waiting.append(req)
            else:
                seq += 1
                done = completes_at(at + server.reject_time + lag)
                heapq.heappush(events, (done, seq, False, req, at, in_flight, True))

    admit(0.0)
    probing = getattr(limit, "probing", None)
    while events and now < duration:
        end, _, worker_done, req, start, n, dropped = heapq.heappop(events)
        now = end
        while pending and pending[0][0] <= now:
            server.slowdown = pending.pop(0)[1]
        while lags and lags[0][0] <= now:
            lag = lags.pop(0)[1]
        while next_point <= now:
            is_probe = bool(getattr(limit, "probing", False)) if probing is not None else False
            trace.points.append((next_point, limit.limit, is_probe))
            trace.completions.append(trace.completed)
            next_point += step
        if worker_done:
            if server.waiting:
                start_service(server.waiting.popleft(), now)
            else:
                server.busy -= 1
            done = completes_at(now + lag)
            if done > now:  # the host holds the answer back; the worker is free already
                seq += 1
                heapq.heappush(events, (done, seq, False, req, start, n, False))
                continue
        del starts[req]
        in_flight -= 1
        if dropped:
            trace.dropped += 1
        else:
            trace.completed += 1
        limit.on_sample(start, now - start, n, dropped)
        admit(now)
    return trace
