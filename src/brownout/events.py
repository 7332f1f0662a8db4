"""Typed, immutable events: every decision brownout makes is one of these (O1).

Events are read-only by contract, checked statically (see `_event`): building them is on the
request path, so they carry no runtime frozen guard.

Primitives emit events to an `EventHub`; sinks (the in-memory `Stats`, Prometheus,
OpenTelemetry, shed logs) subscribe to it. No primitive imports an exporter. When nothing is
subscribed, primitives skip building the event at all (``hub.enabled`` is false), so the hot
path pays one attribute check.

Field conventions: ``at`` is the monotonic time of the decision (the loop's clock);
``source`` names the component that decided (a bulkhead, dependency or edge name); durations
are seconds; ``remaining`` is the time left on the request's deadline (``None``: no deadline).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Protocol, TypeVar, dataclass_transform, runtime_checkable

from ._errors import Reason
from ._priority import Priority

__all__ = [
    "AttemptRetried",
    "BreakerStateChanged",
    "DeadlineHeaderIgnored",
    "DegradedModeChanged",
    "Event",
    "EventHub",
    "GuardFailedClosed",
    "HandlerOverran",
    "IdempotencyDecided",
    "LedgerWriteFailed",
    "LimitChanged",
    "MessageCompleted",
    "MessageParked",
    "MessagePublished",
    "MessageRefused",
    "MessageRetried",
    "MessageStarted",
    "OutcomeUnknown",
    "OverloadLevelChanged",
    "QuotaBackendChanged",
    "RequestAbandoned",
    "RequestAdmitted",
    "RequestCompleted",
    "RequestEvent",
    "RequestExpired",
    "RequestFailed",
    "RequestOffered",
    "RequestQueued",
    "RequestShed",
    "RequestsTallied",
    "RetryBudgetExhausted",
    "Sink",
    "StaleServed",
    "StatementCancelled",
    "hub",
]

_log = logging.getLogger("brownout.events")

_E = TypeVar("_E")


@dataclass_transform(frozen_default=True)
def _event(cls: type[_E]) -> type[_E]:
    """Declare an event: immutable to the type checker, a plain slotted dataclass at runtime.

    Events are built on the request path, several per request. A runtime-frozen dataclass sets
    every field through ``object.__setattr__`` and is several times slower to build, which
    shows in a bulkhead's cost per request. So immutability is enforced where it costs nothing:
    mypy (strict, in CI) rejects any assignment to an event field, because
    ``dataclass_transform(frozen_default=True)`` declares these classes frozen. Sinks must
    treat events as read-only; they are shared by every sink on a hub.
    """
    return dataclass(slots=True, unsafe_hash=True)(cls)


@_event
class Event:
    """Base of every event: when it happened, and which component decided."""

    at: float
    source: str


@_event
class RequestEvent(Event):
    """An event about one unit of work: who asked, for what, and how much it matters."""

    operation: str
    priority: Priority
    caller: str


@_event
class RequestOffered(RequestEvent):
    """Work arrived and asked to be admitted."""

    remaining: float | None


@_event
class RequestQueued(RequestEvent):
    """Work had to wait; ``depth`` is the queue length after it joined."""

    depth: int


@_event
class RequestAdmitted(RequestEvent):
    """Work got a permit; ``queue_wait`` is how long it waited for it (0 if it did not)."""

    queue_wait: float


@_event
class RequestShed(RequestEvent):
    """Work refused, with the reason.

    ``false_positive`` is true when the refusal happened while capacity existed (in-flight
    below the limit and nothing queued); S8 says this must stay at zero. ``retry`` is true
    when the refused work was a retry (attempt > 1), which yields to first attempts (I3).
    """

    reason: Reason
    remaining: float | None
    queue_wait: float
    false_positive: bool = False
    retry: bool = False


@_event
class RequestExpired(RequestEvent):
    """Work whose deadline passed: dropped at the queue head (``stage="queue"``) or cancelled
    while running (``stage="running"``). Never run late."""

    stage: str
    queue_wait: float


@_event
class RequestCompleted(RequestEvent):
    """Work finished. ``useful`` is true when it finished within its deadline (goodput)."""

    latency: float
    useful: bool


@_event
class RequestFailed(RequestEvent):
    """Work admitted and run, but it failed; ``error`` is the exception type name."""

    latency: float
    error: str


@_event
class RequestAbandoned(RequestEvent):
    """The caller went away (client disconnect) before the answer; not a success."""

    latency: float


@_event
class HandlerOverran(RequestEvent):
    """A handler was still running when its deadline passed and did not stop when cancelled
    (on a loop), or returned after it (on a thread, which is never cancelled): the edge
    answered for it with 504 (at the deadline on a loop, when it returned on a thread),
    discarded its late answer and kept its slot until it returned, ``overrun`` seconds after
    the deadline."""

    overrun: float


@_event
class AttemptRetried(RequestEvent):
    """An outbound call is being retried: ``attempt`` is the number of the next attempt."""

    attempt: int
    cause: str
    backoff: float


@_event
class RetryBudgetExhausted(RequestEvent):
    """A retry was wanted but the budget had no tokens; the original error was returned."""

    attempt: int


@_event
class OutcomeUnknown(RequestEvent):
    """A mutation was sent but its result is unknown; reconcile by ``idempotency_key`` (D6)."""

    idempotency_key: str | None


@_event
class StatementCancelled(RequestEvent):
    """A database statement was stopped before it answered and a cancel request sent to the
    server (D5): ``stage`` is ``timeout`` (it ran out the budget it was given), ``deadline``
    (the request's deadline cancelled it) or ``cancelled`` (its caller went away);
    ``budget`` is the time it was given (``None``: none), ``latency`` how long it ran."""

    stage: str
    budget: float | None
    latency: float


@_event
class LedgerWriteFailed(Event):
    """A `Dependency` (``source``) could not record an unknown outcome in its ledger (D6):
    ``ledger`` names the ledger, ``key`` is the idempotency key (never a metric label: one per
    call), ``error`` the failure's type name (``TimeoutError``, ``ConnectionError``,
    ``ResponseError``, ``OutcomeLedgerFull``). The caller's `UnknownOutcome` has
    ``recorded=False``: the ledger does not hold the key, the caller must keep it."""

    ledger: str
    key: str
    error: str


@_event
class MessagePublished(RequestEvent):
    """A producer enqueued a message on durable queue ``source``; ``valid_for`` is the time
    its result stays useful (``None``: no deadline of its own)."""

    valid_for: float | None


@_event
class MessageRefused(RequestEvent):
    """A producer was refused: queue ``source`` is over its bound (``backlog_full``)."""

    reason: Reason
    detail: str


@_event
class MessageStarted(RequestEvent):
    """A consumer started a message's handler: ``attempt`` (broker redeliveries included),
    ``age`` since its first enqueue (wall clock), ``remaining`` time it may run."""

    attempt: int
    age: float
    remaining: float | None


@_event
class MessageCompleted(RequestEvent):
    """A message's handler finished within its time: queue goodput. ``latency`` is the
    handler's run time, ``age`` the time since its first enqueue."""

    attempt: int
    latency: float
    age: float


