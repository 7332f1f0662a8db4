"""The testing kit behind `brownout.testing` and its pytest fixtures (virtual time, recorded
events, forced overload), framework-free so a production drill can use the same switches."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, deque
from collections.abc import Iterator
from types import TracebackType
from typing import Any, TypeVar

from ._admission.bulkhead import Bulkhead
from ._clock import ManualClock
from ._context import DeadlineScope, request
from ._deadline import Deadline
from ._degrade.modes import DegradedModes
from ._errors import Reason
from ._priority import Priority
from .events import Event, EventHub, RequestEvent, RequestShed
from .events import hub as default_hub

__all__ = ["EventRecorder", "Forcing", "VirtualTime", "forced_full", "forced_mode"]

E = TypeVar("E", bound=Event)


class VirtualTime:
    """A `ManualClock` and deadlines on it: "with 200 ms left" without sleeping.

    ``with vt.deadline(0.2, operation="/search"):`` sets the request context (as the sync
    form of `brownout.request`) with a deadline 200 ms ahead on ``vt.clock``; ``vt.advance``
    moves it. Give the same clock to the parts under test (``Bulkhead(..., clock=vt.clock)``).
    """

    __slots__ = ("clock",)

    def __init__(self, start: float = 0.0) -> None:
        self.clock = ManualClock(start)

    def now(self) -> float:
        return self.clock.now()

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (never backwards: `ValueError`)."""
        self.clock.advance(seconds)

    def deadline_after(self, seconds: float) -> Deadline:
        """A `brownout.Deadline` ``seconds`` from now on this clock."""
        return Deadline.after(seconds, clock=self.clock)

    def deadline(
        self,
        seconds: float,
        *,
        priority: Priority | None = None,
        caller: str | None = None,
        operation: str | None = None,
    ) -> DeadlineScope:
        """A request scope whose deadline is ``seconds`` ahead on this clock. Use ``with``:
        ``async with`` would also arm a real-time timer for the remaining time."""
        return request(
            deadline=self.deadline_after(seconds),
            priority=priority,
            caller=caller,
            operation=operation,
        )

    def __repr__(self) -> str:
        return f"VirtualTime(now={self.clock.now()!r})"


def _describe(e: Event) -> str:
    if isinstance(e, RequestShed):
        left = "none" if e.remaining is None else f"{e.remaining * 1000:.0f} ms"
        return (
            f"RequestShed(source={e.source!r}, operation={e.operation!r}, "
            f"priority={e.priority.name}, caller={e.caller!r}, reason={e.reason.name}, "
            f"remaining={left})"
        )
    return type(e).__name__


