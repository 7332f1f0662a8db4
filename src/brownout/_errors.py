"""The errors brownout raises, each carrying a machine-readable reason.

One refusal type, `Rejected`, with a `Reason`; adapters map reasons to status codes (429 for
quota, 503 for capacity; gRPC RESOURCE_EXHAUSTED vs UNAVAILABLE) and to RFC 9457 problem
bodies. `DeadlineExceeded` is a `TimeoutError`, so code that already handles timeouts keeps
working.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "AlreadyApplied",
    "BrownoutError",
    "DeadlineExceeded",
    "FailClosed",
    "HeaderError",
    "Reason",
    "Rejected",
    "UnknownOutcome",
]


class Reason(StrEnum):
    """Why work was refused or stopped. The value is the stable, machine-readable name."""

    QUEUE_FULL = "queue_full"
    """The wait queue was at its size bound."""
    QUEUE_TIMEOUT = "queue_timeout"
    """The work waited longer than the queue's age bound (or CoDel's target)."""
    DEADLINE_TOO_SHORT = "deadline_too_short"
    """Too little time is left for the work to be useful; refused before starting."""
    DEADLINE_EXPIRED = "deadline_expired"
    """The deadline passed before the work could start."""
    OVERLOADED = "overloaded"
    """The service is at its concurrency limit or shedding this priority."""
    FAIR_SHARE = "fair_share"
    """One caller already holds its maximum share of the queue."""
    QUOTA = "quota"
    """The caller exceeded its rate or quota (HTTP 429)."""
    BREAKER_OPEN = "breaker_open"
    """A circuit breaker is open for the dependency."""
    BUDGET_EXHAUSTED = "budget_exhausted"
    """The retry budget has no tokens left."""
    THROTTLED = "throttled"
    """Client-side adaptive throttling refused to send."""
    DEPENDENCY_UNAVAILABLE = "dependency_unavailable"
    """An authoritative dependency failed and the guard fails closed (G4)."""
    DO_NOT_RETRY = "do_not_retry"
    """A downstream service already retried or refused and asked callers not to retry."""
    OUTCOME_UNKNOWN = "outcome_unknown"
    """A mutation was sent downstream and never answered: reconcile by idempotency key (D6)."""
    BACKLOG_FULL = "backlog_full"
    """The durable queue the work would go to is over its declared depth or age bound."""

    @property
    def is_quota(self) -> bool:
        """True for refusals that are the caller's fault (429), not the service's (503)."""
        return self is Reason.QUOTA


class BrownoutError(Exception):
    """Base class of every error brownout raises on purpose."""


class Rejected(BrownoutError):
    """Work refused (or stopped) by a brownout policy, with the reason why.

    ``retry_after`` is a useful estimate in seconds of when trying again may succeed, or
    ``None`` when there is no useful estimate (then no Retry-After is sent).
    """

    __slots__ = ("detail", "reason", "retry_after")

    def __init__(
        self,
        reason: Reason,
        detail: str = "",
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
        self.retry_after = retry_after


class DeadlineExceeded(BrownoutError, TimeoutError):
    """The operation's deadline expired; the enclosed work was cancelled."""


class FailClosed(Rejected):
    """An authoritative source is unavailable and its guard refuses to guess (G4)."""

    def __init__(self, what: str, detail: str = "") -> None:
        super().__init__(Reason.DEPENDENCY_UNAVAILABLE, detail or f"{what} is unavailable")
        self.what = what


class UnknownOutcome(BrownoutError):
    """A mutation was sent but its result is unknown (timeout or lost connection) (D6).

    Cancellation does not undo a side effect: reconcile by ``idempotency_key``.
    """

    def __init__(self, idempotency_key: str | None, detail: str = "") -> None:
        super().__init__(detail or f"outcome unknown for idempotency key {idempotency_key!r}")
        self.idempotency_key = idempotency_key
        self.recorded: bool | None = None
        """Whether a `Dependency` recorded it in its outcome ledger: ``True`` (a `Reconciler`
        will find it), ``False`` (the ledger write failed, see `LedgerWriteFailed`: only the
        caller holds the key now) or ``None`` (no ledger)."""


class AlreadyApplied(BrownoutError):
    """A keyed transaction found its idempotency key already committed: the work it would do
    was applied before (by an earlier attempt whose answer may have been lost), so nothing
    ran now (D6). Treat it as success: answer what the first attempt answered."""

    def __init__(self, idempotency_key: str, detail: str = "") -> None:
        super().__init__(detail or f"idempotency key {idempotency_key!r} was already applied")
        self.idempotency_key = idempotency_key


class HeaderError(BrownoutError, ValueError):
    """A propagation header (grpc-timeout, budget, signature) could not be parsed or verified.

    ``problem`` names what was wrong in a few fixed words (``"malformed"``, ``"not ascii"``,
    ``"unknown key"``, ``"bad signature"``, ``"stale"``, ``"no audience"``, ``"wrong audience"``):
    what `DeadlineHeaderIgnored` reports and metrics label. The message may quote the value; a
    label must not, or forged headers would each make a new one.
    """

    def __init__(self, detail: str, problem: str = "malformed") -> None:
        super().__init__(detail)
        self.problem = problem
