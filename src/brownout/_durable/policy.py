"""What to do with one message: run it, retry it later, or park it (and why); and whether a
producer may add to a backlog at all.

`MessagePolicy` decides for a consumer, before a delivered message runs (`before`) and after
its handler failed (`after_failure`); `BacklogBound` decides for a producer. Both are pure:
they read an `Envelope`, a wall-clock time and counts, and return a decision, so a test drives
them without a broker or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from .._errors import DeadlineExceeded, Reason, Rejected, UnknownOutcome
from .._priority import Priority
from .._retry import (
    Backoff,
    ExponentialBackoff,
    Failure,
    FailureClassifier,
    RetriesExhausted,
    RetryBudget,
    StopReason,
    classify,
)
from .envelope import ENQUEUED_AT_FIELD, Envelope, EnvelopeError

__all__ = [
    "BacklogBound",
    "MessagePolicy",
    "Park",
    "ParkReason",
    "RetryLater",
    "Run",
]


class ParkReason(StrEnum):
    """Why a message was parked instead of run (the stable, machine-readable name)."""

    EXPIRED = "expired"
    """Past its ``valid-until``, or too little of it left to be useful."""
    TOO_OLD = "too_old"
    """Older than the queue's ``max_age``."""
    ATTEMPTS = "attempts"
    """Out of attempts (``max_attempts``), broker redeliveries included."""
    FAILED = "failed"
    """The handler failed in a way another attempt cannot fix."""
    MALFORMED = "malformed"
    """The envelope is missing or malformed (and the policy parks such messages)."""


@dataclass(frozen=True, slots=True)
class Run:
    """Run the handler now, with at most ``budget`` seconds (``None``: no bound)."""

    envelope: Envelope
    attempt: int
    """The attempt this delivery is (the envelope's, plus broker redeliveries)."""
    budget: float | None


@dataclass(frozen=True, slots=True)
class RetryLater:
    """Enqueue ``envelope`` (the next attempt) again, to run no sooner than ``delay`` s."""

    envelope: Envelope
    delay: float
    detail: str
    budget_exhausted: bool = False
    """The consumer's retry budget was spent: the delay is the backoff's longest."""


@dataclass(frozen=True, slots=True)
class Park:
    """Move the message to the parked queue with its reason; never run it."""

    reason: ParkReason
    detail: str
    envelope: Envelope | None
    """``None`` only for a message whose envelope could not be read."""


Decision = Run | RetryLater | Park

_RETRY_LATER_REASONS = frozenset(
    {
        Reason.QUEUE_FULL,
        Reason.QUEUE_TIMEOUT,
        Reason.OVERLOADED,
        Reason.FAIR_SHARE,
        Reason.QUOTA,
        Reason.BREAKER_OPEN,
        Reason.BUDGET_EXHAUSTED,
        Reason.THROTTLED,
        Reason.DEPENDENCY_UNAVAILABLE,
        Reason.OUTCOME_UNKNOWN,
    }
)
"""Refusals by a dependency or a local guard that say "not now": the work is still valid."""


def message_failure(error: BaseException) -> Failure:
    """How a handler's error reads for a message (as opposed to one outbound call): a
    dependency refusing for now (breaker open, overloaded, quota) or an unknown outcome is
    worth a later attempt with the same idempotency key; a lower layer's do-not-retry, an
    expired deadline and any other answer are not."""
    if isinstance(error, UnknownOutcome):
        return Failure(transient=True)
    if isinstance(error, DeadlineExceeded):
        return Failure(transient=False)  # the message's own time ran out: see `after_failure`
    if isinstance(error, RetriesExhausted):
        if error.stopped_by in (StopReason.DO_NOT_RETRY, StopReason.REFUSED):
            return Failure(transient=False, do_not_retry=True)
        return Failure(transient=True)
    if isinstance(error, Rejected):
        return Failure(
            transient=error.reason in _RETRY_LATER_REASONS, retry_after=error.retry_after
        )
    return classify(error)


