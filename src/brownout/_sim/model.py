"""The simulated system: services, their calls, arrivals, faults and invariants, as data.

Policies are factories: a function of a `Build` (a name and a seeded random source) that
returns the real brownout object a service would configure (a `Bulkhead` at a node, a
`Dependency` with its `RetryPolicy`, `RetryBudget`, breaker and throttle on an edge). Each
instance calls its factories once, so every instance has its own budget and limit, as a
fleet does. `validate` checks a whole `System` and names every bad field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .._admission.bulkhead import Bulkhead
from .._dependency import Dependency
from .._priority import Priority

__all__ = [
    "METRICS",
    "Arrivals",
    "Build",
    "Call",
    "Constant",
    "Exponential",
    "Fault",
    "FaultKind",
    "Invariant",
    "LogNormal",
    "ModelError",
    "Problem",
    "Service",
    "ServiceTime",
    "System",
    "Unbudgeted",
    "Uniform",
    "validate",
]


class ServiceTime(Protocol):
    """A distribution of the time one request holds a worker, in seconds."""

    @property
    def mean(self) -> float: ...

    def sample(self, rng: random.Random) -> float: ...


@dataclass(frozen=True)
class Exponential:
    """Exponentially distributed service times (the M in M/M/c)."""

    mean: float

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)


@dataclass(frozen=True)
class Constant:
    """Every request takes ``value`` seconds."""

    value: float

    @property
    def mean(self) -> float:
        return self.value

    def sample(self, rng: random.Random) -> float:
        return self.value


@dataclass(frozen=True)
class Uniform:
    """Service times uniform in ``[low, high]``."""

    low: float
    high: float

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2.0

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


@dataclass(frozen=True)
class LogNormal:
    """Log-normal service times with the given ``mean`` and shape ``sigma`` (a long tail)."""

    mean: float
    sigma: float

    def sample(self, rng: random.Random) -> float:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2.0
        return rng.lognormvariate(mu, self.sigma)


@dataclass(frozen=True)
class Build:
    """What a policy factory gets: a name for the object and its own seeded random source."""

    name: str
    rng: random.Random
    service: str
    instance: int


BulkheadFactory = Callable[[Build], Bulkhead]
DependencyFactory = Callable[[Build], Dependency]


@dataclass(frozen=True)
class Call:
    """One edge: each request of the calling service calls ``target`` ``fanout`` times in
    parallel through ``dependency`` (default: a plain `Dependency`, no timeout, no retry).

    ``propagate_deadline``: the callee works under the caller's attempt budget (brownout's
    propagation headers); without it the callee knows nothing of the caller's deadline.
    ``latency``: one-way network time, each way. ``idempotent``: reads are retried freely;
    a mutation's lost attempts become unknown outcomes.
    """

    target: str
    fanout: int = 1
    dependency: DependencyFactory | None = None
    propagate_deadline: bool = True
    latency: float = 0.0
    idempotent: bool = True


@dataclass(frozen=True)
class Service:
    """A service: ``instances`` copies, each with ``workers`` that do its local work.

    A request is admitted by the instance's ``bulkhead`` (if any), waits for a worker in the
    instance's own FIFO queue (at most ``max_queue`` waiting, ``None``: unbounded), holds it
    for one draw of ``service_time``, then makes each of ``calls`` in order. ``deadline``:
    the deadline given to requests that arrive without one (an edge default). ``zones``:
    instances are spread over them in turn. ``do_not_retry_marker``: when its retries gave
    up, the service answers with brownout's do-not-retry marker (as brownout's edge does);
    ``False`` models a service that answers every failure with a plain, retryable 503.
    """

    name: str
    instances: int
    workers: int
    service_time: ServiceTime
    calls: tuple[Call, ...] = ()
    bulkhead: BulkheadFactory | None = None
    max_queue: int | None = None
    deadline: float | None = None
    zones: tuple[str, ...] = ("a",)
    do_not_retry_marker: bool = True


@dataclass(frozen=True)
class Arrivals:
    """Open-loop arrivals of one class of client requests at ``call.target``.

    ``rate`` per second from time 0, changed to each ``(at, rate)`` of ``steps`` in turn;
    ``spacing``: ``poisson`` (exponential gaps) or ``constant`` (evenly spaced, as the lab's
    load generator sends by default). Each request has ``deadline`` seconds (the client gives
    up then) and ``priority``; the client calls through ``call.dependency`` (one client: one
    budget for the whole class).
    """

    name: str
    rate: float
    call: Call
    deadline: float | None = None
    priority: Priority = Priority.CRITICAL
    steps: tuple[tuple[float, float], ...] = ()
    spacing: Literal["poisson", "constant"] = "poisson"


FaultKind = Literal["slowdown", "capacity_loss", "outage", "error_rate", "zone_loss"]
FAULT_KINDS: tuple[str, ...] = ("slowdown", "capacity_loss", "outage", "error_rate", "zone_loss")


@dataclass(frozen=True)
class Fault:
    """One fault from ``at`` until ``until`` (``None``: for good; then it recovers).

    - ``slowdown``: ``service``'s service times are multiplied by ``factor``;
    - ``capacity_loss``: a ``fraction`` of ``service``'s instances are down;
    - ``outage``: every instance of ``service`` is down;
    - ``error_rate``: a ``fraction`` of ``service``'s requests fail (503) after their work;
    - ``zone_loss``: every instance in ``zone`` is down (of ``service`` only, if given).

    A down instance refuses connections (a `TransientError`, never sent) until load
    balancers stop sending to it, ``detect`` seconds after it went down.
    """

    kind: FaultKind
    at: float
    until: float | None = None
    service: str | None = None
    zone: str | None = None
    factor: float = 1.0
    fraction: float = 1.0
    detect: float = 0.0


METRICS: tuple[str, ...] = (
    "offered",
    "admitted",
    "shed",
    "retried",
    "completed",
    "failed",
    "late",
    "wasted",
    "busy",
    "waited",
    "success_ratio",
    "mean_wait",
)
"""What an `Invariant` may bound: counts per second (``offered`` .. ``late``), worker-seconds
per second (``wasted``, ``busy``, ``waited``), ``success_ratio`` (completed / offered) or
``mean_wait`` (seconds waited for a worker per admitted request)."""


@dataclass(frozen=True)
class Invariant:
    """``metric`` of ``layer`` over ``[start, end)`` must be within ``[min, max]``."""

    layer: str
    metric: str
    min: float | None = None
    max: float | None = None
    start: float = 0.0
    end: float | None = None
    name: str = ""

    def describe(self) -> str:
        if self.name:
            return self.name
        bounds = " and ".join(
            b
            for b in (
                f">= {self.min:g}" if self.min is not None else "",
                f"<= {self.max:g}" if self.max is not None else "",
            )
            if b
        )
        end = "end" if self.end is None else f"{self.end:g}s"
        return f"{self.layer}.{self.metric} {bounds} over [{self.start:g}s, {end})"


@dataclass(frozen=True)
class System:
    """The whole model: run for ``duration`` virtual seconds, results in ``bucket``-second
    slices, every random draw from ``random.Random(seed)``."""

    services: tuple[Service, ...]
    arrivals: tuple[Arrivals, ...]
    duration: float
    faults: tuple[Fault, ...] = ()
    invariants: tuple[Invariant, ...] = ()
    bucket: float = 1.0
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


@dataclass(frozen=True)
class Problem:
    """One bad field: its path (``services.api.workers``) and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ModelError(ValueError):
    """A model that cannot run; ``problems`` names each bad field."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and 0.0 < value < math.inf


def _non_negative(value: float) -> bool:
    return isinstance(value, (int, float)) and 0.0 <= value < math.inf


def _count(value: int, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _distribution(where: str, st: object) -> Iterator[Problem]:
    if isinstance(st, Exponential):
        if not _positive(st.mean):
            yield Problem(f"{where}.mean", f"must be a positive number of seconds, not {st.mean!r}")
    elif isinstance(st, Constant):
        if not _non_negative(st.value):
            yield Problem(f"{where}.value", f"must be seconds >= 0, not {st.value!r}")
    elif isinstance(st, Uniform):
        if not (_non_negative(st.low) and _non_negative(st.high) and st.low <= st.high):
            yield Problem(where, f"needs 0 <= low <= high, not [{st.low!r}, {st.high!r}]")
    elif isinstance(st, LogNormal):
        if not _positive(st.mean):
            yield Problem(f"{where}.mean", f"must be a positive number of seconds, not {st.mean!r}")
        if not _non_negative(st.sigma):
            yield Problem(f"{where}.sigma", f"must be >= 0, not {st.sigma!r}")
    elif not (hasattr(st, "sample") and hasattr(st, "mean")):
        yield Problem(where, f"must be a service-time distribution, not {st!r}")


def _call(where: str, call: Call, names: set[str]) -> Iterator[Problem]:
    if call.target not in names:
        known = ", ".join(sorted(names)) or "none"
        yield Problem(f"{where}.target", f"no service named {call.target!r} (services: {known})")
    if not _count(call.fanout, 1):
        yield Problem(f"{where}.fanout", f"must be an integer >= 1, not {call.fanout!r}")
    if not _non_negative(call.latency):
        yield Problem(f"{where}.latency", f"must be seconds >= 0, not {call.latency!r}")


def _cycle(system: System) -> list[str] | None:
    graph = {s.name: [c.target for c in s.calls] for s in system.services}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and nxt in graph:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in graph:
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def validate(system: System) -> None:
    """Raise `ModelError` naming every bad field of ``system``; return when it can run."""
    problems: list[Problem] = []
    add = problems.extend
    names = [s.name for s in system.services]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            problems.append(Problem(f"services[{i}].name", f"{name!r} is used twice"))
        seen.add(name)
    if not system.services:
        problems.append(Problem("services", "at least one service is needed"))
    if not system.arrivals:
        problems.append(Problem("arrivals", "at least one class of arrivals is needed"))
    if not _positive(system.duration):
        problems.append(Problem("duration", f"must be positive seconds, not {system.duration!r}"))
    if not _positive(system.bucket):
        problems.append(Problem("bucket", f"must be positive seconds, not {system.bucket!r}"))
    if not isinstance(system.seed, int) or isinstance(system.seed, bool):
        problems.append(Problem("seed", f"must be an integer, not {system.seed!r}"))
    zones: set[str] = set()
    for s in system.services:
        w = f"services.{s.name}"
        if not _count(s.instances, 1):
            problems.append(
                Problem(f"{w}.instances", f"must be an integer >= 1, not {s.instances!r}")
            )
        if not _count(s.workers, 1):
            problems.append(Problem(f"{w}.workers", f"must be an integer >= 1, not {s.workers!r}"))
        if s.max_queue is not None and not _count(s.max_queue, 0):
            problems.append(
                Problem(f"{w}.max_queue", f"must be an integer >= 0, not {s.max_queue!r}")
            )
        if s.deadline is not None and not _positive(s.deadline):
            problems.append(
                Problem(f"{w}.deadline", f"must be positive seconds, not {s.deadline!r}")
            )
        if not s.zones or not all(isinstance(z, str) and z for z in s.zones):
            problems.append(Problem(f"{w}.zones", "must be a non-empty list of zone names"))
        zones.update(s.zones)
        add(_distribution(f"{w}.service_time", s.service_time))
        for j, call in enumerate(s.calls):
            add(_call(f"{w}.calls[{j}]", call, seen))
    cycle = _cycle(system)
    if cycle:
        problems.append(Problem("services", "calls form a cycle: " + " -> ".join(cycle)))
    layer_names = set(seen)
    for i, a in enumerate(system.arrivals):
        w = f"arrivals[{i}]"
        if a.name in layer_names:
            problems.append(Problem(f"{w}.name", f"{a.name!r} is already a service or class"))
        layer_names.add(a.name)
        if not _non_negative(a.rate):
            problems.append(
                Problem(f"{w}.rate", f"must be requests per second >= 0, not {a.rate!r}")
            )
        if a.deadline is not None and not _positive(a.deadline):
            problems.append(
                Problem(f"{w}.deadline", f"must be positive seconds, not {a.deadline!r}")
            )
        if a.spacing not in ("poisson", "constant"):
            problems.append(
                Problem(f"{w}.spacing", f"must be poisson or constant, not {a.spacing!r}")
            )
        if not isinstance(a.priority, Priority):
            problems.append(Problem(f"{w}.priority", f"must be a Priority, not {a.priority!r}"))
        for k, (at, rate) in enumerate(a.steps):
            if not (_non_negative(at) and _non_negative(rate)):
                problems.append(
                    Problem(f"{w}.steps[{k}]", f"needs at >= 0 and rate >= 0, not {(at, rate)!r}")
                )
        add(_call(f"{w}.call", a.call, seen))
    for i, f in enumerate(system.faults):
        w = f"faults[{i}]"
        if f.kind not in FAULT_KINDS:
            problems.append(
                Problem(f"{w}.kind", f"must be one of {', '.join(FAULT_KINDS)}, not {f.kind!r}")
            )
            continue
        if not _non_negative(f.at):
            problems.append(Problem(f"{w}.at", f"must be seconds >= 0, not {f.at!r}"))
        if f.until is not None and not (_non_negative(f.until) and f.until > f.at):
            problems.append(
                Problem(f"{w}.until", f"must come after at ({f.at!r}), not {f.until!r}")
            )
        if not _non_negative(f.detect):
            problems.append(Problem(f"{w}.detect", f"must be seconds >= 0, not {f.detect!r}"))
        if f.kind == "zone_loss":
            if f.zone not in zones:
                problems.append(
                    Problem(
                        f"{w}.zone",
                        f"no service has zone {f.zone!r} (zones: {', '.join(sorted(zones))})",
                    )
                )
            if f.service is not None and f.service not in seen:
                problems.append(Problem(f"{w}.service", f"no service named {f.service!r}"))
        elif f.service not in seen:
            problems.append(
                Problem(
                    f"{w}.service", f"a {f.kind} needs a service; no service named {f.service!r}"
                )
            )
        if f.kind == "slowdown" and not _positive(f.factor):
            problems.append(Problem(f"{w}.factor", f"must be a positive number, not {f.factor!r}"))
        if f.kind in ("capacity_loss", "error_rate") and not (
            isinstance(f.fraction, (int, float)) and 0.0 <= f.fraction <= 1.0
        ):
            problems.append(Problem(f"{w}.fraction", f"must be within [0, 1], not {f.fraction!r}"))
    for i, inv in enumerate(system.invariants):
        w = f"invariants[{i}]"
        if inv.layer not in layer_names:
            problems.append(
                Problem(f"{w}.layer", f"no service or arrival class named {inv.layer!r}")
            )
        if inv.metric not in METRICS:
            problems.append(
                Problem(f"{w}.metric", f"must be one of {', '.join(METRICS)}, not {inv.metric!r}")
            )
        if inv.min is None and inv.max is None:
            problems.append(Problem(w, "needs min, max or both"))
        if inv.end is not None and not inv.end > inv.start:
            problems.append(Problem(f"{w}.end", f"must come after start ({inv.start!r})"))
    if problems:
        raise ModelError(problems)


class Unbudgeted:
    """A retry allowance that allows every retry: a client with no retry budget (a
    `RetryPolicy`'s ``budget``), to model what brownout's budgets prevent."""

    __slots__ = ()

    def record_request(self) -> None:
        pass

    def record_success(self) -> None:
        pass

    def record_failure(self) -> None:
        pass

    def try_acquire_retry(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Unbudgeted()"
