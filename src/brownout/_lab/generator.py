"""An open-loop HTTP/1.1 load generator on raw asyncio transports (uvloop when available).

Open loop means arrivals follow a schedule, constant or Poisson, and never wait for
responses: a slow server does not slow the offered load down, which is what real users do and
what closed-loop tools hide (coordinated omission). Every request has a client deadline;
latency is measured from the *scheduled* send time, so the generator's own delays count
against the server, and the generator measures how late it was itself: a step whose p99
lateness exceeds `MAX_LATENESS` is marked invalid rather than silently reported.

Connections are HTTP/1.1 keep-alive, one request in flight per connection, taken from a pool
that opens a new connection when all are busy, up to ``max_connections``; past that, requests
wait in the pool until a connection frees or their deadline passes (``timeouts_unsent``). A
request whose deadline passes while in flight is abandoned and its connection closed, as an
HTTP client with a timeout does. Connections opened are counted: a server that closes
connections on refusal (uvicorn's ``--limit-concurrency``) shows up as churn.

Clients may retry (``LoadStep.retries``): a failed request (503, 429, 504, 502 and other
statuses, connection errors, a client timeout after sending) is sent again after an
exponential backoff, as a *new* scheduled send that never delays the open-loop schedule.
Retried attempts are counted in their own tallies (``StepResult.retries_whole`` /
``retries_steady``, in the step of the original), never in the originals' figures. Naive
clients retry every failure; with ``retry_budget`` the clients behave like brownout's: a
`brownout.RetryBudget` of that ratio caps retries, backoff has full jitter, and a response
marked ``brownout-retry: never`` is not retried (R1). Responses marked ``brownout-degraded``
are counted (``Tally.degraded``, and ``degraded_ok`` within goodput).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from brownout.wire import BUDGET_HEADER, DEGRADED_HEADER, DO_NOT_RETRY_VALUE, RETRY_HEADER

from .._retry.budget import RetryBudget
from .fds import fit_fd_limit
from .hostcpu import CpuSample, read_sample
from .http1 import Response, ResponseParseError, ResponseParser, encode_request
from .tally import Tally, percentile
from .templates import RequestTemplate

__all__ = [
    "MAX_LATENESS",
    "AdminCall",
    "Calibration",
    "LoadPlan",
    "LoadStep",
    "PlanResult",
    "StepResult",
    "TrafficClass",
    "calibrate",
    "run_plan",
]

MAX_LATENESS = 0.005
"""A step is invalid when the generator's p99 lateness exceeds this many seconds."""
RETRYABLE_OUTCOMES = frozenset({"r503", "r429", "r504", "other_status", "errors", "timeouts_sent"})
"""Outcomes a retrying client sends again (a request never sent is not retried: the pool was
full, which is the generator's own limit)."""


@dataclass(frozen=True)
class TrafficClass:
    """One kind of request the generator sends (interactive, batch, health, ...)."""

    name: str
    path: str
    method: str = "GET"
    headers: tuple[tuple[str, str], ...] = ()
    deadline: float | None = None
    """This class's client deadline, seconds (None: the plan's)."""
    template: RequestTemplate | None = None
    """Rendered per send when set (placeholders, bodies); ``path``, ``method`` and
    ``headers`` are then the template's."""


@dataclass(frozen=True)
class AdminCall:
    """An HTTP request made when a step starts, e.g. to slow the demo's dependency down."""

    host: str
    port: int
    path: str
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadStep:
    """Offer ``rate`` requests/s for ``duration`` seconds, split across classes by ``mix``."""

    label: str
    rate: float
    duration: float
    mix: tuple[tuple[str, float], ...]
    settle: float = 0.0
    """Seconds at the start of the step left out of the steady-state figures."""
    arrivals: str = "constant"
    """``constant`` (evenly spaced) or ``poisson`` (exponential gaps, seeded)."""
    actions: tuple[AdminCall, ...] = ()
    measured: bool = True
    """False for warm-up steps: run but not reported."""
    retries: int = 0
    """Client retries per failed original request (0: clients never retry)."""
    retry_backoff: float = 0.1
    """Backoff before retry n (1-based) is ``retry_backoff * 2 ** (n - 1)`` seconds."""
    retry_budget: float | None = None
    """None: naive clients. A ratio: brownout-style clients (budget, jitter, marker)."""


