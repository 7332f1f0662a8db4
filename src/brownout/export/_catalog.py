"""The metric catalog: one place that names and describes every exported metric.

Prometheus and OpenTelemetry exporters, ``brownout top`` and the docs read this table, so a
metric is named the same way everywhere. Prometheus names follow its conventions (``_total``
for counters, base units in the name); OpenTelemetry names are dotted with a unit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "STATE_COUNTERS",
    "CounterSpec",
    "GaugeSpec",
    "HistogramSpec",
]


@dataclass(frozen=True, slots=True)
class CounterSpec:
    """A `Stats` counter kind as a metric. ``reason_label`` names the kind's extra label."""

    kind: str
    prom: str  # without the _total suffix, which prometheus_client appends
    otel: str
    help: str
    reason_label: str | None = None


@dataclass(frozen=True, slots=True)
class GaugeSpec:
    """A gauge name from `brownout._stats.GAUGE_KINDS` as a metric."""

    kind: str
    prom: str
    otel: str
    unit: str
    help: str


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """A `Stats` histogram table as a metric."""

    table: str  # attribute of Stats
    prom: str
    otel: str
    labels: tuple[str, ...]
    help: str


COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec(
        "offered",
        "brownout_requests_offered",
        "brownout.requests.offered",
        "Requests that arrived and asked to be admitted (O1).",
    ),
    CounterSpec(
        "queued",
        "brownout_requests_queued",
        "brownout.requests.queued",
        "Requests that had to wait in a queue for a permit.",
    ),
    CounterSpec(
        "admitted",
        "brownout_requests_admitted",
        "brownout.requests.admitted",
        "Requests that got a permit and started running.",
    ),
    CounterSpec(
        "shed",
        "brownout_requests_shed",
        "brownout.requests.shed",
        "Requests refused, by reason (O4).",
        "reason",
    ),
    CounterSpec(
        "shed_false_positive",
        "brownout_requests_shed_false_positive",
        "brownout.requests.shed.false_positive",
        "Refusals made while capacity existed; must stay at zero (S8).",
        "reason",
    ),
    CounterSpec(
        "shed_retry",
        "brownout_requests_shed_retry",
        "brownout.requests.shed.retry",
        "Retries (attempt > 1) among the refused requests, by reason; they yield first (I3).",
        "reason",
    ),
    CounterSpec(
        "expired",
        "brownout_requests_expired",
        "brownout.requests.expired",
        "Requests whose deadline passed, by stage (queue or running); never run late.",
        "stage",
    ),
    CounterSpec(
        "completed",
        "brownout_requests_completed",
        "brownout.requests.completed",
        "Requests completed within their deadline: goodput.",
    ),
    CounterSpec(
        "completed_late",
        "brownout_requests_completed_late",
        "brownout.requests.completed_late",
        "Requests completed after their deadline: wasted work.",
    ),
    CounterSpec(
        "failed",
        "brownout_requests_failed",
        "brownout.requests.failed",
        "Admitted requests that failed, by exception type.",
        "error",
    ),
    CounterSpec(
        "abandoned",
        "brownout_requests_abandoned",
        "brownout.requests.abandoned",
        "Requests whose client went away before the answer.",
    ),
    CounterSpec(
        "overran",
        "brownout_handlers_overran",
        "brownout.handlers.overran",
        "Handlers still running after their deadline was answered (504); slot held until done.",
    ),
    CounterSpec(
        "retried",
        "brownout_retries",
        "brownout.retries",
        "Outbound attempts retried, by cause.",
        "cause",
    ),
    CounterSpec(
        "budget_exhausted",
        "brownout_retry_budget_exhausted",
        "brownout.retry_budget.exhausted",
        "Retries refused because the retry budget was empty (R3).",
    ),
    CounterSpec(
        "outcome_unknown",
        "brownout_outcome_unknown",
        "brownout.outcome_unknown",
        "Mutations whose outcome is unknown; reconcile by idempotency key (D6).",
    ),
    CounterSpec(
        "statement_cancelled",
        "brownout_db_statements_cancelled",
        "brownout.db.statements.cancelled",
        "Database statements stopped and cancelled on the server, by stage (D5).",
        "stage",
    ),
    CounterSpec(
        "msg_published",
        "brownout_messages_published",
        "brownout.messages.published",
        "Messages a producer enqueued on a durable queue (source: the queue).",
    ),
    CounterSpec(
        "msg_refused",
        "brownout_messages_refused",
        "brownout.messages.refused",
        "Messages a producer was refused because the queue was over its bound, by reason.",
        "reason",
    ),
    CounterSpec(
        "msg_started",
        "brownout_messages_started",
        "brownout.messages.started",
        "Messages whose handler a consumer started.",
    ),
    CounterSpec(
        "msg_completed",
        "brownout_messages_completed",
        "brownout.messages.completed",
        "Messages whose handler finished within their time: queue goodput.",
    ),
    CounterSpec(
        "msg_retried",
        "brownout_messages_retried",
        "brownout.messages.retried",
        "Messages enqueued again for a later attempt, by cause (deferred: consumer busy).",
        "cause",
    ),
    CounterSpec(
        "msg_parked",
        "brownout_messages_parked",
        "brownout.messages.parked",
        "Messages parked instead of run, by reason (expired, too_old, attempts, failed, "
        "malformed); never dropped.",
        "reason",
    ),
)
GAUGES: tuple[GaugeSpec, ...] = (
    GaugeSpec(
        "in_flight",
        "brownout_in_flight_requests",
        "brownout.in_flight",
        "{request}",
        "Admitted requests running now (admitted concurrency; an autoscaling signal, O5).",
    ),
    GaugeSpec(
        "limit",
        "brownout_concurrency_limit",
        "brownout.concurrency.limit",
        "{request}",
        "Current concurrency limit of a bulkhead.",
    ),
    GaugeSpec(
        "queue_depth",
        "brownout_queue_depth_requests",
        "brownout.queue.depth",
        "{request}",
        "Requests waiting in a bulkhead's queue.",
    ),
    GaugeSpec(
        "queue_oldest_age",
        "brownout_queue_oldest_age_seconds",
        "brownout.queue.oldest_age",
        "s",
        "Age of the oldest queued request (an autoscaling signal, O5).",
    ),
    GaugeSpec(
        "retry_budget_balance",
        "brownout_retry_budget_tokens",
        "brownout.retry_budget.balance",
        "{token}",
        "Tokens left in a retry budget (each retry spends one).",
    ),
    GaugeSpec(
        "breaker_state",
        "brownout_breaker_state",
        "brownout.breaker.state",
        "1",
        "1 for a circuit breaker's current state (closed, open, half_open), else 0.",
    ),
    GaugeSpec(
        "overload_level",
        "brownout_overload_level",
        "brownout.overload.level",
        "1",
        "Overload manager level; 0 is no pressure.",
    ),
    GaugeSpec(
        "degraded_mode_active",
        "brownout_degraded_mode_active",
        "brownout.degraded_mode.active",
        "1",
        "1 while a declared degraded mode is on.",
    ),
    GaugeSpec(
        "degraded_mode_active_seconds",
        "brownout_degraded_mode_active_seconds",
        "brownout.degraded_mode.active_duration",
        "s",
        "How long a degraded mode has been on (0 when off).",
    ),
    GaugeSpec(
        "degraded_mode_max_seconds",
        "brownout_degraded_mode_max_seconds",
        "brownout.degraded_mode.max_duration",
        "s",
        "Declared maximum duration of a degraded mode (G2).",
    ),
    GaugeSpec(
        "backlog_depth",
        "brownout_backlog_depth_messages",
        "brownout.backlog.depth",
        "{message}",
        "Messages waiting in a durable queue, as its producer last measured (source: queue).",
    ),
    GaugeSpec(
        "backlog_oldest_age",
        "brownout_backlog_oldest_age_seconds",
        "brownout.backlog.oldest_age",
        "s",
        "Age of a durable queue's oldest waiting message: scale consumers on this, not CPU.",
    ),
    GaugeSpec(
        "quota_fallback_active",
        "brownout_quota_fallback_active",
        "brownout.quota.fallback",
        "1",
        "1 while a shared quota store is unreachable and the local fallback rules (F1).",
    ),
)