@_event
class MessageRetried(RequestEvent):
    """A message was enqueued again to run after ``delay`` seconds as attempt ``attempt``:
    its handler failed transiently (``cause``), or the consumer was busy (``deferred``)."""

    attempt: int
    delay: float
    cause: str
    budget_exhausted: bool
    deferred: bool


@_event
class MessageParked(RequestEvent):
    """A message was moved to the parked queue and will not run: ``reason`` is a
    `brownout.durable.ParkReason` value."""

    reason: str
    detail: str
    attempt: int


@_event
class BreakerStateChanged(Event):
    """A circuit breaker moved between ``closed``, ``open`` and ``half_open``."""

    old: str
    new: str


@_event
class LimitChanged(Event):
    """A concurrency limit changed (adaptive limits)."""

    old: int
    new: int


@_event
class OverloadLevelChanged(Event):
    """The overload manager changed level; ``signals`` names what drove it."""

    old: int
    new: int
    signals: tuple[str, ...]


@_event
class DegradedModeChanged(Event):
    """A declared degraded mode was entered (``active``) or left; ``trigger`` says why."""

    mode: str
    active: bool
    trigger: str


@_event
class QuotaBackendChanged(Event):
    """A shared quota store became unreachable (``fallback`` active) or came back."""

    fallback: bool
    detail: str