@dataclass(frozen=True)
class LoadPlan:
    """Everything the generator needs to run one scenario against one server."""

    host: str
    port: int
    classes: tuple[TrafficClass, ...]
    steps: tuple[LoadStep, ...]
    deadline: float
    max_connections: int = 1024
    seed: int = 1
    bin_seconds: float = 0.5
    send_budget: bool = True
    """Send the client deadline as ``brownout-budget-ms`` (as an internal caller would)."""
    tls: bool = False
    """Connect with TLS (an ``https://`` target), verifying the certificate when
    ``tls_verify``."""
    tls_verify: bool = True
    host_header: str | None = None
    """The ``host`` header sent (None: ``host:port``)."""
    watch: tuple[tuple[str, int], ...] = ()
    """(role, pid) of processes whose CPU use is read over each step's steady state (the
    generator reads its own as ``generator``)."""
    watch_core: int | None = None
    """The core whose busy share is read with them (the front's), or None."""


@dataclass
class StepResult:
    """What happened during one step (all requests scheduled in it, whatever ended them)."""

    label: str
    rate: float
    duration: float
    settle: float
    measured: bool
    start: float
    """Seconds from the plan's start."""
    whole: dict[str, Tally]
    steady: dict[str, Tally]
    lateness: list[float] = field(default_factory=list, repr=False)
    connections_opened: int = 0
    retries_whole: Tally = field(default_factory=Tally)
    """Retried attempts of this step's originals (sent whenever their backoff ended)."""
    retries_steady: Tally = field(default_factory=Tally)
    """Retried attempts of this step's steady-state originals."""
    retries_withheld: int = 0
    """Retries a budgeted client did not send (budget empty or ``brownout-retry: never``)."""
    cpu: tuple[CpuSample, CpuSample] | None = None
    """CPU counters when the steady state started and when the step ended (measured steps)."""
    failed_actions: list[str] = field(default_factory=list)
    """The step's admin calls that were not answered 2xx ("host:port/path: status")."""

    @property
    def steady_seconds(self) -> float:
        return max(self.duration - self.settle, 1e-9)

    @property
    def lateness_p99(self) -> float:
        return percentile(self.lateness, 0.99) or 0.0

    @property
    def valid(self) -> bool:
        """False when the generator fell behind its own schedule (see `MAX_LATENESS`)."""
        return self.lateness_p99 <= MAX_LATENESS


@dataclass
class PlanResult:
    """The steps of a plan, plus a timeline of outcomes per ``bin_seconds`` of schedule: per
    bin the counts ``ok``, ``refused``, ``expired`` and ``failed``, the 2xx latency
    percentiles ``p50_ms`` and ``p99_ms`` (None without one) and ``reasons`` (refusals by
    reason)."""

    steps: list[StepResult]
    bin_seconds: float
    timeline: list[dict[str, Any]]
    connections_opened: int
    unresolved: int = 0
    """Requests still without an outcome when the generator gave up waiting (should be 0)."""
    origin: float = 0.0
    """``time.monotonic()`` when the plan started (aligns other processes' per-bin counts)."""


@dataclass(frozen=True)
class Calibration:
    """A closed-loop sweep: the best throughput seen, and the no-load latency."""

    capacity: float
    service_time: float
    levels: tuple[tuple[int, float, float], ...]
    """(concurrency, throughput per s, p50 latency s) for each level tried."""


# -- the request pool --------------------------------------------------------------------------


