"""Runs a `System` on a `VirtualLoop`: instances, load balancing, calls, faults, counters.

Every request crosses a "wire" between tasks: the callee runs in a task of its own with a
fresh context, so a caller that gives up does not stop the callee (as over a network), and
the callee knows the caller's deadline only when the edge propagates it. Failures cross as
brownout's adapters would see them: refusals and gateway timeouts as `ResponseError`
(503 with or without the do-not-retry marker, 504), a down instance as a `TransientError`
that was never sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .._admission.bulkhead import Bulkhead
from .._context import current, current_deadline, request
from .._deadline import Deadline
from .._dependency import Dependency
from .._errors import DeadlineExceeded, Rejected
from .._priority import Priority
from .._retry.classify import ResponseError, TransientError
from .loop import VirtualLoop, run
from .model import Arrivals, Build, Call, Fault, ModelError, Problem, Service, System, validate
from .results import Result, Series

__all__ = ["simulate"]

_GC_THRESHOLDS = (50_000, 20, 100)
_DO_NOT_RETRY_REASONS = frozenset({"budget_exhausted", "do_not_retry", "outcome_unknown"})
Progress = Callable[[float, float], None]


class _Req:
    """One request at one hop: who waits for it, and since when nobody does."""

    __slots__ = ("abandoned_at", "parent")

    def __init__(self, parent: _Req | None) -> None:
        self.parent = parent
        self.abandoned_at = math.inf

    def abandoned_since(self) -> float:
        """The earliest moment anyone up the chain stopped waiting (inf: all still wait)."""
        t = self.abandoned_at
        p = self.parent
        while p is not None:
            if p.abandoned_at < t:
                t = p.abandoned_at
            p = p.parent
        return t


class _Shed(Exception):
    """Refused by this instance's own admission (bulkhead or full worker queue)."""

    def __init__(self, refused: Rejected | None) -> None:
        super().__init__("shed")
        self.refused = refused


class _Injected(Exception):
    """An error the fault timeline made this request fail with."""


class _Edge:
    """One calling instance's view of one `Call`: its own `Dependency`."""

    __slots__ = ("call", "dependency", "target")

    def __init__(self, call: Call, dependency: Dependency, target: _ServiceRun) -> None:
        self.call = call
        self.dependency = dependency
        self.target = target


class _Instance:
    __slots__ = (
        "bulkhead",
        "busy",
        "down",
        "edges",
        "index",
        "service",
        "waiters",
        "workers",
        "zone",
    )

    def __init__(self, service: _ServiceRun, index: int, zone: str) -> None:
        self.service = service
        self.index = index
        self.zone = zone
        self.workers = service.spec.workers
        self.busy = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.down = 0  # faults holding it down
        self.bulkhead: Bulkhead | None = None
        self.edges: list[_Edge] = []

    def release(self) -> None:
        waiters = self.waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)  # the worker passes straight to the next waiter
                return
        self.busy -= 1


class _ServiceRun:
    __slots__ = ("error_rate", "instances", "routable", "series", "slowdown", "spec")

    def __init__(self, spec: Service, series: Series) -> None:
        self.spec = spec
        self.series = series
        self.instances: list[_Instance] = []
        self.routable: list[_Instance] = []
        self.slowdown = 1.0
        self.error_rate = 0.0