class EventRecorder:
    """A sink that keeps every event of a hub, with assertions on what was shed and why.

    ``start()`` subscribes (default: `brownout.events.hub`), ``stop()`` unsubscribes; or use it
    as a context manager. It does not accept tallies, so while it listens every request is
    reported one event each (as with any sink that wants them). Keeps at most ``max_events``
    (the newest); ``dropped`` counts the rest. Thread-safe: servers in other threads may emit.
    """

    accepts_tallies = False

    def __init__(self, hub: EventHub | None = None, *, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        self.hub = hub if hub is not None else default_hub
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._listening = False
        self.dropped = 0

    # -- the sink ---------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)

    def start(self) -> EventRecorder:
        if not self._listening:
            self.hub.subscribe(self)
            self._listening = True
        return self

    def stop(self) -> None:
        if self._listening:
            self.hub.unsubscribe(self)
            self._listening = False

    def __enter__(self) -> EventRecorder:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self.dropped = 0

    # -- reading ----------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Every event kept, oldest first."""
        with self._lock:
            return list(self._events)

    def of(self, kind: type[E]) -> list[E]:
        """The events of one type (subclasses included)."""
        return [e for e in self.events if isinstance(e, kind)]

    def shed(
        self,
        *,
        reason: Reason | None = None,
        operation: str | None = None,
        priority: Priority | None = None,
        caller: str | None = None,
        source: str | None = None,
    ) -> list[RequestShed]:
        """The `RequestShed` events matching every filter given."""
        return [
            e
            for e in self.of(RequestShed)
            if (reason is None or e.reason is reason)
            and (operation is None or e.operation == operation)
            and (priority is None or e.priority == priority)
            and (caller is None or e.caller == caller)
            and (source is None or e.source == source)
        ]

    def shed_counts(self) -> Counter[Reason]:
        """How many requests were shed, per reason."""
        return Counter(e.reason for e in self.of(RequestShed))

    def assert_shed(
        self,
        *,
        reason: Reason | None = None,
        operation: str | None = None,
        priority: Priority | None = None,
        caller: str | None = None,
        source: str | None = None,
        count: int | None = None,
    ) -> list[RequestShed]:
        """At least one matching shed (exactly ``count`` if given); the matches. The failure
        message lists what was seen."""
        found = self.shed(
            reason=reason, operation=operation, priority=priority, caller=caller, source=source
        )
        if (not found and count is None) or (count is not None and len(found) != count):
            want = _filters(reason, operation, priority, caller, source)
            times = "at least one" if count is None else f"exactly {count}"
            raise AssertionError(
                f"expected {times} shed with {want}, found {len(found)}\n{self.report()}"
            )
        return found

    def assert_not_shed(
        self,
        *,
        reason: Reason | None = None,
        operation: str | None = None,
        priority: Priority | None = None,
        caller: str | None = None,
        source: str | None = None,
    ) -> None:
        """No matching shed (no shed at all without filters). The failure lists what was."""
        found = self.shed(
            reason=reason, operation=operation, priority=priority, caller=caller, source=source
        )
        if found:
            want = _filters(reason, operation, priority, caller, source)
            raise AssertionError(
                f"expected no shed with {want}, found {len(found)}\n{self.report()}"
            )

    def report(self) -> str:
        """What was recorded, for failure messages: every shed, and a count of the rest."""
        events = self.events
        sheds = [e for e in events if isinstance(e, RequestShed)]
        lines = [f"recorded {len(events)} events ({len(sheds)} sheds):"]
        lines += [f"  - {_describe(e)}" for e in sheds[:50]]
        if len(sheds) > 50:
            lines.append(f"  ... and {len(sheds) - 50} more sheds")
        others = Counter(type(e).__name__ for e in events if not isinstance(e, RequestShed))
        if others:
            lines.append(
                "  other events: " + ", ".join(f"{k} x{n}" for k, n in sorted(others.items()))
            )
        operations = sorted({e.operation for e in events if isinstance(e, RequestEvent)})
        if operations:
            lines.append("  operations seen: " + ", ".join(repr(o) for o in operations[:20]))
        if self.dropped:
            lines.append(f"  ({self.dropped} older events were dropped: max_events)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<EventRecorder {len(self._events)} events>"


def _filters(*values: Any) -> str:
    names = ("reason", "operation", "priority", "caller", "source")
    given = [
        f"{n}={v.name if isinstance(v, (Reason, Priority)) else repr(v)}"
        for n, v in zip(names, values, strict=True)
        if v is not None
    ]
    return ", ".join(given) or "any reason"


@contextlib.contextmanager
def forced_full(bulkhead: Bulkhead, reason: Reason = Reason.QUEUE_FULL) -> Iterator[Bulkhead]:
    """Hold ``bulkhead`` full for the block (`Bulkhead.force_full`), then restore its switch."""
    before = bulkhead.forced_full
    bulkhead.force_full(True, reason=reason)
    try:
        yield bulkhead
    finally:
        if before is None:
            bulkhead.force_full(False)
        else:
            bulkhead.force_full(True, reason=before)


@contextlib.contextmanager
def forced_mode(
    modes: DegradedModes, *names: str, on: bool = True, trigger: str = "forced"
) -> Iterator[DegradedModes]:
    """Force degraded modes ``names`` on (or off) for the block, then restore their control."""
    before = {name: modes.forced(name) for name in names}  # unknown name: KeyError first
    try:
        for name in names:
            modes.force(name, on, trigger=trigger)
        yield modes
    finally:
        for name, forced in before.items():
            modes.force(name, forced, trigger=trigger)


class Forcing:
    """Forced overload that ends with the test: `full` and `mode` last until `restore`."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def full(self, bulkhead: Bulkhead, reason: Reason = Reason.QUEUE_FULL) -> Bulkhead:
        """Hold ``bulkhead`` full (`forced_full`) until `restore`."""
        return self._stack.enter_context(forced_full(bulkhead, reason))

    def mode(
        self, modes: DegradedModes, *names: str, on: bool = True, trigger: str = "forced"
    ) -> DegradedModes:
        """Force degraded modes (`forced_mode`) until `restore`."""
        return self._stack.enter_context(forced_mode(modes, *names, on=on, trigger=trigger))

    def restore(self) -> None:
        """Undo every forcing, newest first."""
        self._stack.close()
