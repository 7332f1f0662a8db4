"""Declared degraded modes: do less work per admitted request, in ways agreed before (G1, G2).

A `DegradedMode` is a declaration written before any incident: its name (shown to callers),
what it changes, how stale the data it serves may be, how it is entered and left (overload
levels, a signal predicate, or by hand), a minimum dwell so it does not flap, and an upper
bound on how long it may last. `DegradedModes` is the registry that tracks which modes are
active, emits a `DegradedModeChanged` event on every change, answers ``active(name)`` in O(1)
on the request path, and swaps in declared fallbacks.

Entering is fast and leaving is slow on purpose: a mode enters as soon as its trigger fires,
but it leaves only after the trigger has cleared (hysteresis: ``leave_at_level`` is below
``enter_at_level``) *and* the mode has been active for ``min_dwell`` seconds.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import logging
import math
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from .._clock import Clock, LoopClock, default_clock
from .._settings import Section, as_bool, build_in, from_config
from ..events import DegradedModeChanged, EventHub, hub
from .markers import in_fallback, note_fallback_served

__all__ = ["DEGRADED_HEADER", "DegradedMode", "DegradedModes", "LevelSource"]

_CLOCK = default_clock()

P = ParamSpec("P")
T = TypeVar("T")

DEGRADED_HEADER = "brownout-degraded"
"""Response header listing the active modes, e.g. ``brownout-degraded: recommendations``."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_log = logging.getLogger("brownout.degrade")


class LevelSource(Protocol):
    """What `DegradedModes.follow` needs: a current integer ``level`` and a change hook.

    The overload manager satisfies it; so does any object with these two members. The
    callback's arguments are ignored (the level is re-read), so any callback shape works.
    """

    @property
    def level(self) -> int: ...

    def subscribe(self, callback: Callable[..., Any]) -> Any: ...


@dataclass(frozen=True, slots=True)
class DegradedMode:
    """One degraded mode, declared before the incident (G2).

    - ``name``: shown to callers in the ``brownout-degraded`` header and problem bodies
      (a token: letters, digits, ``.``, ``_``, ``-``).
    - ``description``: what the mode changes, in words a caller or on-call engineer reads.
    - ``enter_at_level`` / ``leave_at_level``: enter when the followed overload level is at
      least ``enter_at_level``; leave when it is at most ``leave_at_level`` (default one
      below: the gap is the hysteresis).
    - ``enter_when`` / ``leave_when``: a cheap predicate on some signal, polled every
      ``poll_interval`` seconds; ``leave_when`` defaults to ``not enter_when()``.
    - ``min_dwell``: once entered, stay at least this long (no flapping).
    - ``max_duration``: the longest the mode may last; then it leaves (trigger
      ``max_duration``) and stays out until its trigger has cleared once.
    - ``max_staleness``: how old the data served in this mode may be, in seconds.
    """

    name: str
    description: str
    enter_at_level: int | None = None
    leave_at_level: int | None = None
    enter_when: Callable[[], bool] | None = None
    leave_when: Callable[[], bool] | None = None
    min_dwell: float = 0.0
    max_duration: float | None = None
    max_staleness: float | None = None
    poll_interval: float = 1.0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"mode name {self.name!r} must be a header-safe token")
        if not self.description.strip():
            raise ValueError(f"mode {self.name!r} needs a description of what it changes")
        if self.enter_at_level is None:
            if self.leave_at_level is not None:
                raise ValueError("leave_at_level needs enter_at_level")
        else:
            leave = self.leave_at_level
            if leave is None:
                object.__setattr__(self, "leave_at_level", self.enter_at_level - 1)
            elif leave >= self.enter_at_level:
                raise ValueError("leave_at_level must be below enter_at_level (hysteresis)")
        if self.leave_when is not None and self.enter_when is None:
            raise ValueError("leave_when needs enter_when")
        if self.min_dwell < 0 or math.isnan(self.min_dwell):
            raise ValueError("min_dwell must be >= 0")
        if self.max_duration is not None and not self.max_duration > self.min_dwell:
            raise ValueError("max_duration must be longer than min_dwell")
        if self.max_staleness is not None and not self.max_staleness >= 0:
            raise ValueError("max_staleness must be >= 0")
        if not self.poll_interval > 0:
            raise ValueError("poll_interval must be > 0")