@_event
class IdempotencyDecided(Event):
    """The idempotency layer decided a request with a key (or one that needed a key).

    ``outcome``: ``executed`` (the handler ran holding the key), ``replayed``,
    ``in_progress`` (409), ``mismatch`` (422), ``missing`` or ``invalid`` (400),
    ``too_large`` (413), ``unavailable_closed`` (503) or ``unavailable_open`` (run without
    deduplication) when the store failed; and how a run ended: ``stored``, ``released``
    (an error: the key is free), ``abandoned`` (cancelled: locked until the lease ends),
    ``unstorable`` (answer over the bound: released), ``lease_lost``, ``store_failed``.
    """

    operation: str
    outcome: str


@_event
class DeadlineHeaderIgnored(Event):
    """An inbound deadline/priority header was malformed, forged or untrusted and ignored.

    ``problem`` is one of a few fixed words (`brownout.HeaderError.problem`, ``"untrusted
    source"``, ``"no signer configured"``), never the header's value: it is a metric label."""

    header: str
    problem: str


TallyRow = tuple[str, Priority, str, int, int, int, int]
"""(operation, priority, caller, offered, admitted, completed, completed_late) in a tally."""


@_event
class RequestsTallied(Event):
    """Counts of routine per-request decisions since the last tally, in one event (O1).

    When every sink on a hub accepts tallies (``accepts_tallies = True``: `brownout.Stats`,
    `ShedLog`, `OtelHistogramSink`), a bulkhead does not build `RequestOffered`,
    `RequestAdmitted` (without queueing) and `RequestCompleted` per request: it counts them in
    a `brownout._tally_buffer.Ledger` and the ledger emits this event when a reader asks
    (`EventHub.flush`), when it holds too many rows, and at most every ``flush_interval``.
    Everything unusual (queueing, sheds, expiry, failures, abandonment) is still one event each.

    - ``rows``: counts by (operation, priority, caller); ``admitted`` counts admissions that
      did not wait (queue wait 0.0; admissions after a wait are `RequestAdmitted` events).
    - ``latencies``: (operation, priority, seconds) of *sampled* useful successes: every one
      with a deadline (its clock reads are needed anyway) and one in the bulkhead's
      ``estimate_every`` of the others.
    - ``remaining``: remaining deadline on arrival (seconds) of each offered request that had
      a deadline.
    """

    rows: tuple[TallyRow, ...]
    latencies: tuple[tuple[str, Priority, float], ...]
    remaining: tuple[float, ...]


class Flushable(Protocol):
    """Something holding tallied counts that a hub can ask to emit them (a `Ledger`)."""

    def flush(self) -> None: ...


@runtime_checkable
class Sink(Protocol):
    """Receives events. Must be cheap and must not block: it runs on the request path.

    A sink with a true ``accepts_tallies`` attribute declares that it understands
    `RequestsTallied` and does not need routine per-request events; while every sink on a hub
    says so, emitters count routine decisions instead of building an event for each.
    """

    def emit(self, event: Event) -> None: ...


_MAX_ORPHANS = 64
"""Ledgers of discarded owners held for the next flush before one is forced."""


