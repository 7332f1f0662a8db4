"""Drills: force degraded modes on, mark dependencies as failed, and catch bad fallbacks (G3).

A fallback exists for when a dependency is down; a fallback that itself calls that
dependency fails exactly when it is needed. That mistake is invisible until an incident
unless it is exercised, so a drill makes it loud:

    with drill(modes, "recommendations", failed=["recs-service"]):
        ...  # exercise the service

Inside the drill the named modes are forced on, and every call to a failed dependency goes
through `dependency_call` (directly, via `depends_on`, or from a client adapter):

- from inside a fallback it raises `FallbackCalledFailedDependency` and is recorded, so the
  drill fails with `DrillFailed` at exit even if the application swallowed the error;
- anywhere else it raises ``outage(name)`` (default `DrillOutage`, a `ConnectionError`), which
  simulates the outage for the primary path.

Failed dependencies are process-wide (a drill must reach request tasks a server created), so
run one drill at a time per process; nesting is allowed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from .._errors import BrownoutError
from .markers import in_fallback, note_fallback_served
from .modes import DegradedModes

__all__ = [
    "Drill",
    "DrillFailed",
    "DrillOutage",
    "FallbackCalledFailedDependency",
    "dependency_call",
    "depends_on",
    "drill",
    "fallback_scope",
]

P = ParamSpec("P")
T = TypeVar("T")


class DrillFailed(AssertionError):
    """The drill found a mistake: a fallback called a failed dependency, or never ran."""


class DrillOutage(BrownoutError, ConnectionError):
    """The simulated outage of a dependency a drill marked as failed."""

    def __init__(self, dependency: str) -> None:
        super().__init__(f"drill: dependency {dependency!r} is marked failed")
        self.dependency = dependency


class FallbackCalledFailedDependency(BrownoutError):
    """A fallback called the dependency it is meant to replace (G3: a design mistake)."""

    def __init__(self, mode: str, dependency: str) -> None:
        super().__init__(
            f"the fallback of degraded mode {mode!r} called {dependency!r}, which is failed "
            "in this drill: a fallback must not depend on the failed service"
        )
        self.mode = mode
        self.dependency = dependency


_failed: dict[str, list[Drill]] = {}


def dependency_call(name: str) -> None:
    """Say that the running code is about to call dependency ``name``.

    Free when no drill is running (one dict truthiness check). Client adapters and
    `depends_on` call it; call it yourself before a hand-written client call.
    """
    if not _failed:
        return
    drills = _failed.get(name)
    if not drills:
        return
    mode = in_fallback.get()
    if mode is not None:
        error = FallbackCalledFailedDependency(mode, name)
        for d in drills:
            d.violations.append(error)
        raise error
    raise drills[-1].outage(name)


@contextlib.contextmanager
def fallback_scope(mode: str) -> Iterator[None]:
    """Mark the enclosed code as the fallback of ``mode``, so drills check it (G3).

    `DegradedModes.fallback` does this for you; use it for fallbacks wired elsewhere (a
    circuit breaker's fallback, an ``except`` branch that serves a default).
    """
    note_fallback_served(mode)
    token = in_fallback.set(mode)
    try:
        yield
    finally:
        in_fallback.reset(token)


def depends_on(name: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorate a client function (sync or async) that calls dependency ``name``."""

    def decorate(fn: Callable[P, T]) -> Callable[P, T]:
        if inspect.iscoroutinefunction(fn):
            call = cast(Callable[P, Awaitable[Any]], fn)  # once: subscripting is slow

            @functools.wraps(fn)
            async def call_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                dependency_call(name)
                return await call(*args, **kwargs)

            return cast(Callable[P, T], call_async)

        @functools.wraps(fn)
        def call_sync(*args: P.args, **kwargs: P.kwargs) -> T:
            dependency_call(name)
            return fn(*args, **kwargs)

        return call_sync

    return decorate


class Drill:
    """One drill: modes forced on, dependencies failed, mistakes collected. See `drill`."""

    def __init__(
        self,
        modes: DegradedModes | None,
        mode_names: Iterable[str],
        *,
        failed: Iterable[str],
        outage: Callable[[str], BaseException],
        require_fallback: bool,
    ) -> None:
        self.modes = modes
        self.mode_names = tuple(mode_names)
        self.failed = tuple(failed)
        self.outage = outage
        self.require_fallback = require_fallback
        self.violations: list[FallbackCalledFailedDependency] = []
        self.fallbacks_served: dict[str, int] = {}
        self._before: dict[str, tuple[bool | None, int]] = {}
        if self.mode_names and modes is None:
            raise ValueError("forcing modes needs the DegradedModes registry")
        if modes is not None:
            for name in self.mode_names:
                modes.declared(name)  # KeyError now, not halfway through the drill

    def __enter__(self) -> Drill:
        for dep in self.failed:
            _failed.setdefault(dep, []).append(self)
        if self.modes is not None:
            for name in self.mode_names:
                self._before[name] = (self.modes.forced(name), self.modes.fallbacks_served(name))
                self.modes.force(name, True, trigger="drill")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for dep in self.failed:
            drills = _failed.get(dep, [])
            if self in drills:
                drills.remove(self)
            if not drills:
                _failed.pop(dep, None)
        problems = list(dict.fromkeys(str(v) for v in self.violations))
        if self.modes is not None:
            for name, (forced, served) in self._before.items():
                self.fallbacks_served[name] = self.modes.fallbacks_served(name) - served
                self.modes.force(name, forced, trigger="drill")
                if self.require_fallback and self.fallbacks_served[name] == 0:
                    problems.append(f"the fallback of degraded mode {name!r} never ran")
        if problems:
            raise DrillFailed("; ".join(problems)) from exc

    async def __aenter__(self) -> Drill:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def drill(
    modes: DegradedModes | None = None,
    *mode_names: str,
    failed: Iterable[str] = (),
    outage: Callable[[str], BaseException] = DrillOutage,
    require_fallback: bool = False,
) -> Drill:
    """Exercise degraded modes (G3): force ``mode_names`` on and mark ``failed`` dependencies.

    Use as ``with`` or ``async with``. At exit the modes return to their previous control and
    `DrillFailed` is raised if any fallback called a failed dependency, or (with
    ``require_fallback``) if a forced mode's fallback never ran.
    """
    return Drill(
        modes,
        mode_names,
        failed=failed,
        outage=outage,
        require_fallback=require_fallback,
    )