class _ClientRetries:
    """The retry behaviour of the clients of one step (see `LoadStep.retries`)."""

    __slots__ = ("backoff", "budget", "deadline", "pool", "retries", "rng", "step")

    def __init__(
        self, pool: _Pool, step: LoadStep, result: StepResult, deadline: float, seed: int
    ) -> None:
        self.pool = pool
        self.retries = step.retries
        self.backoff = step.retry_backoff
        self.budget = (
            RetryBudget(step.retry_budget, min_per_second=1.0, window=2.0)
            if step.retry_budget is not None
            else None
        )
        self.step = result
        self.deadline = deadline
        self.rng = random.Random(seed)

    def original(self) -> None:
        if self.budget is not None:
            self.budget.record_request()

    def after(self, req: _Req, outcome: str, never: bool) -> None:
        if outcome not in RETRYABLE_OUTCOMES or req.tries >= self.retries:
            return
        delay = self.backoff * 2**req.tries
        if self.budget is not None:
            if never or not self.budget.try_acquire_retry():
                self.step.retries_withheld += 1
                return
            delay = self.rng.uniform(0.0, delay)  # full jitter
        scheduled = self.pool.clock() + delay
        retry = _Req(
            scheduled,
            scheduled + (req.deadline_at - req.scheduled),  # the original's class deadline
            req.payload,
            self.step.retries_whole,
            self.step.retries_steady if req.steady is not None else None,
            -1,
        )
        retry.tries = req.tries + 1
        retry.retries = self
        retry.whole.offered += 1
        if retry.steady is not None:
            retry.steady.offered += 1
        self.pool.schedule(retry, delay)


class _Req:
    __slots__ = (
        "bin",
        "conn",
        "deadline_at",
        "done",
        "on_done",
        "payload",
        "retries",
        "scheduled",
        "sent",
        "steady",
        "timer",
        "tries",
        "whole",
    )

    def __init__(
        self,
        scheduled: float,
        deadline_at: float,
        payload: bytes,
        whole: Tally,
        steady: Tally | None,
        bin_index: int,
    ) -> None:
        self.scheduled = scheduled
        self.deadline_at = deadline_at
        self.payload = payload
        self.whole = whole
        self.steady = steady
        self.bin = bin_index
        self.conn: _Conn | None = None
        self.sent = False
        self.done = False
        self.timer: asyncio.TimerHandle | None = None
        self.on_done: Callable[[_Req, str, float], None] | None = None
        self.retries: _ClientRetries | None = None
        self.tries = 0


class _Conn(asyncio.Protocol):
    __slots__ = ("closed", "parser", "pool", "req", "transport")

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.parser = ResponseParser()
        self.transport: asyncio.Transport | None = None
        self.req: _Req | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        req = self.req
        if req is not None and not req.done:
            self.pool.write(self, req)
        else:
            self.req = None
            self.pool.release(self)

    def data_received(self, data: bytes) -> None:
        try:
            responses = self.parser.feed(data)
        except ResponseParseError:
            self._fail()
            return
        for response in responses:
            self.pool.on_response(self, response)
            if self.closed:
                return

    def eof_received(self) -> bool | None:
        try:
            response = self.parser.feed_eof()
        except ResponseParseError:
            response = None
        if response is not None:
            response.keep_alive = False
            self.pool.on_response(self, response)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.on_lost(self)

    def _fail(self) -> None:
        req = self.req
        self.req = None
        if req is not None and not req.done:
            self.pool.finish(req, "errors", 0.0)
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True