class EventHub:
    """Fans events out to subscribed sinks.

    A sink that raises is logged (once per sink type) and never breaks the request that
    triggered the event.

    ``enabled``: at least one sink listens (emitters skip building events otherwise).
    ``tallying``: every sink accepts tallies, so emitters with a `Ledger` count routine
    per-request decisions instead of emitting them (`RequestsTallied`). Readers of aggregated
    state call `flush` first; a sink with a ``subscribed_to(hub)`` method is told which hubs
    feed it so it can.
    """

    __slots__ = (
        "__weakref__",
        "_complained",
        "_ledgers",
        "_orphan_lock",
        "_orphan_seq",
        "_orphans",
        "_sinks",
        "enabled",
        "tallying",
    )

    def __init__(self) -> None:
        self._sinks: tuple[Sink, ...] = ()
        self._complained: set[type] = set()
        # Not a WeakSet: iterating one is Python code, and a bulkhead made on the loop while
        # a scrape thread flushes would raise "Set changed size during iteration". Copying a
        # dict's keys with `list()` is one C call, atomic under the GIL.
        self._ledgers: dict[weakref.ref[Flushable], None] = {}
        # Ledgers whose owner (a bulkhead) is gone, kept until a flush emits what they hold:
        # (sequence, ledger), appended by finalizers without a lock (a deque's append and
        # popleft are atomic), removed only under `_orphan_lock` by the flush that emitted them.
        self._orphans: deque[tuple[int, Flushable]] = deque()
        self._orphan_seq = itertools.count()
        self._orphan_lock = threading.Lock()
        self.enabled = False
        self.tallying = False

    def subscribe(self, sink: Sink) -> Sink:
        """Add a sink (idempotent); returns it so it can be kept for `unsubscribe`."""
        if sink not in self._sinks:
            self.flush()  # counts so far belong to the sinks that were listening
            self._sinks = (*self._sinks, sink)
            self._update()
            told = getattr(sink, "subscribed_to", None)
            if told is not None:
                told(self)
        return sink

    def unsubscribe(self, sink: Sink) -> None:
        self.flush()
        self._sinks = tuple(s for s in self._sinks if s is not sink)
        self._update()

    def _update(self) -> None:
        sinks = self._sinks
        self.enabled = bool(sinks)
        self.tallying = bool(sinks) and all(getattr(s, "accepts_tallies", False) for s in sinks)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return self._sinks

    def register_ledger(self, ledger: Flushable) -> None:
        """Remember a ledger that emits here, so `flush` reaches it (held weakly)."""
        ledgers = self._ledgers

        def gone(ref: weakref.ref[Flushable]) -> None:
            ledgers.pop(ref, None)

        ledgers[weakref.ref(ledger, gone)] = None
        if len(self._orphans) > _MAX_ORPHANS:
            # Nobody has read for a while and owners keep going: emit their counts now (on
            # the loop, where a new ledger is made), so the orphans stay bounded.
            self.flush()

    def adopt(self, ledger: Flushable) -> None:
        """Keep ``ledger`` until the next flush: its owner is gone, and what it counted since
        the last flush must still be emitted (O1). Called by a finalizer, at any point of
        any thread: it only appends."""
        self._orphans.append((next(self._orphan_seq), ledger))

    def flush(self) -> None:
        """Ask every ledger emitting on this hub to emit what it has counted."""
        orphans = self._orphans
        # Orphans adopted before this point are still registered, so flushed below; the
        # ones adopted later wait for the next flush.
        try:
            upto = orphans[-1][0]
        except IndexError:  # none (or another thread's flush just took them)
            upto = -1
        for ref in list(self._ledgers):
            ledger = ref()
            if ledger is not None:
                ledger.flush()
        if upto >= 0:
            with self._orphan_lock:
                while orphans and orphans[0][0] <= upto:
                    orphans.popleft()

    def emit(self, event: Event) -> None:
        for sink in self._sinks:
            try:
                sink.emit(event)
            except Exception:  # a broken exporter must not break requests
                if type(sink) not in self._complained:
                    self._complained.add(type(sink))
                    _log.exception("brownout sink %r raised; further errors suppressed", sink)


hub = EventHub()
"""The process-wide default hub; components emit here unless given their own."""


# -- degradation (G1, G4) ----------------------------------------------------------------------


@_event
class StaleServed(Event):
    """A `StaleCache` served content older than its freshness bound (G1); ``age`` in seconds,
    ``refreshing`` is true when a refresh is in flight. Keys are never labels (unbounded)."""

    age: float
    refreshing: bool


@_event
class GuardFailedClosed(Event):
    """A `FailClosedGuard` refused to answer because its authoritative source failed (G4);
    ``what`` is the guarded data (e.g. ``authorization``), ``cause`` the failure's type name."""

    what: str
    cause: str