class _State:
    """The live state of one declared mode."""

    __slots__ = (
        "active",
        "decl",
        "force_trigger",
        "force_until",
        "forced",
        "latched_out",
        "level_demand",
        "next_poll",
        "served",
        "signal_demand",
        "since",
    )

    def __init__(self, decl: DegradedMode) -> None:
        self.decl = decl
        self.active = False
        self.since = -math.inf
        self.level_demand = False
        self.signal_demand = False
        self.forced: bool | None = None
        self.force_trigger = "manual"
        self.force_until = math.inf
        self.latched_out = False
        self.next_poll = -math.inf if decl.enter_when is not None else math.inf
        self.served = 0


class DegradedModes:
    """The registry of declared modes: which are active, and the fallbacks they swap in.

    ``active(name)`` and ``active_names()`` are O(1) on the request path (they re-evaluate
    only when a dwell, a maximum duration or a predicate poll is due). ``active_names()`` is
    what the edge puts in the ``brownout-degraded`` header and the problem body's
    ``degraded`` field.
    """

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        modes: Iterable[DegradedMode],
        *,
        section: str = "degraded",
        **code: Any,
    ) -> DegradedModes:
        """The registry of ``modes`` (declared in code) with table ``section`` of ``config``
        applied: ``name``, and ``[degraded.force]``, declared mode name -> ``true`` (forced on,
        still ending after its ``max_duration``) or ``false`` (forced off). The clock and
        events are keyword arguments. Raises `ConfigError`."""

        def build(sec: Section) -> DegradedModes | None:
            registry = build_in(sec, cls, code, skip=("modes",), built={"modes": modes})
            force = sec.table("force")
            for mode in list(force.data):
                on = force.read(mode, as_bool, None)
                if registry is None or on is None:
                    continue
                if mode not in registry:
                    close = difflib.get_close_matches(mode, [m.name for m in registry], n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    force.problem(mode, f"no such declared mode{hint}")
                    continue
                registry.force(mode, on, trigger="settings")
            return registry

        return from_config(config, section, build)

    def __init__(
        self,
        modes: Iterable[DegradedMode],
        *,
        name: str = "degraded-modes",
        clock: Clock = _CLOCK,
        events: EventHub = hub,
    ) -> None:
        self.name = name
        self._clock = clock
        self._events = events
        self._states: dict[str, _State] = {}
        for mode in modes:
            if mode.name in self._states:
                raise ValueError(f"mode {mode.name!r} declared twice")
            self._states[mode.name] = _State(mode)
        self._active: tuple[str, ...] = ()
        self._due = math.inf
        self._level = 0
        self._level_trigger = "level 0"
        self._source: LevelSource | None = None
        self._unsubscribe: Callable[[], Any] | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at = math.inf
        # The thread that drives the modes (the event loop's). Exporters may read `gauges`
        # and `snapshot` from another (a Prometheus server thread): there they only read.
        self._owner = threading.get_ident()
        self._reschedule(self._clock.now())

    # -- declarations -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[DegradedMode]:
        return (s.decl for s in self._states.values())

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __len__(self) -> int:
        return len(self._states)

    def declared(self, name: str) -> DegradedMode:
        """The declaration of mode ``name`` (KeyError if it was never declared)."""
        return self._state(name).decl

    def _state(self, name: str) -> _State:
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"degraded mode {name!r} was not declared") from None

    # -- what the request path asks ---------------------------------------------------------
    def active(self, name: str) -> bool:
        """Is mode ``name`` active now? Cheap: call it on every request."""
        if self._due != math.inf and self._clock.now() >= self._due:
            self.evaluate()
        return self._state(name).active

    def active_names(self) -> tuple[str, ...]:
        """The active modes, in declaration order (the edge's header and problem field)."""
        if self._due != math.inf and self._clock.now() >= self._due:
            self.evaluate()
        return self._active

    def header_value(self) -> str:
        """The ``brownout-degraded`` header value (``""`` when no mode is active)."""
        return ", ".join(self.active_names())

    def problem_fields(self) -> dict[str, list[str]]:
        """The field to merge into an RFC 9457 problem body: ``{"degraded": [...]}``."""
        return {"degraded": list(self.active_names())}

    def since(self, name: str) -> float | None:
        """When mode ``name`` was last entered, if it is active."""
        state = self._state(name)
        return state.since if self.active(name) else None

    def fallbacks_served(self, name: str) -> int:
        """How many times mode ``name``'s fallback ran (drills check that it did)."""
        return self._state(name).served

    def forced(self, name: str) -> bool | None:
        """The manual override of mode ``name``: True (on), False (off) or None (automatic)."""
        return self._state(name).forced

    def gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Per mode: active (0/1), seconds active, and the declared maximum, for exporters.

        On the modes' own thread it evaluates what is due first; on another thread (a
        Prometheus server's) it only reads: evaluating switches modes and emits events, which
        is the loop's to do (its timer does it when due)."""
        if threading.get_ident() == self._owner:
            self.evaluate()
        now = self._clock.now()
        for name, s in self._states.items():
            labels = {"mode": name}
            yield ("degraded_mode_active", labels, 1.0 if s.active else 0.0)
            yield ("degraded_mode_active_seconds", labels, now - s.since if s.active else 0.0)
            if s.decl.max_duration is not None:
                yield ("degraded_mode_max_seconds", labels, s.decl.max_duration)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every mode's declaration and state (JSON-able), for reports, runbooks and debugging.
        Read-only from another thread, as `gauges` is."""
        if threading.get_ident() == self._owner:
            self.evaluate()
        return {
            n: {
                "active": s.active,
                "since": s.since if s.active else None,
                "forced": s.forced,
                "description": s.decl.description,
                "max_staleness": s.decl.max_staleness,
                "enter_at_level": s.decl.enter_at_level,
                "leave_at_level": s.decl.leave_at_level,
                "signal": s.decl.enter_when is not None,
                "min_dwell": s.decl.min_dwell,
                "max_duration": s.decl.max_duration,
                "fallbacks_served": s.served,
            }
            for n, s in self._states.items()
        }

    # -- triggers ---------------------------------------------------------------------------
    def follow(self, source: LevelSource) -> None:
        """Follow an overload manager's level (anything with ``.level`` and ``.subscribe``).

        Modes with ``enter_at_level`` enter and leave as the level moves. Following a new
        source replaces the previous one (whose callbacks are then ignored).
        """
        self._drop_source()
        self._source = source

        def on_change(*_args: Any, **_kwargs: Any) -> None:
            if self._source is source:
                self.set_level(source.level)

        handle = source.subscribe(on_change)
        # The overload manager returns an unsubscribe function; other sources may not.
        self._unsubscribe = handle if callable(handle) else None
        self.set_level(source.level)

    def unfollow(self) -> None:
        """Stop following the level source; level-driven modes see level 0 from now on."""
        self._drop_source()
        self.set_level(0)

    def _drop_source(self) -> None:
        self._source = None
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()

    def set_level(self, level: int) -> None:
        """Feed an overload level by hand (what `follow` does on every change)."""
        level = int(level)
        self._level = level
        self._level_trigger = f"level {level}"
        for state in self._states.values():
            decl = state.decl
            if decl.enter_at_level is None:
                continue
            if level >= decl.enter_at_level:
                state.level_demand = True
            elif decl.leave_at_level is not None and level <= decl.leave_at_level:
                state.level_demand = False
        self.evaluate()

    def force(
        self,
        name: str,
        on: bool | None,
        *,
        trigger: str = "manual",
        duration: float | None = None,
    ) -> None:
        """Override mode ``name`` by hand (drills, operators): on, off, or None to release.

        A forced state ignores dwell and triggers. A forced-on mode still ends after
        ``duration`` (default: the mode's ``max_duration``), so a forgotten drill cannot
        degrade the service forever.
        """
        state = self._state(name)
        state.forced = on
        state.force_trigger = trigger
        if on is None:
            state.force_until = math.inf
        else:
            limit = duration if duration is not None else state.decl.max_duration
            state.force_until = math.inf if limit is None else self._clock.now() + limit
        self._evaluate(state if on is None else None, trigger)

    def release(self, name: str) -> None:
        """Return mode ``name`` to automatic control (same as ``force(name, None)``)."""
        self.force(name, None)

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self) -> None:
        """Re-check predicates, dwell times and maximum durations now.

        Called by the request path when something is due, by `follow` on level changes, and
        by a loop timer; call it yourself to drive modes from your own scheduler.
        """
        self._evaluate(None, "")

    def _evaluate(self, released: _State | None, release_trigger: str) -> None:
        now = self._clock.now()
        changed = False
        for state in self._states.values():
            if now >= state.next_poll:
                self._poll(state, now)
            if state is released:
                changed |= self._after_release(state, now, release_trigger)
            else:
                changed |= self._settle(state, now)
        if changed:
            self._active = tuple(n for n, s in self._states.items() if s.active)
        self._reschedule(now)

    def _poll(self, state: _State, now: float) -> None:
        decl = state.decl
        state.next_poll = now + decl.poll_interval
        enter_when = decl.enter_when
        if enter_when is None:
            return
        try:
            if not state.signal_demand:
                state.signal_demand = bool(enter_when())
            elif decl.leave_when is not None:
                state.signal_demand = not decl.leave_when()
            else:
                state.signal_demand = bool(enter_when())
        except Exception:  # a broken predicate must not break requests; keep the last answer
            _log.exception("predicate of degraded mode %r raised", decl.name)

    def _settle(self, state: _State, now: float) -> bool:
        decl = state.decl
        demand = self._demand(state)
        if state.forced is not None:
            if now < state.force_until:
                if state.forced != state.active:
                    self._change(state, now, state.forced, state.force_trigger)
                    return True
                return False
            state.forced = None
            state.force_until = math.inf
            return self._after_release(state, now, "force_expired")
        if state.active:
            if decl.max_duration is not None and now - state.since >= decl.max_duration:
                state.latched_out = demand
                self._change(state, now, False, "max_duration")
                return True
            if not demand and now - state.since >= decl.min_dwell:
                self._change(state, now, False, self._why(state, False))
                return True
        elif demand and not state.latched_out:
            self._change(state, now, True, self._why(state, True))
            return True
        return False

    @staticmethod
    def _demand(state: _State) -> bool:
        """Whether a trigger asks for the mode now. When none does, the max_duration latch
        lets go, even during an override, so a mode released later is back under its
        trigger."""
        demand = state.level_demand or state.signal_demand
        if not demand:
            state.latched_out = False
        return demand

    def _after_release(self, state: _State, now: float, trigger: str) -> bool:
        # Back to automatic control. The dwell protects against flapping triggers, not
        # against a person: a released drill ends now unless a trigger still asks for it,
        # and a mode that reached max_duration stays out until its trigger clears once,
        # however often it was forced on since (a drill must not restart it silently).
        demand = self._demand(state)
        if state.active and (not demand or state.latched_out):
            self._change(state, now, False, trigger)
            return True
        return self._settle(state, now)

    def _why(self, state: _State, entering: bool) -> str:
        if entering:
            return self._level_trigger if state.level_demand else "signal"
        if state.decl.enter_at_level is not None and not state.level_demand:
            return self._level_trigger
        return "signal"

    def _change(self, state: _State, now: float, active: bool, trigger: str) -> None:
        state.active = active
        state.since = now
        if self._events.enabled:
            self._events.emit(
                DegradedModeChanged(
                    at=now, source=self.name, mode=state.decl.name, active=active, trigger=trigger
                )
            )

    def _reschedule(self, now: float) -> None:
        due = math.inf
        for s in self._states.values():
            due = min(due, s.next_poll)
            if s.forced is not None:
                due = min(due, s.force_until)
            elif s.active:
                if s.decl.max_duration is not None:
                    due = min(due, s.since + s.decl.max_duration)
                if not (s.level_demand or s.signal_demand):
                    due = min(due, s.since + s.decl.min_dwell)
        self._due = due
        # With the loop's clock, a timer makes changes happen (and be reported) on time even
        # when no request asks; other clocks rely on the lazy check and `evaluate`.
        # The instant is kept here, not read back with ``timer.when()``: uvloop's ``call_at``
        # returns a plain Handle (no ``when``) for an instant that is already due.
        timer = self._timer
        if timer is not None:
            if due != math.inf and self._timer_at == max(due, now):
                return  # already armed for that instant (the common case on level updates)
            timer.cancel()
            self._timer = None
        if due != math.inf and isinstance(self._clock, LoopClock):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._timer_at = max(due, now)
            # The loop holds the timer; it must not hold the registry: a discarded registry
            # would otherwise poll its predicates and announce changes for ever.
            self._timer = loop.call_at(self._timer_at, _fire, weakref.ref(self))

    def _on_timer(self) -> None:
        self._timer = None
        self.evaluate()

    # -- fallbacks --------------------------------------------------------------------------
    def fallback(
        self, name: str, fallback: Callable[P, Any]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorate a function so that, while mode ``name`` is active, ``fallback`` runs instead.

        Works for sync and async functions; an async function's fallback may be sync or
        async. The fallback runs marked as such, so a `drill` detects a fallback that calls
        the failed dependency (G3). The mode must be declared.
        """
        state = self._state(name)

        def decorate(fn: Callable[P, T]) -> Callable[P, T]:
            if inspect.iscoroutinefunction(fn):
                primary = cast(Callable[P, Awaitable[Any]], fn)  # once: subscripting is slow

                @functools.wraps(fn)
                async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                    if not self.active(name):
                        return await primary(*args, **kwargs)
                    state.served += 1
                    note_fallback_served(name)
                    token = in_fallback.set(name)
                    try:
                        result = fallback(*args, **kwargs)
                        if inspect.isawaitable(result):
                            result = await result
                        return result
                    finally:
                        in_fallback.reset(token)

                return cast(Callable[P, T], run_async)

            @functools.wraps(fn)
            def run_sync(*args: P.args, **kwargs: P.kwargs) -> T:
                if not self.active(name):
                    return fn(*args, **kwargs)
                state.served += 1
                note_fallback_served(name)
                token = in_fallback.set(name)
                try:
                    return cast(T, fallback(*args, **kwargs))
                finally:
                    in_fallback.reset(token)

            return run_sync

        return decorate

    async def run(self, interval: float = 1.0) -> None:
        """Re-evaluate every ``interval`` seconds until cancelled (for predicate modes when
        the request path is idle); the loop timer already covers dwell and max duration."""
        while True:
            self.evaluate()
            await asyncio.sleep(interval)

    def __repr__(self) -> str:
        return f"DegradedModes({list(self._states)!r}, active={self._active!r})"


def _fire(ref: weakref.ref[DegradedModes]) -> None:
    """A registry's loop timer, if the registry is still in use."""
    modes = ref()
    if modes is not None:
        modes._on_timer()
