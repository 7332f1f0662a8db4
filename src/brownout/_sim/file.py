"""The model as a TOML file: `load` reads it into the same dataclasses as the Python API.

Policies are written as a service configures them: a table of the object's own keyword
arguments (``breaker = { failure_rate = 0.5, window = 20 }`` is
``CircuitBreaker(failure_rate=0.5, window=20)``). Every object is built once while loading,
so a bad value is reported with the field it came from, before anything runs.
"""

from __future__ import annotations

import inspect
import math
import random
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._admission.bulkhead import Bulkhead
from .._admission.settings import LIMITS, QUEUES
from .._dependency import Dependency
from .._priority import Priority
from .._retry.backoff import ExponentialBackoff
from .._retry.breaker import CircuitBreaker
from .._retry.budget import RetryBudget
from .._retry.policy import RetryPolicy
from .._retry.throttle import ClientThrottle
from .model import (
    Arrivals,
    Build,
    Call,
    Constant,
    Exponential,
    Fault,
    Invariant,
    LogNormal,
    ModelError,
    Problem,
    Service,
    ServiceTime,
    System,
    Unbudgeted,
    Uniform,
    validate,
)

__all__ = ["load", "loads"]

_DISTRIBUTIONS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "exponential": (Exponential, ("mean",)),
    "constant": (Constant, ("value",)),
    "uniform": (Uniform, ("low", "high")),
    "lognormal": (LogNormal, ("mean", "sigma")),
}


class _Table:
    """A TOML table being read: each key taken once, leftovers reported as unknown."""

    def __init__(self, data: Any, path: str, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        if not isinstance(data, Mapping):
            problems.append(Problem(path, f"must be a table, not {type(data).__name__}"))
            data = {}
        self.data = dict(data)
        self.taken: set[str] = set()

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def bad(self, key: str, message: str) -> None:
        self.problems.append(Problem(self.where(key), message))

    def raw(self, key: str) -> Any:
        self.taken.add(key)
        return self.data.get(key)

    def number(self, key: str, default: float | None = None, *, required: bool = False) -> Any:
        value = self.raw(key)
        if value is None:
            if required:
                self.bad(key, "is required (a number)")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.bad(key, f"must be a number, not {value!r}")
            return default
        return value

    def integer(self, key: str, default: int | None = None, *, required: bool = False) -> Any:
        value = self.raw(key)
        if value is None:
            if required:
                self.bad(key, "is required (an integer)")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(key, f"must be an integer, not {value!r}")
            return default
        return value

    def text(self, key: str, default: str | None = None, *, required: bool = False) -> Any:
        value = self.raw(key)
        if value is None:
            if required:
                self.bad(key, "is required (a string)")
            return default
        if not isinstance(value, str):
            self.bad(key, f"must be a string, not {value!r}")
            return default
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.bad(key, f"must be true or false, not {value!r}")
            return default
        return value

    def table(self, key: str) -> _Table | None:
        value = self.raw(key)
        return None if value is None else _Table(value, self.where(key), self.problems)

    def tables(self, key: str) -> list[_Table]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list):
            self.bad(key, "must be an array of tables ([[...]])")
            return []
        return [_Table(v, f"{self.where(key)}[{i}]", self.problems) for i, v in enumerate(value)]

    def rest(self) -> dict[str, Any]:
        """The keys not taken: keyword arguments for a constructor."""
        return {k: v for k, v in self.data.items() if k not in self.taken}

    def done(self) -> None:
        for key in self.data:
            if key not in self.taken:
                self.bad(key, "is not a known field")


def _kwargs_call(
    cls: Callable[..., Any], kwargs: dict[str, Any], rng: random.Random, **fixed: Any
) -> Any:
    params = inspect.signature(cls).parameters
    if "rng" in params:
        fixed["rng"] = rng
    return cls(**fixed, **kwargs)


def _service_time(t: _Table) -> ServiceTime | None:
    kind = t.text("kind", required=True)
    if kind is None:
        return None
    if kind not in _DISTRIBUTIONS:
        t.bad("kind", f"must be one of {', '.join(_DISTRIBUTIONS)}, not {kind!r}")
        return None
    cls, fields = _DISTRIBUTIONS[kind]
    values = [t.number(f, required=True) for f in fields]
    t.done()
    if any(v is None for v in values):
        return None
    built: ServiceTime = cls(*values)
    return built


def _limit(value: Any, where: str, problems: list[Problem]) -> Callable[[random.Random], Any]:
    if isinstance(value, int) and not isinstance(value, bool):
        fixed = LIMITS["fixed"]
        return lambda rng: fixed(value)
    t = _Table(value, where, problems)
    kind = t.text("kind", required=True)
    if kind not in LIMITS:
        t.bad("kind", f"must be one of {', '.join(LIMITS)}, not {kind!r}")
        return lambda rng: LIMITS["fixed"](1)
    cls = LIMITS[kind]
    kwargs = t.rest()
    return lambda rng: _kwargs_call(cls, kwargs, rng)