class _Pool:
    """Keep-alive connections to one server, opened on demand up to a bound."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        limit: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.loop = loop
        self.tls = tls
        self.clock = time.monotonic  # uvloop's loop.time() has only millisecond resolution
        self.host = host
        self.port = port
        self.limit = limit
        self.idle: list[_Conn] = []
        self.waiting: deque[_Req] = deque()
        self.open = 0
        self.opened = 0
        self.outstanding = 0
        self.conns: set[_Conn] = set()
        self.connecting: set[asyncio.Task[None]] = set()
        self.drained: asyncio.Event | None = None
        self.timeline: list[dict[str, Any]] = []
        self.bin_latency: dict[int, list[float]] = {}
        self.bin_reasons: dict[int, dict[str, int]] = {}
        self._reasons: dict[bytes, str] = {}

    # submitting

    def submit(self, req: _Req) -> None:
        self.outstanding += 1
        self._dispatch(req)

    def schedule(self, req: _Req, delay: float) -> None:
        """Submit ``req`` after ``delay`` seconds (a client retry); outstanding from now on."""
        self.outstanding += 1
        self.loop.call_later(delay, self._dispatch, req)

    def _dispatch(self, req: _Req) -> None:
        req.timer = self.loop.call_later(req.deadline_at - self.clock(), self._expire, req)
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.write(conn, req)
                return
        if self.open < self.limit:
            self._connect(req)
        else:
            self.waiting.append(req)

    def _connect(self, req: _Req) -> None:
        conn = _Conn(self)
        conn.req = req
        req.conn = conn
        self.open += 1
        self.opened += 1
        self.conns.add(conn)
        task = self.loop.create_task(self._open(conn))
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    async def _open(self, conn: _Conn) -> None:
        try:
            if self.tls is None:
                await self.loop.create_connection(lambda: conn, self.host, self.port)
            else:
                await self.loop.create_connection(
                    lambda: conn, self.host, self.port, ssl=self.tls, server_hostname=self.host
                )
        except OSError:
            conn.closed = True
            self.on_lost(conn)

    def write(self, conn: _Conn, req: _Req) -> None:
        conn.req = req
        req.conn = conn
        req.sent = True
        req.whole.sent += 1
        if req.steady is not None:
            req.steady.sent += 1
        assert conn.transport is not None
        conn.transport.write(req.payload)

    def release(self, conn: _Conn) -> None:
        """A connection is free again: give it to the oldest live waiter, or park it."""
        waiting = self.waiting
        while waiting:
            req = waiting.popleft()
            if not req.done:
                self.write(conn, req)
                return
        self.idle.append(conn)

    # outcomes

    def on_response(self, conn: _Conn, response: Response) -> None:
        req = conn.req
        conn.req = None
        if req is not None and not req.done:
            now = self.clock()
            latency = now - req.scheduled
            status = response.status
            headers = response.headers
            degraded = DEGRADED_HEADER in headers
            if degraded:
                req.whole.degraded += 1
                if req.steady is not None:
                    req.steady.degraded += 1
            if 200 <= status < 300:
                outcome = "ok" if now <= req.deadline_at else "ok_late"
                req.whole.success_latency.append(latency)
                if req.steady is not None:
                    req.steady.success_latency.append(latency)
                if req.bin >= 0:
                    self.bin_latency.setdefault(req.bin, []).append(latency)
                if degraded and outcome == "ok":
                    req.whole.degraded_ok += 1
                    if req.steady is not None:
                        req.steady.degraded_ok += 1
            elif status == 503 or status == 429:
                outcome = "r503" if status == 503 else "r429"
                reason = self._reason(status, response.body)
                for tally in (req.whole, req.steady):
                    if tally is not None:
                        tally.refusal_latency.append(latency)
                        tally.shed_reasons[reason] = tally.shed_reasons.get(reason, 0) + 1
                if req.bin >= 0:
                    reasons = self.bin_reasons.setdefault(req.bin, {})
                    reasons[reason] = reasons.get(reason, 0) + 1
            elif status == 504:
                outcome = "r504"
            else:
                outcome = "other_status"
            never = headers.get(RETRY_HEADER, "").strip().lower() == DO_NOT_RETRY_VALUE
            self.finish(req, outcome, latency, never)
        if req is not None and response.keep_alive and not conn.closed:
            self.release(conn)
        else:  # the server closes, or sent a response nobody asked for
            conn.close()

    def _reason(self, status: int, body: bytes) -> str:
        """The refusal reason a problem+json body names (cached: bodies repeat)."""
        cached = self._reasons.get(body)
        if cached is not None:
            return cached
        reason = f"http_{status}"
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            value = doc.get("reason")
            if not isinstance(value, str):
                value = doc.get("type")
                value = value.rstrip("/") if isinstance(value, str) else None
            if value:
                reason = re.split(r"[/:#]", value)[-1][:40] or reason
        if len(self._reasons) < 256:
            self._reasons[body] = reason
        return reason

    def _expire(self, req: _Req) -> None:
        if req.done:
            return
        req.timer = None
        conn = req.conn
        if req.sent and conn is not None:
            self.finish(req, "timeouts_sent", self.clock() - req.scheduled)
            conn.req = None
            conn.close()
        else:
            if conn is not None:  # still connecting: the connection joins the pool when up
                conn.req = None
            self.finish(req, "timeouts_unsent", self.clock() - req.scheduled)

    def finish(self, req: _Req, outcome: str, latency: float, never: bool = False) -> None:
        req.done = True
        self.outstanding -= 1
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        whole = req.whole
        setattr(whole, outcome, getattr(whole, outcome) + 1)
        steady = req.steady
        if steady is not None:
            setattr(steady, outcome, getattr(steady, outcome) + 1)
        timeline = self.timeline
        if req.bin >= 0:
            while len(timeline) <= req.bin:
                timeline.append({"ok": 0, "refused": 0, "expired": 0, "failed": 0})
            slot = timeline[req.bin]
            if outcome == "ok":
                slot["ok"] += 1
            elif outcome in ("r503", "r429"):
                slot["refused"] += 1
            elif outcome in ("timeouts_sent", "timeouts_unsent", "r504", "ok_late"):
                slot["expired"] += 1
            else:
                slot["failed"] += 1
        if req.on_done is not None:
            req.on_done(req, outcome, latency)
        if req.retries is not None:
            req.retries.after(req, outcome, never)
        # Only now: a retry scheduled just above is outstanding too. Checked before it, the
        # last failure of a run would signal "drained" with its retry still to come.
        if self.outstanding == 0 and self.drained is not None:
            self.drained.set()

    def detail_timeline(self) -> None:
        """Add each bin's 2xx latency percentiles and refusals by reason to the timeline."""
        for index, slot in enumerate(self.timeline):
            latencies = self.bin_latency.get(index, [])
            for name, q in (("p50_ms", 0.50), ("p99_ms", 0.99)):
                value = percentile(latencies, q)
                slot[name] = None if value is None else round(value * 1000, 2)
            slot["reasons"] = dict(sorted(self.bin_reasons.get(index, {}).items()))

    def on_lost(self, conn: _Conn) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        conn.closed = True
        self.open -= 1
        req = conn.req
        conn.req = None
        if req is not None and not req.done:
            self.finish(req, "errors", self.clock() - req.scheduled)
        # A waiter that lost its chance at a connection gets a new one.
        while self.waiting and self.open < self.limit:
            head = self.waiting.popleft()
            if not head.done:
                self._connect(head)
                break

    async def close_all(self) -> None:
        for task in list(self.connecting):
            task.cancel()
        if self.connecting:
            await asyncio.gather(*self.connecting, return_exceptions=True)
        for conn in list(self.conns):
            conn.close()
        await asyncio.sleep(0)