class MessagePolicy:
    """A consumer's rules for one queue's messages.

    - ``max_age``: a message older than this (since its first enqueue, by wall clock) is
      parked ``too_old`` (``None``: no age bound, only the envelope's ``valid-until``);
    - ``max_attempts``: attempts a message gets, broker redeliveries included (a message that
      kills its consumer is redelivered, so it cannot crash consumers forever);
    - ``min_useful``: a message with less time than this left is parked ``expired``;
    - ``max_skew``: how far a producer's clock may run ahead of this host's. A message
      enqueued further in the future than this is malformed; within it, its age counts from
      0. Keep hosts on NTP (milliseconds apart) and leave the default of 5 s;
    - ``on_malformed``: ``"park"`` (default) a message without a readable envelope, or
      ``"run"`` it as if enqueued now, with ``default_ttl`` (for queues with foreign
      producers);
    - ``default_ttl``: ``valid-until`` for ``"run"`` of a malformed message (``None``:
      ``max_age``);
    - ``backoff``: delay before a retried attempt (default: full jitter from 1 s, doubling, at
      most 60 s); a dependency's ``Retry-After`` is honoured when longer;
    - ``retry_budget``: retries the consumer may make per window, shared by all its messages
      (default `RetryBudget()`: 10% of messages plus 10 per second); when it is spent a
      transient failure is still retried, after the backoff's longest delay, so an outage
      does not turn into a requeue loop at full speed;
    - ``classifier``: the user's error classifier, consulted before `message_failure`.
    """

    def __init__(
        self,
        *,
        max_age: float | None = None,
        max_attempts: int = 5,
        min_useful: float = 0.0,
        max_skew: float = 5.0,
        on_malformed: Literal["park", "run"] = "park",
        default_ttl: float | None = None,
        backoff: Backoff | None = None,
        retry_budget: RetryBudget | None = None,
        classifier: FailureClassifier | None = None,
    ) -> None:
        if max_age is not None and not 0 < max_age < math.inf:
            raise ValueError("max_age must be None or positive and finite")
        if not 1 <= max_attempts <= 1_000_000:
            raise ValueError("max_attempts must be 1..1000000")
        if not 0 <= min_useful < math.inf:
            raise ValueError("min_useful must be finite and >= 0")
        if not 0 <= max_skew < math.inf:
            raise ValueError("max_skew must be finite and >= 0")
        if on_malformed not in ("park", "run"):
            raise ValueError('on_malformed must be "park" or "run"')
        if default_ttl is not None and not 0 < default_ttl < math.inf:
            raise ValueError("default_ttl must be None or positive and finite")
        self.max_age = max_age
        self.max_attempts = max_attempts
        self.min_useful = min_useful
        self.max_skew = max_skew
        self.on_malformed = on_malformed
        self.default_ttl = default_ttl
        self.backoff = backoff if backoff is not None else ExponentialBackoff(1.0, cap=60.0)
        self.retry_budget = retry_budget if retry_budget is not None else RetryBudget()
        self.classifier = classifier

    # -- before running -------------------------------------------------------------------
    def before(self, envelope: Envelope, now: float, *, redeliveries: int = 0) -> Run | Park:
        """Run or park a delivered message at wall-clock ``now``. ``redeliveries``: times the
        broker delivered this copy before without an acknowledgement (a consumer died)."""
        attempt = envelope.attempt + max(0, redeliveries)
        if envelope.enqueued_at > now + self.max_skew:
            ahead = envelope.enqueued_at - now
            return self.malformed(
                EnvelopeError(ENQUEUED_AT_FIELD, f"{ahead:.3f} s in the future (max_skew)"),
                now,
                envelope=envelope,
            )
        if attempt > self.max_attempts:
            return Park(
                ParkReason.ATTEMPTS,
                f"attempt {attempt} of at most {self.max_attempts}",
                envelope,
            )
        budget = self._budget(envelope, now)
        if budget is not None and budget <= self.min_useful:
            age = envelope.age(now)
            if self.max_age is not None and age >= self.max_age - self.min_useful:
                return Park(ParkReason.TOO_OLD, f"{age:.3f} s old (max_age)", envelope)
            return Park(ParkReason.EXPIRED, f"{-budget:.3f} s past its deadline", envelope)
        self.retry_budget.record_request()
        return Run(envelope, attempt, budget)

    def malformed(
        self, error: EnvelopeError, now: float, *, envelope: Envelope | None = None
    ) -> Run | Park:
        """The decision for a message whose envelope could not be read (``on_malformed``)."""
        if self.on_malformed == "park":
            return Park(ParkReason.MALFORMED, str(error), envelope)
        ttl = self.default_ttl if self.default_ttl is not None else self.max_age
        fresh = Envelope(
            enqueued_at=now,
            valid_until=None if ttl is None else now + ttl,
            attempt=envelope.attempt if envelope is not None else 1,
            idempotency_key=envelope.idempotency_key if envelope is not None else None,
        ).with_history(now, "malformed", str(error))
        self.retry_budget.record_request()
        return Run(fresh, fresh.attempt, self._budget(fresh, now))

    def _budget(self, envelope: Envelope, now: float) -> float | None:
        """Seconds the message may still run: to its ``valid-until`` and its ``max_age``."""
        left = envelope.remaining(now)
        if self.max_age is not None:
            by_age = self.max_age - envelope.age(now)
            left = by_age if left is None else min(left, by_age)
        return left

    # -- after a failure ------------------------------------------------------------------
    def failure(self, error: BaseException) -> Failure:
        """How ``error`` reads: the user's ``classifier`` first, then `message_failure`."""
        if self.classifier is not None:
            found = self.classifier(error)
            if found is not None:
                return found
        return message_failure(error)

    def after_failure(
        self, run: Run, error: BaseException, now: float, *, deadline_passed: bool = False
    ) -> RetryLater | Park:
        """Retry later or park, after the handler of ``run`` raised ``error`` at ``now``.
        ``deadline_passed``: the handler was cut at the message's budget."""
        envelope = run.envelope
        what = f"{type(error).__name__}: {error}"[:200]
        if deadline_passed or isinstance(error, DeadlineExceeded):
            return Park(ParkReason.EXPIRED, f"ran out of time: {what}", envelope)
        failure = self.failure(error)
        if not failure.transient or failure.do_not_retry:
            return Park(ParkReason.FAILED, what, envelope)
        if run.attempt >= self.max_attempts:
            return Park(ParkReason.ATTEMPTS, f"attempt {run.attempt}: {what}", envelope)
        exhausted = not self.retry_budget.try_acquire_retry()
        delay = self.backoff_ceiling() if exhausted else self.backoff.delay(run.attempt, 0.0)
        if failure.retry_after is not None and failure.retry_after > delay:
            delay = failure.retry_after
        budget = self._budget(envelope, now)
        if budget is not None and budget - delay <= self.min_useful:
            return Park(
                ParkReason.EXPIRED,
                f"would expire before a retry in {delay:.3f} s: {what}",
                envelope,
            )
        # (``run.attempt`` counts broker redeliveries as attempts too)
        following = replace(envelope.with_history(now, "retry", what), attempt=run.attempt + 1)
        return RetryLater(following, delay, what, budget_exhausted=exhausted)

    def backoff_ceiling(self) -> float:
        """The longest delay the backoff gives: its ``cap``, else its ceiling at the last
        attempt."""
        cap = getattr(self.backoff, "cap", None)
        if isinstance(cap, int | float) and 0 <= cap < math.inf:
            return float(cap)
        ceiling = getattr(self.backoff, "ceiling", None)
        return float(ceiling(self.max_attempts)) if callable(ceiling) else 60.0

    def __repr__(self) -> str:
        return (
            f"MessagePolicy(max_age={self.max_age}, max_attempts={self.max_attempts}, "
            f"on_malformed={self.on_malformed!r})"
        )