HISTOGRAMS: tuple[HistogramSpec, ...] = (
    HistogramSpec(
        "success_latency",
        "brownout_success_latency_seconds",
        "brownout.success.latency",
        ("operation", "priority"),
        "Latency of useful successes only; refusals and failures excluded (O3). "
        "Sampled while tallying: every success with a deadline, 1 in 16 without.",
    ),
    HistogramSpec(
        "queue_wait",
        "brownout_queue_wait_seconds",
        "brownout.queue.wait",
        ("source",),
        "Time admitted requests waited in a queue (O2).",
    ),
    HistogramSpec(
        "remaining_on_arrival",
        "brownout_remaining_deadline_seconds",
        "brownout.deadline.remaining",
        ("source",),
        "Remaining deadline when a request arrived at this hop (O2).",
    ),
    HistogramSpec(
        "message_age",
        "brownout_message_age_seconds",
        "brownout.message.age",
        ("source",),
        "Age of durable-queue messages (since first enqueue) when a consumer started them.",
    ),
)

STATE_COUNTERS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    (
        "breaker_transitions",
        "brownout_breaker_transitions",
        "brownout.breaker.transitions",
        ("source", "state"),
        "Circuit-breaker transitions into each state.",
    ),
    (
        "degraded_activations",
        "brownout_degraded_mode_activations",
        "brownout.degraded_mode.activations",
        ("mode",),
        "Times each degraded mode was entered.",
    ),
    (
        "headers_ignored",
        "brownout_deadline_headers_ignored",
        "brownout.deadline_headers.ignored",
        ("header", "problem"),
        "Inbound deadline/priority headers ignored as malformed, forged or untrusted.",
    ),
    (
        "stale_served",
        "brownout_stale_served",
        "brownout.stale.served",
        ("source",),
        "Answers a StaleCache served older than their freshness bound (G1).",
    ),
    (
        "guard_failed_closed",
        "brownout_guard_failed_closed",
        "brownout.guard.failed_closed",
        ("what", "cause"),
        "Refusals of a FailClosedGuard whose authoritative source failed, by failure (G4).",
    ),
    (
        "ledger_write_failures",
        "brownout_ledger_write_failures",
        "brownout.ledger.write_failures",
        ("source", "ledger", "error"),
        "Unknown outcomes a Dependency could not record in its ledger, by failure (D6).",
    ),
    (
        "idempotency",
        "brownout_idempotency_decisions",
        "brownout.idempotency.decisions",
        ("source", "outcome"),
        "Idempotency-layer decisions by outcome: executed, replayed, in_progress, ... (I2).",
    ),
)
"""(Stats attribute, Prometheus name, OpenTelemetry name, label names, help) for counters of
state changes kept outside the request rows."""