# -- running a plan ----------------------------------------------------------------------------


def _budget(plan: LoadPlan, c: TrafficClass) -> tuple[tuple[str, str], ...]:
    if not plan.send_budget:
        return ()
    return ((BUDGET_HEADER, str(int((c.deadline or plan.deadline) * 1000))),)


def _payloads(plan: LoadPlan) -> dict[str, bytes]:
    """The request bytes of every class that is the same on every send."""
    host = plan.host_header or f"{plan.host}:{plan.port}"
    rng = random.Random(plan.seed)
    out: dict[str, bytes] = {}
    for c in plan.classes:
        if c.template is None:
            out[c.name] = encode_request(c.method, c.path, host, (*c.headers, *_budget(plan, c)))
        elif c.template.static:
            out[c.name] = c.template.render(rng, host, _budget(plan, c))
    return out


def _renderers(plan: LoadPlan) -> dict[str, Callable[[random.Random], bytes]]:
    """A function per class whose request varies per send (placeholders)."""
    host = plan.host_header or f"{plan.host}:{plan.port}"
    out: dict[str, Callable[[random.Random], bytes]] = {}
    for c in plan.classes:
        t = c.template
        if t is not None and not t.static:
            out[c.name] = functools.partial(_render, t, host=host, extra=_budget(plan, c))
    return out


def _render(
    t: RequestTemplate, rng: random.Random, host: str, extra: tuple[tuple[str, str], ...]
) -> bytes:
    return t.render(rng, host, extra)


