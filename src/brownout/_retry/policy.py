"""`RetryPolicy`: bounded attempts, one retry layer, under a budget and the deadline (R1-R5).

For each failed attempt the policy asks, in order:

1. Is the failure transient (`classify` or the user's classifier)? If not, the original error
   is raised unchanged (validation errors, FAILED_PRECONDITION, local refusals), unless an
   earlier attempt of a mutation was sent and never answered: then `UnknownOutcome` (D6).
2. Did the dependency say "do not retry" (``brownout-retry: never``, negative gRPC pushback,
   or a lower layer's `RetriesExhausted`)? Then stop.
3. Is resending safe? Idempotent calls, calls carrying an idempotency key, and requests that
   were certainly never sent may be resent; anything else that was sent is not retried.
4. Are attempts left? Does ``backoff + expected attempt time + reserve`` fit in the time left
   on the deadline (R4)? Is a concurrent-retry slot free (A6)? Does the budget allow it (R3)?

When it stops on a transient failure it raises `RetriesExhausted` (a `Rejected` with
``Reason.DO_NOT_RETRY``), so the edge tells *its* callers not to retry (R1). A mutation whose
last attempt was sent but never answered raises `UnknownOutcome` with its idempotency key
instead (D6). Every attempt runs with the same idempotency key and its attempt number in the
request context (R5), so outbound headers carry both.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from .._clock import Clock, default_clock
from .._context import DeadlineScope, RequestContext, attach, current, current_deadline, detach
from .._errors import Rejected, UnknownOutcome
from .._settings import from_config
from ..events import AttemptRetried, EventHub, OutcomeUnknown, RetryBudgetExhausted, hub
from .backoff import Backoff, ExponentialBackoff
from .budget import RetryAllowance, RetryBudget
from .classify import Failure, FailureClassifier, RetriesExhausted, StopReason, classify
from .settings import retry_from

__all__ = [
    "AttemptFn",
    "BlockingAttemptFn",
    "RetryPolicy",
    "RetrySlots",
    "enter_attempt",
    "exit_attempt",
    "new_idempotency_key",
]

T = TypeVar("T")

AttemptFn = Callable[[int, "str | None"], Awaitable[T]]
"""Runs one attempt: ``(attempt_number, idempotency_key) -> awaitable result``."""


BlockingAttemptFn = Callable[[int, "str | None"], T]
"""Runs one attempt on the calling thread: ``(attempt_number, idempotency_key) -> result``."""


class _Retrying:
    """Where one call's retries stand: what both retry loops read and the decisions update."""

    __slots__ = (
        "attempt",
        "error",
        "failure",
        "floor",
        "idempotent",
        "key",
        "last_error",
        "last_failure",
        "previous_delay",
        "reserve",
        "slots",
        "source",
        "unknown",
    )

    def __init__(
        self,
        idempotent: bool,
        key: str | None,
        source: str,
        reserve: float,
        floor: float,
        slots: RetrySlots | None,
    ) -> None:
        self.idempotent = idempotent
        self.key = key
        self.source = source
        self.reserve = reserve
        self.floor = floor
        self.slots = slots
        self.attempt = 1
        self.previous_delay = 0.0
        self.error: Exception | None = None  # the failure being decided on
        self.failure: Failure | None = None
        self.last_error: Exception | None = None  # the last transient one
        self.last_failure: Failure | None = None
        self.unknown = False  # an attempt was sent and never answered: maybe applied (D6)

    def begin(self, delay: float) -> int:
        """The retry's attempt number, once its wait of ``delay`` is over."""
        self.previous_delay = delay
        self.attempt += 1
        return self.attempt


def new_idempotency_key() -> str:
    """A fresh idempotency key: 128 random bits from `secrets`, as 32 hex digits.

    Each key is drawn on its own, so a key seen by one dependency says nothing about the
    keys sent to another (a per-process prefix and a shared counter did). About 0.4 us.
    """
    return secrets.token_hex(16)


