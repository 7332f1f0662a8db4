"""A virtual-time model of a server with a concurrency knee, to test limits against.

`KneeServer` has ``workers`` parallel workers (the knee: below it latency is the service
time, above it requests wait in the server's own FIFO queue, so latency grows linearly with
concurrency), an optional bound on that internal queue (beyond it requests are rejected
quickly: drops), multiplicative noise on service times and a ``slowdown`` factor that can
change over time. `run_saturated` drives a `Limit` against it with more demand than it can
take (a client that always keeps ``limit`` requests in flight) and records the limit over
time. Deterministic (seeded), discrete-event, no event loop: a minute of traffic at
thousands of requests per second runs in well under a second. The simulator (``brownout.sim``)
can grow from this model.
"""

from __future__ import annotations

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

    def window(self, start: float, end: float, *, skip_probes: bool = True) -> list[int]:
        """Limits recorded in ``[start, end)``, without probe periods unless asked."""
        return [
            lim
            for t, lim, probing in self.points
            if start <= t < end and not (skip_probes and probing)
        ]


def run_saturated(
    limit: Limit,
    server: KneeServer,
    duration: float,
    *,
    slowdowns: tuple[tuple[float, float], ...] = (),
    step: float = 0.1,
) -> LimitTrace:
    """Drive ``limit`` against ``server`` for ``duration`` virtual seconds of saturating load.

    ``slowdowns``: ``(at, factor)`` pairs; from ``at`` on, service times are ``factor`` times
    the base. The client keeps exactly ``limit.limit`` requests in flight at every instant.
    """
    trace = LimitTrace()
    events: list[tuple[float, int, int, float, int, bool]] = []  # (end, seq, id, start, n, drop)
    seq = 0
    now = 0.0
    in_flight = 0
    pending = sorted(slowdowns)
    next_point = 0.0
    starts: dict[int, tuple[float, int]] = {}

    def start_service(req: int, at: float) -> None:
        nonlocal seq
        seq += 1
        start, n = starts[req]
        heapq.heappush(events, (at + server.service(), seq, req, start, n, False))

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
                heapq.heappush(events, (at + server.reject_time, seq, req, at, in_flight, True))

    admit(0.0)
    probing = getattr(limit, "probing", None)
    while events and now < duration:
        end, _, req, start, n, dropped = heapq.heappop(events)
        now = end
        while pending and pending[0][0] <= now:
            server.slowdown = pending.pop(0)[1]
        while next_point <= now:
            is_probe = bool(getattr(limit, "probing", False)) if probing is not None else False
            trace.points.append((next_point, limit.limit, is_probe))
            next_point += step
        del starts[req]
        in_flight -= 1
        if dropped:
            trace.dropped += 1
        else:
            trace.completed += 1
            if server.waiting:
                start_service(server.waiting.popleft(), now)
            else:
                server.busy -= 1
        limit.on_sample(start, now - start, n, dropped)
        admit(now)
    return trace