def _queue(value: Any, where: str, problems: list[Problem]) -> Callable[[], Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = {"kind": value}
    t = _Table(value, where, problems)
    kind = t.text("kind", required=True)
    if kind not in QUEUES:
        t.bad("kind", f"must be one of {', '.join(QUEUES)}, not {kind!r}")
        return None
    cls = QUEUES[kind]
    kwargs = t.rest()
    return lambda: cls(**kwargs)


def _bulkhead(t: _Table) -> Callable[[Build], Bulkhead]:
    limit_value = t.raw("limit")
    if limit_value is None:
        t.bad("limit", "is required (an integer, or a table with kind)")
        limit_value = 1
    limit = _limit(limit_value, t.where("limit"), t.problems)
    queue = _queue(t.raw("queue"), t.where("queue"), t.problems)
    kwargs = t.rest()

    def make(b: Build) -> Bulkhead:
        # A virtual loop never lags: no loop-lag probe to run.
        return Bulkhead(
            b.name,
            limit(b.rng),
            None if queue is None else queue(),
            loop_lag=None,
            **kwargs,
        )

    return make


def _retry(t: _Table | None) -> Callable[[Build], RetryPolicy]:
    if t is None:
        return lambda b: RetryPolicy(1, name=b.name)
    attempts = t.integer("attempts", 1)
    budget = t.raw("budget")
    if budget is None:
        budget = 0.1
    if budget is not False and (isinstance(budget, bool) or not isinstance(budget, (int, float))):
        t.bad("budget", f"must be a ratio of retries to requests, or false, not {budget!r}")
        budget = 0.1
    min_per_second = t.number("min_per_second", 10.0)
    window = t.number("window", 10.0)
    backoff = t.table("backoff")
    backoff_kwargs: dict[str, Any] = {}
    if backoff is not None:
        backoff_kwargs = backoff.rest()
    kwargs = t.rest()

    def make(b: Build) -> RetryPolicy:
        allowance = (
            Unbudgeted()
            if budget is False
            else RetryBudget(float(budget), min_per_second=min_per_second, window=window)
        )
        return RetryPolicy(
            attempts,
            budget=allowance,
            backoff=ExponentialBackoff(rng=b.rng, **backoff_kwargs),
            name=b.name,
            **kwargs,
        )

    return make


def _call(t: _Table) -> Call | None:
    target = t.text("target", required=True)
    fanout = t.integer("fanout", 1)
    propagate = t.flag("propagate_deadline", True)
    latency = t.number("latency", 0.0)
    idempotent = t.flag("idempotent", True)
    retry = _retry(t.table("retry"))
    breaker = t.table("breaker")
    throttle = t.table("throttle")
    bulkhead = t.table("bulkhead")
    breaker_kwargs = None if breaker is None else breaker.rest()
    throttle_kwargs = None if throttle is None else throttle.rest()
    make_bulkhead = None if bulkhead is None else _bulkhead(bulkhead)
    kwargs = t.rest()  # Dependency's own: timeout, reserve, min_useful, max_active, ...

    def make(b: Build) -> Dependency:
        return Dependency(
            b.name,
            retry=retry(b),
            breaker=None
            if breaker_kwargs is None
            else _kwargs_call(CircuitBreaker, breaker_kwargs, b.rng, name=b.name),
            throttle=None
            if throttle_kwargs is None
            else _kwargs_call(ClientThrottle, throttle_kwargs, b.rng, name=b.name),
            bulkhead=None if make_bulkhead is None else make_bulkhead(b),
            **kwargs,
        )

    _try_build(make, t.path, t.problems)
    if target is None:
        return None
    return Call(
        target,
        fanout=fanout,
        dependency=make,
        propagate_deadline=propagate,
        latency=latency,
        idempotent=idempotent,
    )


def _try_build(make: Callable[[Build], Any], where: str, problems: list[Problem]) -> None:
    """Build once now, so a bad keyword or value is reported with its field."""
    try:
        make(Build("check", random.Random(0), "check", 0))
    except (TypeError, ValueError) as e:
        problems.append(Problem(where, f"{type(e).__name__}: {e}"))


def _priority(t: _Table) -> Priority:
    name = t.text("priority", "critical")
    try:
        return Priority[str(name).upper().replace("-", "_")]
    except KeyError:
        names = ", ".join(p.name.lower() for p in Priority)
        t.bad("priority", f"must be one of {names}, not {name!r}")
        return Priority.CRITICAL


def _steps(t: _Table) -> tuple[tuple[float, float], ...]:
    value = t.raw("steps")
    if value is None:
        return ()
    out = []
    ok = isinstance(value, list)
    for i, step in enumerate(value if ok else []):
        if (
            isinstance(step, list)
            and len(step) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in step)
        ):
            out.append((float(step[0]), float(step[1])))
        else:
            t.bad(f"steps[{i}]", f"must be [at, rate], not {step!r}")
    if not ok:
        t.bad("steps", "must be a list of [at, rate] pairs")
    return tuple(out)