def tls_context(plan: LoadPlan) -> ssl.SSLContext | None:
    """The client TLS context of an ``https://`` plan (None for plain HTTP)."""
    if not plan.tls:
        return None
    ctx = ssl.create_default_context()
    if not plan.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def admin_call(call: AdminCall) -> int:
    """POST ``call.body`` as JSON; returns the status (0 when the server could not be reached)."""
    body = json.dumps(call.body).encode()
    payload = encode_request(
        "POST",
        call.path,
        f"{call.host}:{call.port}",
        (("content-type", "application/json"), ("connection", "close")),
        body,
    )
    try:
        reader, writer = await asyncio.open_connection(call.host, call.port)
    except OSError:
        return 0
    try:
        writer.write(payload)
        parser = ResponseParser()
        async with asyncio.timeout(5):
            while True:
                data = await reader.read(65536)
                if not data:
                    last = parser.feed_eof()
                    return last.status if last is not None else 0
                done = parser.feed(data)
                if done:
                    return done[0].status
    except (OSError, TimeoutError, ResponseParseError):
        return 0
    finally:
        writer.close()


ProgressFn = Callable[[int, float, dict[str, int]], None]


async def run_plan(plan: LoadPlan, progress: ProgressFn | None = None) -> PlanResult:
    """Run every step of ``plan`` back to back; return counts once every request resolved.

    ``progress(step_index, seconds_into_step, counts)`` is called about four times a second.
    """
    loop = asyncio.get_running_loop()
    pool = _Pool(loop, plan.host, plan.port, fit_fd_limit(plan.max_connections), tls_context(plan))
    clock = pool.clock
    payloads = _payloads(plan)
    renderers = _renderers(plan)
    deadlines = {c.name: c.deadline or plan.deadline for c in plan.classes}
    rng = random.Random(plan.seed)
    # Its own stream: placeholder draws must not shift the arrivals or the mix.
    draws = random.Random(plan.seed + 7919)
    results: list[StepResult] = []
    watched = (("generator", os.getpid()), *plan.watch)
    origin = clock()
    bin_width = plan.bin_seconds
    for index, step in enumerate(plan.steps):
        failed = []
        for action in step.actions:
            status = await admin_call(action)
            if not 200 <= status < 300:
                failed.append(
                    f"{action.host}:{action.port}{action.path}: {status or 'unreachable'}"
                )
        names = [name for name, weight in step.mix if weight > 0]
        weights = [weight for _, weight in step.mix if weight > 0]
        total = sum(weights)
        cumulative: list[float] = []
        acc = 0.0
        for weight in weights:
            acc += weight / total
            cumulative.append(acc)
        cumulative[-1] = 1.0
        whole = {n: Tally() for n in names}
        steady = {n: Tally() for n in names}
        result = StepResult(
            step.label,
            step.rate,
            step.duration,
            step.settle,
            step.measured,
            clock() - origin,
            whole,
            steady,
            failed_actions=failed,
        )
        results.append(result)
        retries = (
            _ClientRetries(pool, step, result, plan.deadline, plan.seed + index)
            if step.retries > 0
            else None
        )
        opened_before = pool.opened
        start = clock()
        end = start + step.duration
        steady_from = start + step.settle
        poisson = step.arrivals == "poisson"
        # Constant arrivals are computed from their index, so float drift never adds one.
        count = round(step.rate * step.duration) if not poisson else -1
        n = 0
        next_t = start + (rng.expovariate(step.rate) if poisson and step.rate > 0 else 0.0)
        if count == 0:
            next_t = end
        lateness = result.lateness
        single = payloads.get(names[0]) if len(names) == 1 else None
        next_progress = start
        deadline = deadlines[names[0]] if len(names) == 1 else plan.deadline
        per_class = len({deadlines[n] for n in names}) > 1
        steady_cpu: CpuSample | None = None
        while True:
            now = clock()
            if steady_cpu is None and step.measured and now >= steady_from:
                steady_cpu = read_sample(watched, plan.watch_core)
            while next_t <= now and next_t < end and step.rate > 0:
                if single is not None:
                    name = names[0]
                    payload = single
                else:
                    if len(names) == 1:
                        name = names[0]
                    else:
                        r = rng.random()
                        i = 0
                        while cumulative[i] < r:
                            i += 1
                        name = names[i]
                    render = renderers.get(name)
                    payload = render(draws) if render is not None else payloads[name]
                    if per_class:
                        deadline = deadlines[name]
                w = whole[name]
                w.offered += 1
                s: Tally | None = None
                if next_t >= steady_from:
                    s = steady[name]
                    s.offered += 1
                lateness.append(now - next_t)
                bin_index = int((next_t - origin) / bin_width) if step.measured else -1
                req = _Req(next_t, next_t + deadline, payload, w, s, bin_index)
                if retries is not None:
                    req.retries = retries
                    retries.original()
                pool.submit(req)
                n += 1
                if poisson:
                    next_t += rng.expovariate(step.rate)
                elif n < count:
                    next_t = start + n / step.rate
                else:
                    next_t = end
            if now >= next_progress and progress is not None:
                next_progress = now + 0.25
                counts = {"offered": sum(t.offered for t in whole.values())}
                counts["ok"] = sum(t.ok for t in whole.values())
                progress(index, now - start, counts)
            if next_t >= end or step.rate <= 0:
                remaining = end - clock()
                if remaining > 0:
                    await asyncio.sleep(remaining)
                break
            delay = next_t - clock()
            await asyncio.sleep(delay if delay > 0 else 0)
        if steady_cpu is not None:
            result.cpu = (steady_cpu, read_sample(watched, plan.watch_core))
        result.connections_opened = pool.opened - opened_before
    if pool.outstanding > 0:  # every request has a deadline timer, so this ends
        longest = max(deadlines.values(), default=plan.deadline)
        pool.drained = asyncio.Event()
        # Each retry may take its backoff plus a whole deadline.
        chain = max(
            (
                sum(st.retry_backoff * 2**k + longest for k in range(st.retries))
                for st in plan.steps
            ),
            default=0.0,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pool.drained.wait(), longest + chain + 2.0)
    unresolved = pool.outstanding
    await pool.close_all()
    pool.detail_timeline()
    return PlanResult(results, bin_width, pool.timeline, pool.opened, unresolved, origin)