class _Run:
    """The state of one simulation."""

    def __init__(self, system: System, progress: Progress | None) -> None:
        self.system = system
        self.rng = random.Random(system.seed)
        self.bucket = system.bucket
        self.progress = progress
        n = math.ceil(system.duration / system.bucket)
        self.result = Result(system, n)
        self.services: dict[str, _ServiceRun] = {}
        for s in system.services:
            self.services[s.name] = _ServiceRun(s, self.result.layer(s.name))
        self.loop: VirtualLoop | None = None
        self.empty = contextvars.Context()
        self.clients: list[tuple[Arrivals, _Edge]] = []

    def child_rng(self) -> random.Random:
        return random.Random(self.rng.getrandbits(64))

    # -- building ----------------------------------------------------------------------------
    def build(self) -> None:
        problems: list[Problem] = []
        for svc in self.services.values():
            spec = svc.spec
            for i in range(spec.instances):
                inst = _Instance(svc, i, spec.zones[i % len(spec.zones)])
                where = f"services.{spec.name}"
                if spec.bulkhead is not None:
                    b = self._make(spec.bulkhead, f"{spec.name}[{i}]", spec.name, i)
                    if isinstance(b, Problem):
                        problems.append(Problem(f"{where}.bulkhead", b.message))
                    else:
                        inst.bulkhead = b
                for j, call in enumerate(spec.calls):
                    dep = self._dependency(call, f"{spec.name}[{i}]->{call.target}", spec.name, i)
                    if isinstance(dep, Problem):
                        problems.append(Problem(f"{where}.calls[{j}].dependency", dep.message))
                    else:
                        inst.edges.append(_Edge(call, dep, self.services[call.target]))
                svc.instances.append(inst)
            svc.routable = list(svc.instances)
            if problems:
                break
        if problems:
            raise ModelError(problems)

    def _make(self, factory: Callable[[Build], Any], name: str, service: str, i: int) -> Any:
        try:
            return factory(Build(name, self.child_rng(), service, i))
        except (TypeError, ValueError) as e:
            return Problem("", f"{type(e).__name__}: {e}")

    def _dependency(self, call: Call, name: str, service: str, i: int) -> Dependency | Problem:
        if call.dependency is None:
            return Dependency(name)
        dep = self._make(call.dependency, name, service, i)
        if not isinstance(dep, (Dependency, Problem)):
            return Problem("", f"the factory returned {type(dep).__name__}, not a Dependency")
        return dep

    # -- the wire ----------------------------------------------------------------------------
    async def send(self, edge: _Edge, parent: _Req) -> None:
        """One attempt of ``edge``'s call, from inside the caller's attempt scope."""
        loop = self.loop
        assert loop is not None
        call = edge.call
        target = edge.target
        routable = target.routable
        if not routable:
            raise TransientError("no instance to send to", sent=False)
        inst = routable[0] if len(routable) == 1 else routable[self.rng.randrange(len(routable))]
        ctx = current()
        if inst.down:
            b = int(loop.time() / self.bucket)
            series = target.series
            series.add(series.offered, b)
            if ctx.attempt > 1:
                series.add(series.retried, b)
            series.add(series.failed, b)
            raise TransientError("connection refused", sent=False)
        deadline_at = math.inf
        if call.propagate_deadline:
            d = current_deadline()
            if d is not None:
                deadline_at = d.at + call.latency  # the remaining budget, read on arrival
        req = _Req(parent)
        fut: asyncio.Future[None] = loop.create_future()
        loop.create_task(
            self.serve(inst, req, fut, deadline_at, ctx.priority, ctx.attempt > 1, call.latency),
            context=self.empty.copy(),
        )
        try:
            await fut
        except asyncio.CancelledError:
            if loop.time() < req.abandoned_at:
                req.abandoned_at = loop.time()
            raise

    async def serve(
        self,
        inst: _Instance,
        req: _Req,
        fut: asyncio.Future[None],
        deadline_at: float,
        priority: Priority,
        retry: bool,
        latency: float,
    ) -> None:
        loop = self.loop
        assert loop is not None
        if latency > 0.0:
            await asyncio.sleep(latency)
        svc = inst.service
        spec = svc.spec
        series = svc.series
        bucket = self.bucket
        b = int(loop.time() / bucket)
        series.add(series.offered, b)
        if retry:
            series.add(series.retried, b)
        if spec.deadline is not None:
            deadline_at = min(deadline_at, loop.time() + spec.deadline)
        error: BaseException | None = None
        try:
            if deadline_at < math.inf:
                async with request(deadline=Deadline(deadline_at), priority=priority):
                    await self.handle(inst, req)
            else:
                async with request(priority=priority):
                    await self.handle(inst, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e
        finally:
            end = loop.time()
            if req.abandoned_at > end:
                req.abandoned_at = end  # answered: nobody waits for it any more
        if latency > 0.0:
            await asyncio.sleep(latency)
        b = int(loop.time() / bucket)
        if fut.done():
            if error is None:
                series.add(series.late, b)
            return
        if error is None:
            series.add(series.completed, b)
            fut.set_result(None)
            return
        if isinstance(error, _Shed):
            series.add(series.shed, b)
            refused = error.refused
            marker = (
                spec.do_not_retry_marker
                and refused is not None
                and refused.reason.value in _DO_NOT_RETRY_REASONS
            )
            retry_after = refused.retry_after if refused is not None else None
            fut.set_exception(
                ResponseError(503, retry_after=retry_after, do_not_retry=marker, detail="shed")
            )
            return
        series.add(series.failed, b)
        fut.set_exception(self.answer(spec, error))

    @staticmethod
    def answer(spec: Service, error: BaseException) -> Exception:
        """What the caller's client library sees for a request that failed with ``error``."""
        if isinstance(error, DeadlineExceeded):
            return ResponseError(504, detail="deadline exceeded")
        if (
            spec.do_not_retry_marker
            and isinstance(error, Rejected)
            and error.reason.value in _DO_NOT_RETRY_REASONS
        ):
            return ResponseError(503, do_not_retry=True, detail=error.reason.value)
        return ResponseError(503, detail=type(error).__name__)

    async def handle(self, inst: _Instance, req: _Req) -> None:
        bulkhead = inst.bulkhead
        if bulkhead is None:
            await self.work(inst, req)
            return
        admitted = False
        try:
            async with bulkhead.admit():
                admitted = True
                await self.work(inst, req)
        except Rejected as refused:
            if not admitted:
                raise _Shed(refused) from refused
            raise

    async def work(self, inst: _Instance, req: _Req) -> None:
        loop = self.loop
        assert loop is not None
        svc = inst.service
        series = svc.series
        queued = -1.0
        if inst.busy < inst.workers:
            inst.busy += 1
        else:
            queued = loop.time()
            max_queue = svc.spec.max_queue
            if max_queue is not None and len(inst.waiters) >= max_queue:
                raise _Shed(None)
            waiter: asyncio.Future[None] = loop.create_future()
            inst.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    inst.release()  # handed a worker in the same instant it was cancelled
                raise
        start = loop.time()
        b = int(start / self.bucket)
        series.add(series.admitted, b)
        if queued >= 0.0:
            series.add(series.waited, b, start - queued)
        try:
            await asyncio.sleep(svc.spec.service_time.sample(self.rng) * svc.slowdown)
        finally:
            end = loop.time()
            inst.release()
            b = int(end / self.bucket)
            series.add(series.busy, b, end - start)
            gone = req.abandoned_since()
            if gone < end:
                series.add(series.wasted, b, end - max(start, gone))
        if svc.error_rate > 0.0 and self.rng.random() < svc.error_rate:
            raise _Injected("injected error")
        edges = inst.edges
        if not edges:
            return
        for edge in edges:
            dep = edge.dependency
            fanout = edge.call.fanout
            idempotent = edge.call.idempotent
            if fanout == 1:
                await dep.call(self.send, edge, req, idempotent=idempotent)
            else:
                try:
                    async with asyncio.TaskGroup() as group:
                        for _ in range(fanout):
                            group.create_task(dep.call(self.send, edge, req, idempotent=idempotent))
                except BaseExceptionGroup as failed:
                    first = failed.exceptions[0]
                    while isinstance(first, BaseExceptionGroup):
                        first = first.exceptions[0]
                    raise first from None

    # -- clients -----------------------------------------------------------------------------
    async def client(self, arrivals: Arrivals, edge: _Edge) -> None:
        loop = self.loop
        assert loop is not None
        series = self.result.layer(arrivals.name)
        rng = self.child_rng()
        steps = sorted(arrivals.steps)
        rate = arrivals.rate
        constant = arrivals.spacing == "constant"
        duration = self.system.duration
        t = loop.time()
        origin, sent = t, 0  # constant spacing: the k-th arrival at origin + k / rate, no drift
        while True:
            if steps and steps[0][0] <= t:
                rate = steps.pop(0)[1]
                origin, sent = t, 0
                continue
            next_step = steps[0][0] if steps else math.inf
            if rate <= 0.0:
                if next_step == math.inf:
                    return
                t = next_step
                continue
            after = origin + (sent + 1) / rate if constant else t + rng.expovariate(rate)
            if after >= next_step:
                t = next_step  # memoryless (or a new spacing): start again at the new rate
                continue
            t = after
            sent += 1
            if t >= duration:
                return
            await asyncio.sleep(t - loop.time())
            loop.create_task(self.one(arrivals, edge, series), context=self.empty.copy())

    async def one(self, arrivals: Arrivals, edge: _Edge, series: Series) -> None:
        loop = self.loop
        assert loop is not None
        b = int(loop.time() / self.bucket)
        series.add(series.offered, b)
        series.add(series.admitted, b)
        req = _Req(None)
        outcome = series.failed
        try:
            async with request(
                deadline=None if arrivals.deadline is None else arrivals.deadline,
                priority=arrivals.priority,
                operation=arrivals.name,
            ):
                await edge.dependency.call(self.send, edge, req, idempotent=edge.call.idempotent)
            outcome = series.completed
        except asyncio.CancelledError:
            raise
        except Rejected as refused:
            if refused.reason.value not in _DO_NOT_RETRY_REASONS:
                outcome = series.shed  # refused by the client's own guards, never sent
        except Exception:
            pass
        finally:
            now = loop.time()
            req.abandoned_at = min(req.abandoned_at, now)
        series.add(outcome, int(now / self.bucket))

    def prepare_clients(self) -> None:
        problems = []
        for i, a in enumerate(self.system.arrivals):
            dep = self._dependency(a.call, f"{a.name}->{a.call.target}", a.name, 0)
            if isinstance(dep, Problem):
                problems.append(Problem(f"arrivals[{i}].call.dependency", dep.message))
            else:
                self.clients.append((a, _Edge(a.call, dep, self.services[a.call.target])))
        if problems:
            raise ModelError(problems)

    # -- faults ------------------------------------------------------------------------------
    def _targets(self, fault: Fault) -> list[_Instance]:
        if fault.kind == "zone_loss":
            services = (
                [self.services[fault.service]] if fault.service else list(self.services.values())
            )
            return [i for s in services for i in s.instances if i.zone == fault.zone]
        svc = self.services[fault.service or ""]
        if fault.kind == "outage":
            return list(svc.instances)
        if fault.kind == "capacity_loss":
            return svc.instances[: round(fault.fraction * len(svc.instances))]
        return []

    def _reroute(self, svc: _ServiceRun) -> None:
        svc.routable = [i for i in svc.instances if not i.down] or []

    async def fault(self, fault: Fault) -> None:
        loop = self.loop
        assert loop is not None
        await asyncio.sleep(max(0.0, fault.at - loop.time()))
        svc = self.services.get(fault.service or "")
        down = self._targets(fault)
        for inst in down:
            inst.down += 1
        if fault.kind == "slowdown" and svc is not None:
            svc.slowdown *= fault.factor
        elif fault.kind == "error_rate" and svc is not None:
            svc.error_rate = fault.fraction
        touched = {id(i.service): i.service for i in down}
        if down:
            if fault.detect > 0.0:
                loop.call_later(fault.detect, self._detected, list(touched.values()))
            else:
                self._detected(list(touched.values()))
        if fault.until is None:
            return
        await asyncio.sleep(fault.until - loop.time())
        for inst in down:
            inst.down -= 1
        for s in touched.values():
            self._reroute(s)
        if fault.kind == "slowdown" and svc is not None:
            svc.slowdown /= fault.factor
        elif fault.kind == "error_rate" and svc is not None:
            svc.error_rate = 0.0

    def _detected(self, services: list[_ServiceRun]) -> None:
        for s in services:
            self._reroute(s)

    # -- the run -----------------------------------------------------------------------------
    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop)
        self.loop = loop
        tasks = [
            loop.create_task(self.client(a, edge), context=self.empty.copy())
            for a, edge in self.clients
        ]
        tasks += [loop.create_task(self.fault(f)) for f in self.system.faults]
        duration = self.system.duration
        step = max(self.bucket, duration / 20.0)
        t = 0.0
        while t < duration:
            t = min(duration, t + step)
            await asyncio.sleep(t - loop.time())
            if self.progress is not None:
                self.progress(t, duration)
        for task in tasks:
            task.cancel()


def simulate(system: System, *, progress: Progress | None = None) -> Result:
    """Run ``system`` on virtual time and return its `Result` (per layer, per bucket).

    Raises `ModelError` naming every bad field before anything runs. ``progress(t, duration)``
    is called about twenty times along the way (virtual seconds). While it runs, the garbage
    collector's thresholds are raised to at least (50000, 20, 100), and restored after.
    """
    validate(system)
    sim = _Run(system, progress)
    sim.build()
    sim.prepare_clients()
    started = time.perf_counter()  # wall time, reported only: the run never reads it
    thresholds = gc.get_threshold()
    # Thousands of requests in flight are young objects that live for many of the collector's
    # default 700-allocation rounds: collected far less often, the same garbage is freed.
    gc.set_threshold(*(max(old, new) for old, new in zip(thresholds, _GC_THRESHOLDS)))
    try:
        run(sim.main())
    finally:
        gc.set_threshold(*thresholds)
    sim.result.wall_seconds = time.perf_counter() - started
    sim.result.finish()
    return sim.result