def loads(text: str, *, source: str = "<string>") -> System:
    """The `System` described by TOML ``text``; `ModelError` names every bad field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ModelError([Problem(source, f"is not valid TOML: {e}")]) from e
    problems: list[Problem] = []
    root = _Table(data, "", problems)
    sim = root.table("simulation") or _Table({}, "simulation", problems)
    duration = sim.number("duration", required=True)
    bucket = sim.number("bucket", 1.0)
    seed = sim.integer("seed", 0)
    metadata = {k: sim.raw(k) for k in ("name", "description") if k in sim.data}
    sim.done()
    services: list[Service] = []
    table = root.table("services")
    for name, value in table.data.items() if table is not None else []:
        if table is not None:
            table.taken.add(name)
        s = _Table(value, f"services.{name}", problems)
        instances = s.integer("instances", 1)
        workers = s.integer("workers", required=True)
        st_table = s.table("service_time")
        if st_table is None:
            s.bad("service_time", "is required (a table with kind)")
            service_time: ServiceTime | None = None
        else:
            service_time = _service_time(st_table)
        zones_value = s.raw("zones")
        zones: tuple[str, ...] = ("a",)
        if zones_value is not None:
            if isinstance(zones_value, list) and all(isinstance(z, str) for z in zones_value):
                zones = tuple(zones_value)
            else:
                s.bad("zones", f"must be a list of zone names, not {zones_value!r}")
        max_queue = s.integer("max_queue")
        deadline = s.number("deadline")
        marker = s.flag("do_not_retry_marker", True)
        bulkhead_table = s.table("bulkhead")
        bulkhead = None
        if bulkhead_table is not None:
            bulkhead = _bulkhead(bulkhead_table)
            _try_build(bulkhead, bulkhead_table.path, problems)
        calls = [c for c in (_call(t) for t in s.tables("calls")) if c is not None]
        s.done()
        services.append(
            Service(
                name,
                instances,
                workers if workers is not None else 1,
                service_time if service_time is not None else Constant(0.0),
                calls=tuple(calls),
                bulkhead=bulkhead,
                max_queue=max_queue,
                deadline=deadline,
                zones=zones,
                do_not_retry_marker=marker,
            )
        )
    arrivals: list[Arrivals] = []
    for a in root.tables("arrivals"):
        name = a.text("name", required=True)
        rate = a.number("rate", required=True)
        deadline = a.number("deadline")
        priority = _priority(a)
        steps = _steps(a)
        spacing = a.text("spacing", "poisson")
        call_table = a.table("call")
        if call_table is None:
            a.bad("call", "is required (a table with target)")
            call = None
        else:
            call = _call(call_table)
        a.done()
        if name is not None and rate is not None and call is not None:
            arrivals.append(Arrivals(name, rate, call, deadline, priority, steps, spacing))
    faults: list[Fault] = []
    for f in root.tables("faults"):
        kind = f.text("kind", required=True)
        at = f.number("at", required=True)
        fault = Fault(
            kind,
            at if at is not None else 0.0,
            until=f.number("until"),
            service=f.text("service"),
            zone=f.text("zone"),
            factor=f.number("factor", 1.0),
            fraction=f.number("fraction", 1.0),
            detect=f.number("detect", 0.0),
        )
        f.done()
        if kind is not None:
            faults.append(fault)
    invariants: list[Invariant] = []
    for v in root.tables("invariants"):
        layer = v.text("layer", required=True)
        metric = v.text("metric", required=True)
        inv = Invariant(
            layer or "",
            metric or "",
            min=v.number("min"),
            max=v.number("max"),
            start=v.number("start", 0.0),
            end=v.number("end"),
            name=v.text("name", ""),
        )
        v.done()
        invariants.append(inv)
    root.done()
    if problems:
        raise ModelError(problems)
    system = System(
        tuple(services),
        tuple(arrivals),
        duration if duration is not None else math.nan,
        faults=tuple(faults),
        invariants=tuple(invariants),
        bucket=bucket,
        seed=seed,
        metadata=metadata,
    )
    validate(system)
    return system


def load(path: str | Path) -> System:
    """The `System` described by the TOML file at ``path`` (see `loads`)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelError([Problem(str(p), f"cannot be read: {e.strerror}")]) from e
    return loads(text, source=str(p))