async def calibrate(
    host: str,
    port: int,
    path: str,
    *,
    level_seconds: float = 1.0,
    max_concurrency: int = 128,
    deadline: float = 5.0,
) -> Calibration:
    """Measure capacity closed-loop: double the concurrency until throughput stops growing.

    Capacity is the best throughput of 2xx responses seen; the service time is the p50 latency
    at concurrency 1 (no queueing).
    """
    loop = asyncio.get_running_loop()
    pool = _Pool(loop, host, port, max_concurrency)
    clock = pool.clock
    payload = encode_request("GET", path, f"{host}:{port}")
    levels: list[tuple[int, float, float]] = []
    best = 0.0
    flat = 0
    concurrency = 1
    try:
        while concurrency <= max_concurrency:
            latencies: list[float] = []
            tally = Tally()
            end = clock() + level_seconds

            async def worker(
                tally: Tally = tally, latencies: list[float] = latencies, end: float = end
            ) -> None:
                while clock() < end:
                    fut: asyncio.Future[tuple[str, float]] = loop.create_future()

                    def done(_r: _Req, outcome: str, latency: float, fut: Any = fut) -> None:
                        if not fut.done():
                            fut.set_result((outcome, latency))

                    now = clock()
                    req = _Req(now, now + deadline, payload, tally, None, -1)
                    req.on_done = done
                    tally.offered += 1
                    pool.submit(req)
                    outcome, latency = await fut
                    if outcome == "ok":
                        latencies.append(latency)

            start = clock()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = clock() - start
            throughput = tally.ok / elapsed if elapsed > 0 else 0.0
            p50 = percentile(latencies, 0.5) or 0.0
            levels.append((concurrency, throughput, p50))
            if throughput > best * 1.05:
                flat = 0
            else:
                flat += 1
            best = max(best, throughput)
            if flat >= 2 or tally.ok == 0:
                break
            concurrency *= 2
    finally:
        await pool.close_all()
    service_time = levels[0][2] if levels else 0.0
    return Calibration(best, service_time, tuple(levels))
