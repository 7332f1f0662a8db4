"""The `Stats` sink: in-memory accounting of every decision (O1, O2, O3, O5, S8).

`Stats` counts offered, queued, admitted, shed (by reason), expired, completed within the
deadline (goodput), completed late (wasted work), failed, abandoned, retried and
budget-exhausted work, split by source (the component that decided: one hop), operation,
priority and caller. Latency histograms hold *useful successes only*: refusals and failures
never pollute success latency (O3). Queue wait and remaining deadline on arrival are kept per
source, i.e. per hop (O2).

Everything is bounded. Label values go through caps (`LabelCap`: first come; `TopKLabels`: the
most active values win their slot, the rest count as ``"other"``), and the number of counter
series has a hard ceiling (``max_series``), so 100,000 distinct callers cannot grow memory or
the metric series count without bound.

Live state that no event carries (in-flight, queue depth, oldest queue age, retry-budget
balance) is *pulled* at read time from registered `Observable` objects (`Stats.watch`,
`Stats.watch_gauge`), so the hot path never pays for it.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._clock import Clock, default_clock
from .._histogram import LatencyHistogram
from .._priority import Priority
from .._snapshot import items_of
from ..events import (
    AttemptRetried,
    BreakerStateChanged,
    DeadlineHeaderIgnored,
    DegradedModeChanged,
    Event,
    EventHub,
    GuardFailedClosed,
    HandlerOverran,
    IdempotencyDecided,
    LedgerWriteFailed,
    LimitChanged,
    MessageCompleted,
    MessageParked,
    MessagePublished,
    MessageRefused,
    MessageRetried,
    MessageStarted,
    OutcomeUnknown,
    OverloadLevelChanged,
    QuotaBackendChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
    RequestsTallied,
    RetryBudgetExhausted,
    StaleServed,
    StatementCancelled,
)
from .gauges import BREAKER_STATES, Gauge, GaugeFn, Observable
from .labels import OTHER, LabelCap, TopKLabels

__all__ = ["COUNTER_KINDS", "Key", "Row", "Stats"]

_log = logging.getLogger("brownout.stats")

COUNTER_KINDS = (
    "offered",
    "queued",
    "admitted",
    "shed",
    "shed_false_positive",
    "shed_retry",
    "expired",
    "completed",
    "completed_late",
    "failed",
    "abandoned",
    "overran",
    "retried",
    "budget_exhausted",
    "outcome_unknown",
    "statement_cancelled",
    "msg_published",
    "msg_refused",
    "msg_started",
    "msg_completed",
    "msg_retried",
    "msg_parked",
)
"""Every counter `Stats` keeps. ``completed`` is goodput (useful successes); ``msg_completed``
is queue goodput (messages whose handler finished within their time)."""

_MESSAGE_AGE_BOUNDS = tuple(round(1e-3 * 10 ** (i / 4), 9) for i in range(0, 8 * 4 + 1))
"""1 ms .. 100,000 s, 4 buckets per decade: a message may wait hours, a request may not."""

Key = tuple[str, str, str, str, str]
"""(kind, operation, priority, caller, reason): the shape `Stats.series` returns."""

Row = tuple[str, str, str, str, str, str]
"""(kind, source, operation, priority, caller, reason): how `Stats.rows` is keyed."""

_PRIORITY_LABELS = tuple(p.label for p in sorted(Priority))
_Labels = tuple[str, str, str, str]  # (source, operation, priority, caller), capped
_LABEL_CACHE_SIZE = 4096


class Stats:
    """An event sink that keeps counters, latency histograms and state gauges.

    Subscribe it to a hub (``brownout.hub.subscribe(Stats())``). Recording costs a few dict
    operations per event; reading (`count`, `snapshot`, `rows`, `gauges`, exporters) does the
    aggregation. ``max_series`` bounds the number of counter rows: past it, new rows fold the
    caller, then the operation, into ``"other"``, and what still finds no row folds source and
    reason too, into at most one row per (kind, priority): at most ``max_series`` + 52 rows.

    `Stats` accepts tallies (`brownout.events.RequestsTallied`): while it and the other sinks
    on a hub do, bulkheads count routine requests instead of emitting three events each, and
    every read first flushes the hubs it is subscribed to (`sync`), so what a reader sees
    includes every request that has finished. Success latency is then a sample: every
    success with a deadline, and one in ``estimate_every`` (16) of those without.
    """

    accepts_tallies = True

    def __init__(
        self,
        *,
        max_operations: int = 200,
        max_callers: int = 100,
        max_sources: int = 100,
        max_reasons: int = 64,
        max_series: int = 10_000,
        caller_policy: str = "top",
        caller_epoch: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not 1 <= max_series < math.inf:
            raise ValueError("max_series must be at least 1 (and finite)")
        if caller_policy not in ("top", "first"):
            raise ValueError("caller_policy is 'top' (TopKLabels) or 'first' (LabelCap)")
        self.operations = LabelCap(max_operations)
        self.callers: LabelCap | TopKLabels = (
            # Stats counts slot holders' activity from its rows; the cap's own epoch is off.
            TopKLabels(max_callers, epoch=1 << 62, on_evict=self._fold_callers)
            if caller_policy == "top"
            else LabelCap(max_callers)
        )
        self.sources = LabelCap(max_sources)
        self.reasons = LabelCap(max_reasons)
        """Caps free-form reason labels: exception type names, retry causes, header problems."""
        self.modes = LabelCap(max_reasons)
        """Caps degraded-mode names. Apart from `reasons`: modes are declared in code, and
        exception names seen first must not fold a mode into "other", where the gauge of one
        mode turning off would hide another that is on."""
        self.max_series = max_series
        self._rows: dict[tuple[str, _Labels, str], int] = {}
        # Raw (source, operation, priority, caller) -> capped labels: one dict lookup per event
        # instead of four cap calls. Entries whose caller is "other" are not cached, so unknown
        # callers keep feeding the top-k sketch; slot holders' activity is read from the rows.
        self._label_cache: dict[tuple[str, str, int, str], _Labels] = {}
        self.caller_epoch = caller_epoch if caller_epoch else max(10_000, 100 * max_callers)
        """Counter events between two top-k caller rebalances."""
        self._epoch_left = self.caller_epoch
        self._activity_base: dict[str, int] = {}
        self.success_latency: dict[tuple[str, str], LatencyHistogram] = {}
        """Latency of useful successes by (operation, priority) (O3)."""
        self.queue_wait: dict[str, LatencyHistogram] = {}
        """Time in queue of admitted work, by source (O2)."""
        self.remaining_on_arrival: dict[str, LatencyHistogram] = {}
        """Remaining deadline when work was offered, by source, i.e. at each hop (O2)."""
        self.message_age: dict[str, LatencyHistogram] = {}
        """Age of durable-queue messages (since their first enqueue) when a consumer started
        them, by queue: how stale the work is that consumers spend capacity on."""
        self.limits: dict[str, int] = {}
        self.breakers: dict[str, str] = {}
        self.breaker_transitions: dict[tuple[str, str], int] = {}
        """Count of transitions into each state, by (source, new state)."""
        self.overload_level = 0
        """The most recently reported overload level (of any manager)."""
        self.overload_levels: dict[str, int] = {}
        """Overload level by manager (source)."""
        self.degraded_modes: dict[str, bool] = {}
        self.degraded_since: dict[str, float] = {}
        """When each active degraded mode was entered (event clock)."""
        self.degraded_max: dict[str, float] = {}
        """Declared maximum duration of each degraded mode (seconds), for alerting (G2)."""
        self.degraded_activations: dict[str, int] = {}
        self.quota_fallback: dict[str, bool] = {}
        self.headers_ignored: dict[tuple[str, str], int] = {}
        """Inbound deadline/priority headers ignored, by (header, problem)."""
        self.stale_served: dict[str, int] = {}
        """Answers a `StaleCache` served older than their freshness bound, by cache (G1)."""
        self.guard_failed_closed: dict[tuple[str, str], int] = {}
        """Refusals of a `FailClosedGuard`, by (guarded data, failure type name) (G4)."""
        self.ledger_write_failures: dict[tuple[str, str, str], int] = {}
        """Unknown outcomes a `Dependency` could not record in its ledger, by (dependency,
        ledger, failure type name) (D6): each is a mutation nobody will reconcile."""
        self.idempotency: dict[tuple[str, str], int] = {}
        """Decisions of an idempotency layer, by (layer name, outcome) (I2)."""
        self._clock = clock if clock is not None else default_clock()
        self._watched: list[Callable[[], Observable | None]] = []
        self._complained: set[int] = set()
        self._hubs: list[weakref.ref[EventHub]] = []
        self._syncing = threading.Lock()
        self._recording = threading.Lock()
        # Taken by watch/unwatch and by `gauges` to copy and prune the list, never per event.
        self._watching = threading.Lock()
        self._dispatch: dict[type, Callable[[Any], None]] = {
            RequestsTallied: self._tallied,
            RequestOffered: self._offered,
            RequestQueued: self._queued,
            RequestAdmitted: self._admitted,
            RequestShed: self._shed,
            RequestExpired: self._expired,
            RequestCompleted: self._completed,
            RequestFailed: self._failed,
            RequestAbandoned: self._abandoned,
            HandlerOverran: self._overran,
            AttemptRetried: self._retried,
            RetryBudgetExhausted: self._budget_exhausted,
            OutcomeUnknown: self._outcome_unknown,
            StatementCancelled: self._statement_cancelled,
            LimitChanged: self._limit,
            BreakerStateChanged: self._breaker,
            OverloadLevelChanged: self._overload,
            DegradedModeChanged: self._degraded,
            QuotaBackendChanged: self._quota_backend,
            DeadlineHeaderIgnored: self._header_ignored,
            StaleServed: self._stale_served,
            GuardFailedClosed: self._guard_failed_closed,
            LedgerWriteFailed: self._ledger_write_failed,
            IdempotencyDecided: self._idempotency,
            MessagePublished: self._msg_published,
            MessageRefused: self._msg_refused,
            MessageStarted: self._msg_started,
            MessageCompleted: self._msg_completed,
            MessageRetried: self._msg_retried,
            MessageParked: self._msg_parked,
        }

    # -- the sink ---------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        handler = self._dispatch.get(type(event))
        if handler is not None:
            # A tally can arrive on a scrape thread (a read flushes the ledgers there) while
            # the loop thread records events: updates are serialized so none is lost.
            with self._recording:
                handler(event)

    def subscribed_to(self, hub: EventHub) -> None:
        """Called by `EventHub.subscribe`: reads flush ``hub`` first (see `sync`)."""
        if all(r() is not hub for r in self._hubs):
            # Hubs that are gone are dropped here, so short-lived hubs leave nothing behind.
            self._hubs = [r for r in self._hubs if r() is not None]
            self._hubs.append(weakref.ref(hub))

    def sync(self) -> None:
        """Fold in what ledgers on the subscribed hubs have counted but not yet emitted.

        Every read method calls it; call it yourself before reading the public tables
        (`success_latency`, `queue_wait`, `remaining_on_arrival`) directly.
        """
        if not self._hubs:
            return
        with self._syncing:
            for ref in list(self._hubs):
                hub = ref()
                if hub is not None:
                    hub.flush()

    def _labels(self, e: Any) -> _Labels:
        return self._labels_of(e.source, e.operation, e.priority, e.caller)

    def _labels_of(
        self, source: str, operation: str, priority: int, caller: str, weight: int = 1
    ) -> _Labels:
        raw = (source, operation, priority, caller)
        labels = self._label_cache.get(raw)
        if labels is None:
            labels = (
                self.sources(source),
                self.operations(operation),
                _PRIORITY_LABELS[priority],
                self.callers(caller, weight),
            )
            if labels[3] != OTHER:
                cache = self._label_cache
                if len(cache) >= _LABEL_CACHE_SIZE:
                    cache.clear()
                cache[raw] = labels
        return labels

    def _count(self, kind: str, e: Any, reason: str = "") -> _Labels:
        # The hot path: `_labels` and `_bump` inlined (one call per event, not three).
        labels = self._label_cache.get((e.source, e.operation, e.priority, e.caller))
        if labels is None:
            labels = self._labels(e)
        key = (kind, labels, reason)
        rows = self._rows
        n = rows.get(key)
        if n is None:
            if len(rows) >= self.max_series:
                key = self._overflow(key)
            n = rows.get(key, 0)
        rows[key] = n + 1
        self._epoch_left -= 1
        if self._epoch_left <= 0:
            self._rebalance_callers()
        return labels

    def _bump(self, kind: str, labels: _Labels, reason: str = "", by: int = 1) -> None:
        key = (kind, labels, reason)
        rows = self._rows
        n = rows.get(key)
        if n is None:
            if len(rows) >= self.max_series:
                key = self._overflow(key)
            n = rows.get(key, 0)
        rows[key] = n + by
        self._epoch_left -= by
        if self._epoch_left <= 0:
            self._rebalance_callers()

    def _overflow(self, key: tuple[str, _Labels, str]) -> tuple[str, _Labels, str]:
        # Past the series ceiling, give up detail: first the caller, then the operation, into
        # rows that already exist; then the source and reason too, into one row per (kind,
        # priority), so the ceiling holds however many sources and reasons come.
        kind, (source, op, prio, _caller), reason = key
        rows = self._rows
        key = (kind, (source, op, prio, OTHER), reason)
        if key in rows:
            return key
        key = (kind, (source, OTHER, prio, OTHER), reason)
        if key in rows:
            return key
        return (kind, (OTHER, OTHER, prio, OTHER), OTHER if reason else "")

    def _rebalance_callers(self) -> None:
        self._epoch_left = self.caller_epoch
        callers = self.callers
        if not isinstance(callers, TopKLabels):
            return
        totals: dict[str, int] = {}
        for (_kind, labels, _reason), n in items_of(self._rows):
            totals[labels[3]] = totals.get(labels[3], 0) + n
        base = self._activity_base
        activity = {c: n - base.get(c, 0) for c, n in totals.items()}
        self._activity_base = totals
        callers._rebalance(activity)

    def _fold_callers(self, evicted: frozenset[str]) -> None:
        rows = self._rows
        for key in [k for k in rows if k[1][3] in evicted]:
            n = rows.pop(key)
            kind, (source, op, prio, _caller), reason = key
            other = (kind, (source, op, prio, OTHER), reason)
            rows[other] = rows.get(other, 0) + n
        self._label_cache.clear()
        for caller in evicted:
            self._activity_base.pop(caller, None)

    def _hist(self, table: dict[Any, LatencyHistogram], key: Any) -> LatencyHistogram:
        h = table.get(key)
        if h is None:
            h = table[key] = LatencyHistogram()
        return h

    def _tallied(self, e: RequestsTallied) -> None:
        source = e.source
        admitted_now = 0
        for operation, priority, caller, offered, admitted, completed, late in e.rows:
            labels = self._labels_of(
                source, operation, priority, caller, offered + admitted + completed + late
            )
            if offered:
                self._bump("offered", labels, "", offered)
            if admitted:
                self._bump("admitted", labels, "", admitted)
                admitted_now += admitted
            if completed:
                self._bump("completed", labels, "", completed)
            if late:
                self._bump("completed_late", labels, "", late)
        hop = self.sources(source)
        if admitted_now:
            self._hist(self.queue_wait, hop).observe_many(0.0, admitted_now)
        if e.remaining:
            self._hist(self.remaining_on_arrival, hop).observe_all(e.remaining)
        # Grouped per histogram first: one label lookup per (operation, priority), not per
        # sample (a flush can carry thousands).
        groups: dict[tuple[str, Priority], list[float]] = {}
        for operation, priority, seconds in e.latencies:
            group = groups.get((operation, priority))
            if group is None:
                groups[(operation, priority)] = [seconds]
            else:
                group.append(seconds)
        ops = self.operations
        for (operation, priority), values in groups.items():
            key = (ops(operation), _PRIORITY_LABELS[priority])
            self._hist(self.success_latency, key).observe_all(values)

    def _offered(self, e: RequestOffered) -> None:
        labels = self._count("offered", e)
        if e.remaining is not None:
            h = self.remaining_on_arrival.get(labels[0])
            if h is None:
                h = self._hist(self.remaining_on_arrival, labels[0])
            h.observe(e.remaining)

    def _queued(self, e: RequestQueued) -> None:
        self._count("queued", e)

    def _admitted(self, e: RequestAdmitted) -> None:
        labels = self._count("admitted", e)
        h = self.queue_wait.get(labels[0])
        if h is None:
            h = self._hist(self.queue_wait, labels[0])
        h.observe(e.queue_wait)

    def _shed(self, e: RequestShed) -> None:
        reason = e.reason.value
        labels = self._count("shed", e, reason)
        # S8: refused while capacity existed (the bulkhead says so), or refused by an overload
        # manager that itself reports being at its lowest level.
        if e.false_positive or self.overload_levels.get(e.source) == 0:
            self._bump("shed_false_positive", labels, reason)
        if e.retry:
            self._bump("shed_retry", labels, reason)

    def _expired(self, e: RequestExpired) -> None:
        self._count("expired", e, e.stage)

    def _completed(self, e: RequestCompleted) -> None:
        if e.useful:
            labels = self._count("completed", e)
            key = (labels[1], labels[2])
            h = self.success_latency.get(key)
            if h is None:
                h = self._hist(self.success_latency, key)
            h.observe(e.latency)
        else:
            self._count("completed_late", e)

    def _failed(self, e: RequestFailed) -> None:
        self._count("failed", e, self.reasons(e.error))

    def _abandoned(self, e: RequestAbandoned) -> None:
        self._count("abandoned", e)

    def _overran(self, e: HandlerOverran) -> None:
        self._count("overran", e)

    def _retried(self, e: AttemptRetried) -> None:
        self._count("retried", e, self.reasons(e.cause))

    def _budget_exhausted(self, e: RetryBudgetExhausted) -> None:
        self._count("budget_exhausted", e)

    def _outcome_unknown(self, e: OutcomeUnknown) -> None:
        self._count("outcome_unknown", e)

    def _statement_cancelled(self, e: StatementCancelled) -> None:
        self._count("statement_cancelled", e, e.stage)

    def _limit(self, e: LimitChanged) -> None:
        self.limits[self.sources(e.source)] = e.new

    def _breaker(self, e: BreakerStateChanged) -> None:
        source = self.sources(e.source)
        self.breakers[source] = e.new
        key = (source, e.new)
        self.breaker_transitions[key] = self.breaker_transitions.get(key, 0) + 1

    def _overload(self, e: OverloadLevelChanged) -> None:
        self.overload_level = e.new
        self.overload_levels[self.sources(e.source)] = e.new

    def _degraded(self, e: DegradedModeChanged) -> None:
        mode = self.modes(e.mode)
        was = self.degraded_modes.get(mode, False)
        self.degraded_modes[mode] = e.active
        if e.active and not was:
            self.degraded_since[mode] = e.at
            self.degraded_activations[mode] = self.degraded_activations.get(mode, 0) + 1
        elif not e.active:
            self.degraded_since.pop(mode, None)

    def _quota_backend(self, e: QuotaBackendChanged) -> None:
        self.quota_fallback[self.sources(e.source)] = e.fallback

    def _header_ignored(self, e: DeadlineHeaderIgnored) -> None:
        key = (self.reasons(e.header), self.reasons(e.problem))
        self.headers_ignored[key] = self.headers_ignored.get(key, 0) + 1

    def _stale_served(self, e: StaleServed) -> None:
        source = self.sources(e.source)
        self.stale_served[source] = self.stale_served.get(source, 0) + 1

    def _guard_failed_closed(self, e: GuardFailedClosed) -> None:
        key = (self.sources(e.what), self.reasons(e.cause))
        self.guard_failed_closed[key] = self.guard_failed_closed.get(key, 0) + 1

    def _ledger_write_failed(self, e: LedgerWriteFailed) -> None:
        key = (self.sources(e.source), self.sources(e.ledger), self.reasons(e.error))
        self.ledger_write_failures[key] = self.ledger_write_failures.get(key, 0) + 1

    def _idempotency(self, e: IdempotencyDecided) -> None:
        key = (self.sources(e.source), self.reasons(e.outcome))
        self.idempotency[key] = self.idempotency.get(key, 0) + 1

    def _msg_published(self, e: MessagePublished) -> None:
        self._count("msg_published", e)

    def _msg_refused(self, e: MessageRefused) -> None:
        self._count("msg_refused", e, e.reason.value)

    def _msg_started(self, e: MessageStarted) -> None:
        labels = self._count("msg_started", e)
        h = self.message_age.get(labels[0])
        if h is None:
            h = self.message_age[labels[0]] = LatencyHistogram(_MESSAGE_AGE_BOUNDS)
        h.observe(e.age)

    def _msg_completed(self, e: MessageCompleted) -> None:
        self._count("msg_completed", e)

    def _msg_retried(self, e: MessageRetried) -> None:
        self._count("msg_retried", e, "deferred" if e.deferred else self.reasons(e.cause))

    def _msg_parked(self, e: MessageParked) -> None:
        self._count("msg_parked", e, self.reasons(e.reason))

    # -- live state -------------------------------------------------------------------------
    def watch(self, observable: Observable) -> Observable:
        """Read ``observable.gauges()`` at every scrape; returns it (for `unwatch`).

        Held by weak reference when the object allows it, so a discarded bulkhead does not
        linger in the metrics.
        """
        try:
            ref: Callable[[], Observable | None] = weakref.ref(observable)
        except TypeError:

            def ref() -> Observable:
                return observable

        with self._watching:
            self._watched.append(ref)
        return observable

    def watch_gauge(
        self, name: str, labels: Mapping[str, str], fn: Callable[[], float]
    ) -> Observable:
        """Export ``fn()`` as gauge ``name`` with ``labels``, read at scrape time."""
        return self.watch(GaugeFn(name, labels, fn))

    def unwatch(self, observable: Observable) -> None:
        with self._watching:
            self._watched = [r for r in self._watched if r() is not observable and r() is not None]

    def declare_degraded_mode(self, mode: str, max_duration: float) -> None:
        """Record a degraded mode's declared maximum duration (G2), exported so an alert can
        fire when the mode stays on longer."""
        self.degraded_max[self.modes(mode)] = float(max_duration)

    def gauges(self) -> list[Gauge]:
        """Every gauge reading: state learned from events plus every watched `Observable`.

        An observable's reading replaces an event-derived one with the same name and labels.
        """
        self.sync()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], Gauge] = {}

        def put(name: str, labels: Mapping[str, str], value: float) -> None:
            out[(name, tuple(sorted(labels.items())))] = (name, labels, value)

        for source, limit in items_of(self.limits):
            put("limit", {"source": source}, float(limit))
        for source, state in items_of(self.breakers):
            for s in BREAKER_STATES:
                put("breaker_state", {"source": source, "state": s}, 1.0 if s == state else 0.0)
        for source, level in items_of(self.overload_levels):
            put("overload_level", {"source": source}, float(level))
        now = self._clock.now()
        for mode, active in items_of(self.degraded_modes):
            put("degraded_mode_active", {"mode": mode}, 1.0 if active else 0.0)
            since = self.degraded_since.get(mode)
            put(
                "degraded_mode_active_seconds",
                {"mode": mode},
                max(0.0, now - since) if active and since is not None else 0.0,
            )
        for mode, limit_s in items_of(self.degraded_max):
            put("degraded_mode_max_seconds", {"mode": mode}, limit_s)
        for source, fallback in items_of(self.quota_fallback):
            put("quota_fallback_active", {"source": source}, 1.0 if fallback else 0.0)

        # Read from a copy and prune under `_watching`: with two reader threads (a Prometheus
        # server and the OTel reader), replacing the list with the survivors one reader saw
        # dropped what the loop had watched meanwhile, for good.
        with self._watching:
            refs = list(self._watched)
        dead = False
        for ref in refs:
            obj = ref()
            if obj is None:
                dead = True
                continue
            try:
                for name, labels, value in obj.gauges():
                    put(name, labels, float(value))
            except Exception:  # one broken observable must not break the scrape
                if id(obj) not in self._complained:
                    self._complained.add(id(obj))
                    _log.exception("observable %r raised; skipped", obj)
        if dead:
            with self._watching:
                self._watched = [r for r in self._watched if r() is not None]
        return list(out.values())

    # -- reading ----------------------------------------------------------------------------
    def _copy_rows(self) -> list[tuple[tuple[str, _Labels, str], int]]:
        # Evicting a caller moves its counts into "other" (pop, then add) under `_recording`;
        # a copy taken between the two misses them and sums over callers go back. The copy is
        # one C call; the loop already takes this lock per event, so readers add nothing to
        # its path, only an occasional wait of one copy.
        with self._recording:
            return items_of(self._rows)

    @property
    def rows(self) -> dict[Row, int]:
        """Counter values by (kind, source, operation, priority, caller, reason): what
        exporters read. A fresh dict."""
        self.sync()
        return {(kind, *labels, reason): n for (kind, labels, reason), n in self._copy_rows()}

    @property
    def counters(self) -> dict[Key, int]:
        """Counter values summed over sources, keyed (kind, operation, priority, caller,
        reason). A fresh dict: read it, do not write to it."""
        self.sync()
        out: dict[Key, int] = {}
        for (kind, (_src, op, pr, ca), re), n in self._copy_rows():
            key = (kind, op, pr, ca, re)
            out[key] = out.get(key, 0) + n
        return out

    def count(
        self,
        kind: str,
        *,
        operation: str | None = None,
        priority: str | None = None,
        caller: str | None = None,
        reason: str | None = None,
        source: str | None = None,
    ) -> int:
        """Sum of one counter over every label set matching the given labels: label values
        as exported, so ``caller="other"`` is the overflow row and a real caller named
        "other" is ``"_other"`` (`label_value`)."""
        if kind not in COUNTER_KINDS:
            raise ValueError(f"unknown counter {kind!r}; one of {COUNTER_KINDS}")
        self.sync()
        total = 0
        for (k, (src, op, pr, ca), re), n in self._copy_rows():
            if (
                k == kind
                and (source is None or src == source)
                and (operation is None or op == operation)
                and (priority is None or pr == priority)
                and (caller is None or ca == caller)
                and (reason is None or re == reason)
            ):
                total += n
        return total

    def latency(
        self, operation: str | None = None, priority: str | None = None
    ) -> LatencyHistogram:
        """Merged success-latency histogram for the matching operation/priority."""
        self.sync()
        out = LatencyHistogram()
        for (op, pr), h in items_of(self.success_latency):
            if (operation is None or op == operation) and (priority is None or pr == priority):
                out.merge(h)
        return out

    def series(self) -> Iterable[tuple[Key, int]]:
        """Every (labels, value) counter pair summed over sources (see `rows` for per-hop)."""
        return items_of(self.counters)

    def series_count(self) -> int:
        """How many counter and histogram series exist: what the label caps bound."""
        self.sync()
        return (
            len(self._rows)
            + len(self.success_latency)
            + len(self.queue_wait)
            + len(self.remaining_on_arrival)
            + len(self.message_age)
        )

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able summary: totals per kind and reason, success latency, state gauges."""
        self.sync()
        totals: dict[str, int] = dict.fromkeys(COUNTER_KINDS, 0)
        shed_by_reason: dict[str, int] = {}
        for (kind, _labels, reason), n in self._copy_rows():
            totals[kind] += n
            if kind == "shed":
                shed_by_reason[reason] = shed_by_reason.get(reason, 0) + n
        lat = self.latency()
        return {
            "totals": totals,
            "shed_by_reason": shed_by_reason,
            "success_latency": {
                "count": lat.count,
                "p50": lat.quantile(0.5) if lat.count else None,
                "p99": lat.quantile(0.99) if lat.count else None,
            },
            "limits": dict(items_of(self.limits)),
            "breakers": dict(items_of(self.breakers)),
            "overload_level": self.overload_level,
            "degraded_modes": dict(items_of(self.degraded_modes)),
            "quota_fallback": dict(items_of(self.quota_fallback)),
            "series": self.series_count(),
        }

    def reset(self) -> None:
        """Forget all counts and histograms (label caps keep what they learned)."""
        self.sync()  # counts pending in ledgers belong to the period being forgotten
        with self._recording:
            self._forget()

    def _forget(self) -> None:
        self._rows.clear()
        self._activity_base.clear()
        self.success_latency.clear()
        self.queue_wait.clear()
        self.remaining_on_arrival.clear()
        self.message_age.clear()
        self.breaker_transitions.clear()
        self.degraded_activations.clear()
        self.headers_ignored.clear()
        self.stale_served.clear()
        self.guard_failed_closed.clear()
        self.ledger_write_failures.clear()
        self.idempotency.clear()