class BacklogBound:
    """A producer's bound on a durable queue: refuse new work (`brownout.Rejected`,
    ``backlog_full``, so a web request answers 503 instead of growing the backlog) while the
    queue holds more than ``max_depth`` messages or its oldest is older than ``max_age``
    seconds. Work of priority ``exempt`` or higher is never refused (``None``: none is).
    """

    def __init__(
        self,
        *,
        max_depth: int | None = None,
        max_age: float | None = None,
        exempt: Priority | None = None,
        retry_after: float = 1.0,
    ) -> None:
        if max_depth is None and max_age is None:
            raise ValueError("a BacklogBound needs max_depth, max_age or both")
        if max_depth is not None and max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        if max_age is not None and not 0 < max_age < math.inf:
            raise ValueError("max_age must be positive and finite")
        if not 0 <= retry_after < math.inf:
            raise ValueError("retry_after must be finite and >= 0")
        self.max_depth = max_depth
        self.max_age = max_age
        self.exempt = exempt
        self.retry_after = retry_after

    def over(self, depth: int | None, oldest_age: float | None) -> str | None:
        """Why a queue with this ``depth`` and ``oldest_age`` is over the bound, or ``None``.
        An unknown reading (``None``) is not over."""
        if self.max_depth is not None and depth is not None and depth >= self.max_depth:
            return f"{depth} messages queued (max_depth {self.max_depth})"
        if self.max_age is not None and oldest_age is not None and oldest_age >= self.max_age:
            return f"oldest message {oldest_age:.1f} s old (max_age {self.max_age:g} s)"
        return None

    def check(self, depth: int | None, oldest_age: float | None, priority: Priority) -> None:
        """Raise `brownout.Rejected` (``backlog_full``) when over the bound, unless
        ``priority`` is exempt."""
        why = self.over(depth, oldest_age)
        if why is None or (self.exempt is not None and priority >= self.exempt):
            return
        raise Rejected(Reason.BACKLOG_FULL, why, retry_after=self.retry_after)

    def __repr__(self) -> str:
        return f"BacklogBound(max_depth={self.max_depth}, max_age={self.max_age})"