def enter_attempt(attempt: int, key: str | None) -> contextvars.Token[RequestContext] | None:
    """Set the attempt number and idempotency key in the request context (R5).

    A cheaper equivalent of ``request(attempt=..., idempotency_key=...)`` for the per-attempt
    hot path (no deadline change, no cancellation). Returns the token for `exit_attempt`, or
    ``None`` when the context already says so.
    """
    parent = current()
    if parent.attempt > 1:
        # The request is itself a retry (I1): its calls are attempts n, n + 1, ... downstream.
        attempt += parent.attempt - 1
    if parent.attempt == attempt and parent.idempotency_key == key:
        return None
    return attach(parent.replace(attempt=attempt, idempotency_key=key))


def exit_attempt(token: contextvars.Token[RequestContext] | None) -> None:
    """Undo `enter_attempt`."""
    if token is not None:
        detach(token)


class RetrySlots:
    """A cap on how many calls to one dependency may be retrying at once (A6).

    Like a proxy's ``max_retries`` circuit breaker: a retry takes a slot from the moment it is
    decided until its attempt finishes; when none is free the retry is not sent.
    """

    __slots__ = ("_lock", "in_use", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self.in_use = 0
        self._lock = threading.Lock()  # taken by threads of a blocking Dependency too

    def try_take(self) -> bool:
        with self._lock:
            if self.in_use >= self.limit:
                return False
            self.in_use += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.in_use -= 1


class RetryPolicy:
    """Retry transient failures a bounded number of times, under a budget and the deadline.

    ``attempts`` counts the original attempt (``attempts=3``: at most 2 retries;
    ``attempts=1``: this layer never retries and raises original errors unchanged).
    ``budget`` is shared by all calls through this policy (default: ``RetryBudget()``).
    ``classifier`` is consulted before the default `classify` (return ``None`` to defer).
    ``expected_attempt_time`` fixes the attempt-time estimate used for the deadline check;
    by default it is a moving average of observed attempt durations.
    ``idempotency_keys``: generate a key per logical call for mutations that have none, so
    they can be retried and reconciled; turn off if the dependency does not deduplicate.
    ``max_pushback``: the longest server pushback (``Retry-After``, ``grpc-retry-pushback-ms``)
    this layer waits out; a longer one stops retrying (`StopReason.PUSHBACK`) instead of holding
    the call, which matters when no deadline bounds the wait.
    """

    __slots__ = (
        "_avg_attempt",
        "_clock",
        "_events",
        "attempts",
        "backoff",
        "budget",
        "classifier",
        "expected_attempt_time",
        "idempotency_keys",
        "max_concurrent_retries",
        "max_pushback",
        "name",
        "reserve",
        "slots",
    )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, section: str = "retry", **code: Any
    ) -> RetryPolicy:
        """The policy described by table ``section`` of ``config`` (`brownout.load_config`):
        ``[retry.budget]`` a `RetryBudget`, ``backoff`` a name or a table with ``kind``. The
        classifier, clock and events are keyword arguments. Raises `ConfigError`."""
        return from_config(config, section, lambda sec: retry_from(cls, sec, code))

    def __init__(
        self,
        attempts: int = 3,
        *,
        budget: RetryAllowance | None = None,
        backoff: Backoff | None = None,
        classifier: FailureClassifier | None = None,
        expected_attempt_time: float | None = None,
        reserve: float = 0.0,
        max_concurrent_retries: int | None = None,
        idempotency_keys: bool = True,
        max_pushback: float = 30.0,
        name: str = "retry",
        clock: Clock | None = None,
        events: EventHub = hub,
    ) -> None:
        if not 1 <= attempts < math.inf:  # (NaN too)
            raise ValueError("attempts must be >= 1")
        if not max_pushback >= 0:  # also refuses NaN
            raise ValueError("max_pushback must be >= 0")
        # A NaN would pass every "does the retry fit the deadline" check (R4).
        if not 0 <= reserve < math.inf or (
            expected_attempt_time is not None and not 0 <= expected_attempt_time < math.inf
        ):
            raise ValueError("reserve and expected_attempt_time must be finite and >= 0")
        self.attempts = attempts
        self.max_pushback = max_pushback
        self._clock = clock or default_clock()
        self.budget: RetryAllowance = budget if budget is not None else RetryBudget(clock=clock)
        self.backoff: Backoff = backoff if backoff is not None else ExponentialBackoff()
        self.classifier = classifier
        self.expected_attempt_time = expected_attempt_time
        self.reserve = reserve
        self.max_concurrent_retries = max_concurrent_retries
        self.slots = (
            RetrySlots(max_concurrent_retries) if max_concurrent_retries is not None else None
        )
        self.idempotency_keys = idempotency_keys
        self.name = name
        self._events = events
        self._avg_attempt = 0.0

    # -- classification -------------------------------------------------------------------

    def classify(self, error: BaseException) -> Failure:
        """The user's classifier first, then the default `classify`."""
        if self.classifier is not None:
            verdict = self.classifier(error)
            if verdict is not None:
                return verdict
        return classify(error)

    def expected(self, floor: float = 0.0) -> float:
        """The attempt-time estimate used to decide whether a retry fits the deadline."""
        estimate = (
            self.expected_attempt_time
            if self.expected_attempt_time is not None
            else self._avg_attempt
        )
        return estimate if estimate > floor else floor

    def _observe(self, duration: float) -> None:
        # Exponentially weighted moving average; alpha 0.2 follows a slowdown within ~5 calls.
        # Seeded with the first observation: starting from 0 would claim a fresh policy's
        # attempts take a fifth of what it just measured, and send retries that cannot fit (R4).
        avg = self._avg_attempt
        self._avg_attempt = duration if avg == 0.0 else avg + 0.2 * (duration - avg)

    # -- running ------------------------------------------------------------------------

    async def call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        idempotent: bool = False,
        idempotency_key: str | None = None,
        attempt_timeout: float | None = None,
        **kwargs: Any,
    ) -> T:
        """Await ``fn(*args, **kwargs)`` under this policy.

        Each attempt runs in a request scope with its attempt number and idempotency key and,
        given ``attempt_timeout``, a per-attempt deadline that cancels it at expiry (D5).
        A call is a mutation unless ``idempotent=True``.
        """
        attempt_fn = functools.partial(_plain_attempt, fn, args, kwargs, attempt_timeout)
        return await self.execute(
            attempt_fn, idempotent=idempotent, idempotency_key=idempotency_key
        )

    async def execute(
        self,
        attempt_fn: AttemptFn[T],
        *,
        idempotent: bool = False,
        idempotency_key: str | None = None,
        source: str | None = None,
        reserve: float | None = None,
        min_attempt_time: float = 0.0,
        slots: RetrySlots | None = None,
    ) -> T:
        """Run ``attempt_fn(attempt, key)`` until it succeeds or the policy stops.

        The building block for `Dependency` and adapters: ``attempt_fn`` runs one attempt
        with its own guards. ``reserve`` overrides the policy's, ``min_attempt_time`` floors
        the attempt-time estimate, ``slots`` overrides the policy's concurrent-retry cap.
        """
        key = idempotency_key
        if key is None and not idempotent:
            key = self._call_key()
        clock = self._clock
        started = clock.now()
        try:
            result = await attempt_fn(1, key)
        except Exception as error:
            self._first_failed(error, started)
            state = _Retrying(
                idempotent,
                key,
                source or self.name,
                self.reserve if reserve is None else reserve,
                min_attempt_time,
                slots if slots is not None else self.slots,
            )
            return await self._retry(attempt_fn, error, state)
        # `_succeeded`, inline: the common case, kept free of extra frames.
        budget = self.budget
        budget.record_request()
        self._observe(clock.now() - started)
        budget.record_success()
        return result

    def execute_blocking(
        self,
        attempt_fn: BlockingAttemptFn[T],
        *,
        idempotent: bool = False,
        idempotency_key: str | None = None,
        source: str | None = None,
        reserve: float | None = None,
        min_attempt_time: float = 0.0,
        slots: RetrySlots | None = None,
    ) -> T:
        """`execute` for a blocking ``attempt_fn``, on the calling thread: the same decisions,
        the backoff slept with ``time.sleep`` (or the clock's own ``sleep``: a `ManualClock`
        moves on instead of waiting). Safe to call from many threads at once."""
        key = idempotency_key
        if key is None and not idempotent:
            key = self._call_key()
        clock = self._clock
        started = clock.now()
        try:
            result = attempt_fn(1, key)
        except Exception as error:
            self._first_failed(error, started)
            state = _Retrying(
                idempotent,
                key,
                source or self.name,
                self.reserve if reserve is None else reserve,
                min_attempt_time,
                slots if slots is not None else self.slots,
            )
            return self._retry_blocking(attempt_fn, error, state)
        # `_succeeded`, inline: the common case, kept free of extra frames.
        budget = self.budget
        budget.record_request()
        self._observe(clock.now() - started)
        budget.record_success()
        return result

    async def _retry(self, attempt_fn: AttemptFn[T], error: Exception, state: _Retrying) -> T:
        while True:
            delay = self._next_delay(state, error)
            slots = self._take_retry(state, error, delay)
            try:
                if delay > 0.0:
                    await asyncio.sleep(delay)
                number = state.begin(delay)
                started = self._clock.now()
                try:
                    result = await attempt_fn(number, state.key)
                except Exception as next_error:
                    self._retry_failed(next_error, started)
                    error = next_error
                    continue
                self._succeeded(started, original=False)
                return result
            finally:
                if slots is not None:
                    slots.release()

    def _retry_blocking(
        self, attempt_fn: BlockingAttemptFn[T], error: Exception, state: _Retrying
    ) -> T:
        sleep = getattr(self._clock, "sleep", time.sleep)
        while True:
            delay = self._next_delay(state, error)
            slots = self._take_retry(state, error, delay)
            try:
                if delay > 0.0:
                    sleep(delay)
                number = state.begin(delay)
                started = self._clock.now()
                try:
                    result = attempt_fn(number, state.key)
                except Exception as next_error:
                    self._retry_failed(next_error, started)
                    error = next_error
                    continue
                self._succeeded(started, original=False)
                return result
            finally:
                if slots is not None:
                    slots.release()

    # -- the decisions both loops share ---------------------------------------------------

    def _call_key(self) -> str | None:
        """The idempotency key every attempt of a mutation without one of its own carries:
        the request's (the edge's, I1), so a retried request repeats its effects' keys
        downstream; a fresh one per logical call otherwise."""
        key = current().idempotency_key
        if key is None and self.idempotency_keys:
            key = new_idempotency_key()
        return key

    def _succeeded(self, started: float, *, original: bool = True) -> None:
        budget = self.budget
        if original:
            budget.record_request()
        self._observe(self._clock.now() - started)
        budget.record_success()

    def _first_failed(self, error: Exception, started: float) -> None:
        if not isinstance(error, Rejected):
            # An original deposits in the budget once it was tried: one refused here (an
            # open breaker, a throttle, no time left) never reached the dependency, and
            # counting it would leave retry tokens for the wave after the outage (R3).
            # Local refusals say nothing of attempt time either.
            self.budget.record_request()
            self._observe(self._clock.now() - started)

    def _retry_failed(self, error: Exception, started: float) -> None:
        if not isinstance(error, Rejected):
            self._observe(self._clock.now() - started)

    def _stop(self, state: _Retrying, why: StopReason, *, previous: bool = False) -> Exception:
        """Give up on the current failure (``previous``: on the one before it)."""
        if previous:
            error, failure, attempts = state.last_error, state.last_failure, state.attempt - 1
        else:
            error, failure, attempts = state.error, state.failure, state.attempt
        assert error is not None
        assert failure is not None
        return self._give_up(
            error, failure, attempts, why, state.idempotent, state.key, state.source, state.unknown
        )

    def _next_delay(self, state: _Retrying, error: Exception) -> float:
        """The wait before retrying ``error``, or raise what the caller gets instead."""
        failure = self.classify(error)
        state.error, state.failure = error, failure
        attempt = state.attempt
        budget = self.budget
        if not failure.transient:
            if (
                attempt > 1
                and isinstance(error, Rejected)
                and not failure.do_not_retry
                and state.last_failure is not None
            ):
                # A local guard refused the retry: the caller needs the real failure.
                raise self._stop(state, StopReason.REFUSED, previous=True) from state.last_error
            if failure.do_not_retry:
                budget.record_failure()
                raise self._stop(state, StopReason.DO_NOT_RETRY) from error
            if state.unknown and not state.idempotent:
                # An error answer to a retry (409 "still in progress", a 500) is not an
                # answer to the attempt that was lost: that one may have been applied (D6).
                raise self._unknown(state.key, state.source) from error
            raise error
        budget.record_failure()
        state.last_error, state.last_failure = error, failure
        state.unknown = state.unknown or failure.outcome_unknown
        if failure.do_not_retry:
            raise self._stop(state, StopReason.DO_NOT_RETRY) from error
        if not (state.idempotent or state.key is not None or not failure.sent):
            # Resending a possibly-applied, unkeyed mutation could apply it twice (R2).
            if failure.outcome_unknown:
                raise self._unknown(None, state.source) from error
            raise error
        if attempt >= self.attempts:
            if self.attempts == 1 and (state.idempotent or not failure.outcome_unknown):
                raise error  # not a retry layer: the layer above may retry (R1)
            raise self._stop(state, StopReason.ATTEMPTS) from error
        delay = self.backoff.delay(attempt, state.previous_delay)
        if failure.retry_after is not None and failure.retry_after > delay:
            if not failure.retry_after <= self.max_pushback:
                # "Come back in an hour": not a wait to hold a call (and its task) for.
                raise self._stop(state, StopReason.PUSHBACK) from error
            delay = failure.retry_after
        deadline = current_deadline()
        if deadline is not None:
            left = deadline.at - deadline.clock.now()
            # Written so that a NaN anywhere (a config, a pushback) stops rather than retries.
            if not delay + self.expected(state.floor) + state.reserve <= left:
                raise self._stop(state, StopReason.DEADLINE) from error
        return delay

    def _take_retry(self, state: _Retrying, error: Exception, delay: float) -> RetrySlots | None:
        """Take a concurrent-retry slot and the budget's price for one retry, or stop; the
        slot returned is the caller's to release once the retry's attempt is over."""
        slots = state.slots
        if slots is not None and not slots.try_take():
            raise self._stop(state, StopReason.CONCURRENT_RETRIES) from error
        events = self._events
        attempt = state.attempt
        if not self.budget.try_acquire_retry():
            if slots is not None:
                slots.release()
            if events.enabled:
                ctx = current()
                events.emit(
                    RetryBudgetExhausted(
                        self._clock.now(),
                        state.source,
                        ctx.operation,
                        ctx.priority,
                        ctx.caller,
                        attempt + 1,
                    )
                )
            raise self._stop(state, StopReason.BUDGET) from error
        if events.enabled:
            ctx = current()
            events.emit(
                AttemptRetried(
                    self._clock.now(),
                    state.source,
                    ctx.operation,
                    ctx.priority,
                    ctx.caller,
                    attempt + 1,
                    type(error).__name__,
                    delay,
                )
            )
        return slots

    def _give_up(
        self,
        error: Exception,
        failure: Failure,
        attempts: int,
        why: StopReason,
        idempotent: bool,
        key: str | None,
        source: str,
        unknown: bool = False,
    ) -> Exception:
        # Once an attempt may have been applied, only an answer settles it: a later attempt
        # that was never sent, or was refused, says nothing about the earlier one (D6).
        if not idempotent and (unknown or failure.outcome_unknown):
            return self._unknown(key, source)
        return RetriesExhausted(error, attempts=attempts, stopped_by=why)

    def _unknown(self, key: str | None, source: str | None) -> UnknownOutcome:
        if self._events.enabled:
            ctx = current()
            self._events.emit(
                OutcomeUnknown(
                    self._clock.now(),
                    source or self.name,
                    ctx.operation,
                    ctx.priority,
                    ctx.caller,
                    key,
                )
            )
        return UnknownOutcome(key)

    def __repr__(self) -> str:
        return f"RetryPolicy(attempts={self.attempts}, budget={self.budget!r})"


async def _plain_attempt(
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    attempt_timeout: float | None,
    attempt: int,
    key: str | None,
) -> T:
    token = enter_attempt(attempt, key)
    try:
        if attempt_timeout is None:
            return await fn(*args, **kwargs)
        async with DeadlineScope(attempt_timeout, None):
            return await fn(*args, **kwargs)
    finally:
        exit_attempt(token)
