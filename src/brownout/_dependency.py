"""`Dependency`: one object per downstream service composing every outbound guard.

``await payments.call(charge, order_id, idempotent=True)`` runs each attempt as follows:

1. per-attempt budget ``call_budget(timeout, reserve=, min_useful=)`` (D4): too little time
   left refuses before anything is sent;
2. ``max_active`` (when there is no bulkhead), circuit breaker, client-side throttle: cheap
   local refusals;
3. the attempt runs inside ``request(deadline=budget, attempt=n, idempotency_key=key)``, so
   it is cancelled when its budget expires (D5) and adapters send the remaining budget,
   attempt number and idempotency key; the bulkhead (if any) admits it inside that scope, so
   queueing spends the attempt's own budget;
4. the outcome feeds the breaker and the throttle; failures go to the `RetryPolicy`, which
   retries under its budget, the deadline and ``max_concurrent_retries`` (A6).

A mutation whose outcome is unknown raises `UnknownOutcome` and is written to the ``ledger``
(D6) for a `Reconciler` to resolve later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

from ._admission.bulkhead import Bulkhead
from ._admission.protocols import AdmitsWork, AdmitsWorkBlocking
from ._admission.settings import bulkhead_from
from ._admission.thread_bulkhead import ThreadBulkhead
from ._clock import Clock, default_clock, loop_or_none
from ._context import DeadlineScope, current_deadline
from ._degrade.drill import dependency_call, fallback_scope
from ._errors import DeadlineExceeded, Reason, Rejected, UnknownOutcome
from ._retry.breaker import CircuitBreaker
from ._retry.idempotency import OutcomeLedger, ledger_name, not_recorded, record_shielded
from ._retry.outbound import ATTEMPT_EDGE, attempt_budget
from ._retry.policy import RetryPolicy, RetrySlots, enter_attempt, exit_attempt
from ._retry.settings import breaker_from, retry_from, throttle_from
from ._retry.throttle import ClientThrottle
from ._settings import Section, build_in, from_config
from .events import EventHub, LedgerWriteFailed, RequestShed, hub

__all__ = ["Dependency"]

T = TypeVar("T")

_log = logging.getLogger("brownout.dependency")


class Dependency:
    """Everything brownout applies to calls to one downstream service.

    ``timeout`` is the normal per-attempt timeout (``None``: only the request's deadline);
    ``reserve`` is kept back from the remaining deadline for the response path; a call with
    less than ``min_useful`` left is refused before it is sent (D4). ``retry`` defaults to a
    policy that never retries (``attempts=1``) but still keys mutations.
    """

    __slots__ = (
        "_active_lock",
        "_calls",
        "_clock",
        "_events",
        "breaker",
        "bulkhead",
        "ledger",
        "max_active",
        "min_useful",
        "name",
        "reserve",
        "retry",
        "retry_slots",
        "throttle",
        "timeout",
    )

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        name: str,
        *,
        section: str | tuple[str, ...] | None = None,
        **code: Any,
    ) -> Dependency:
        """Dependency ``name`` described by table ``section`` of ``config`` (default
        ``[dependencies.<name>]``): timeouts, ``[..retry]`` a `RetryPolicy`, ``[..bulkhead]``,
        ``[..breaker]`` and ``[..throttle]``. The ledger, clock, events are keyword
        arguments. Raises `ConfigError`."""
        where = ("dependencies", name) if section is None else section

        def build(sec: Section) -> Dependency | None:
            built: dict[str, Any] = {}
            if sec.has("retry"):
                built["retry"] = retry_from(RetryPolicy, sec.table("retry"), {"name": name})
            if sec.has("bulkhead"):
                built["bulkhead"] = bulkhead_from(sec.table("bulkhead"), name)
            if sec.has("breaker"):
                built["breaker"] = breaker_from(sec.table("breaker"), name)
            if sec.has("throttle"):
                built["throttle"] = throttle_from(sec.table("throttle"), name)
            parts = ("retry", "bulkhead", "breaker", "throttle")
            return build_in(sec, cls, code, skip=("name", *parts), built={"name": name, **built})

        return from_config(config, where, build)

    def __init__(
        self,
        name: str,
        *,
        timeout: float | None = None,
        reserve: float = 0.0,
        min_useful: float = 0.0,
        retry: RetryPolicy | None = None,
        breaker: CircuitBreaker | None = None,
        throttle: ClientThrottle | None = None,
        bulkhead: AdmitsWork | AdmitsWorkBlocking | None = None,
        max_active: int | None = None,
        max_concurrent_retries: int | None = None,
        ledger: OutcomeLedger | None = None,
        clock: Clock | None = None,
        events: EventHub = hub,
    ) -> None:
        if timeout is not None and not timeout > 0:  # also refuses NaN
            # A zero budget would "send" nothing and report an unknown outcome for it.
            raise ValueError("timeout must be > 0 (or None)")
        if not (0.0 <= reserve < math.inf and 0.0 <= min_useful < math.inf):  # (and NaN)
            # A negative reserve would give the call more time than the request has left.
            raise ValueError("reserve and min_useful must be finite and >= 0")
        if timeout is not None and timeout < min_useful:
            # Every call with a deadline would be refused (its budget is at most ``timeout``)
            # and every call without one sent with less than it needs (D4).
            raise ValueError("timeout must be >= min_useful")
        if max_active is not None and max_active < 0:
            raise ValueError("max_active must be >= 0 (or None)")
        self.name = name
        self.timeout = timeout
        self.reserve = reserve
        self.min_useful = min_useful
        self._clock = clock or default_clock()
        self._events = events
        self.retry = retry if retry is not None else RetryPolicy(1, name=name, events=events)
        self.breaker = breaker
        self.throttle = throttle
        self.bulkhead = bulkhead
        self.max_active = max_active
        self.retry_slots = (
            RetrySlots(max_concurrent_retries) if max_concurrent_retries is not None else None
        )
        self.ledger = ledger
        # One entry per attempt in flight: append and pop are atomic, so the count needs a
        # lock only to check ``max_active`` and count in one step.
        self._calls: list[None] = []
        self._active_lock = threading.Lock()

    @property
    def active(self) -> int:
        """Attempts in flight right now (counted whether or not ``max_active`` is set)."""
        return len(self._calls)

    def gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Live state for exporters (`brownout.Stats.watch`): retry-budget balance, breaker
        state and the bulkhead's gauges. Read at scrape time, never on the request path."""
        labels = {"source": self.name}
        budget = self.retry.budget
        available = getattr(budget, "available", None)
        if callable(available):
            yield ("retry_budget_balance", labels, float(available()))
        else:
            tokens = getattr(budget, "tokens", None)
            if callable(tokens):
                yield ("retry_budget_balance", labels, float(tokens()))
        if self.breaker is not None:
            yield from self.breaker.gauges()
        bulkhead_gauges = getattr(self.bulkhead, "gauges", None)
        if callable(bulkhead_gauges):
            yield from bulkhead_gauges()

    async def call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        idempotent: bool = False,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T:
        """Await ``fn(*args, **kwargs)`` under this dependency's guards and retry policy.

        A call is a mutation unless ``idempotent=True``: it gets an idempotency key (yours, or
        a generated one) that is the same on every attempt. Raises `Rejected` for local
        refusals, `RetriesExhausted` when retrying gave up (callers upstream must not retry),
        `UnknownOutcome` for a mutation that was sent and never answered, or the original
        error when it is not retryable.
        """

        sent = False  # the current attempt of a mutation reached ``fn``
        lost = False  # an attempt of this mutation was sent and never answered (D6)
        lost_key: str | None = None

        async def sending(*a: Any, **kw: Any) -> T:
            nonlocal sent
            sent = True
            return await fn(*a, **kw)

        async def attempt(number: int, key: str | None) -> T:
            nonlocal sent, lost, lost_key
            if idempotent:
                return await self._attempt(fn, args, kwargs, number, key)
            sent, lost_key = False, key
            try:
                return await self._attempt(sending, args, kwargs, number, key)
            except asyncio.CancelledError:
                lost = lost or sent
                raise
            except Exception as error:
                lost = lost or (sent and self.retry.classify(error).outcome_unknown)
                raise

        try:
            return await self.retry.execute(
                attempt,
                idempotent=idempotent,
                idempotency_key=idempotency_key,
                source=self.name,
                # What every attempt keeps back (see `_attempt`): a retry whose backoff leaves
                # less than that would wait out the deadline and never be sent (R4).
                reserve=self._kept_back(),
                min_attempt_time=self.min_useful,
                slots=self.retry_slots,
            )
        except UnknownOutcome as unknown:
            if self.ledger is not None and unknown.idempotency_key is not None:
                await self._record_unknown(self.ledger, unknown.idempotency_key, unknown)
            raise
        except asyncio.CancelledError as cancelled:
            # Cancelled with a mutation sent and unanswered: the request's deadline fired in
            # the same loop iteration as the attempt's (a loop stalled past the reserve), or
            # the caller went away. Cancelling did not undo it: still an unknown outcome (D6).
            if lost:
                outcome = self.retry._unknown(lost_key, self.name)
                outcome.__cause__ = cancelled
                if self.ledger is not None and lost_key is not None:
                    await self._record_unknown(self.ledger, lost_key, outcome)
            raise
        except Rejected as refused:
            fallback = self._fallback_for(refused)
            if fallback is None:
                raise
            # Drills check that the fallback never calls the dependency it replaces (G3).
            with fallback_scope(f"breaker:{self.name}"):
                result: T = await fallback(refused)
            return result

    def call_blocking(
        self,
        fn: Callable[..., T],
        *args: Any,
        idempotent: bool = False,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T:
        """`call` for blocking code: ``fn(*args, **kwargs)`` on the calling thread, under the
        same guards, budget and retry decisions (a `RetryPolicy.execute_blocking`).

        Each attempt runs with its budget as the context's deadline (``brownout.remaining()``)
        and cannot be cancelled: ``fn`` must keep to that time (the requests and urllib3
        adapters set their socket timeouts from it). Safe from many threads at once. A
        ``bulkhead`` admits each attempt as on the async path, blocking while it is queued: a
        `ThreadBulkhead` (anything whose ``admit()`` is a ``with`` block); an asyncio
        `Bulkhead` raises `TypeError`. The ledger write of an unknown outcome and a breaker
        fallback, both coroutines, run to the end on the process's one private event loop
        (a ``redis.asyncio`` client made for that ledger is used on that loop only).
        """
        bulkhead = self.bulkhead
        if isinstance(bulkhead, Bulkhead) and not isinstance(bulkhead, ThreadBulkhead):
            raise TypeError(
                f"{self.name}: call_blocking cannot use an asyncio Bulkhead (it admits on an"
                " event loop); give the dependency a ThreadBulkhead, or cap threads with"
                " max_active"
            )
        try:
            return self.retry.execute_blocking(
                functools.partial(self._attempt_blocking, fn, args, kwargs),
                idempotent=idempotent,
                idempotency_key=idempotency_key,
                source=self.name,
                reserve=self._kept_back(),
                min_attempt_time=self.min_useful,
                slots=self.retry_slots,
            )
        except UnknownOutcome as unknown:
            if self.ledger is not None and unknown.idempotency_key is not None:
                self._record_unknown_blocking(self.ledger, unknown.idempotency_key, unknown)
            raise
        except Rejected as refused:
            fallback = self._fallback_for(refused)
            if fallback is None:
                raise
            with fallback_scope(f"breaker:{self.name}"):
                answer: T = _run_to_end(fallback(refused))
            return answer

    def _fallback_for(self, refused: Rejected) -> Callable[[Rejected], Awaitable[Any]] | None:
        """The breaker's fallback when ``refused`` is the breaker's refusal."""
        breaker = self.breaker
        if refused.reason is Reason.BREAKER_OPEN and breaker is not None:
            return breaker.fallback
        return None

    def _record_unknown_blocking(
        self, ledger: OutcomeLedger, key: str, unknown: UnknownOutcome
    ) -> None:
        """`_record_unknown` from blocking code: the write runs to its end here."""
        try:
            _run_to_end(
                ledger.record_unknown(key, dependency=self.name, detail=repr(unknown.__cause__))
            )
        except Exception as error:
            self._ledger_failed(ledger, key, error)
            not_recorded(unknown, key, error)
        else:
            unknown.recorded = True

    async def _record_unknown(
        self, ledger: OutcomeLedger, key: str, unknown: UnknownOutcome
    ) -> None:
        """Write an unknown outcome to the ledger (D6), whatever happens to this call
        (`record_shielded`); a failing write is logged and emitted as `LedgerWriteFailed`."""
        await record_shielded(ledger, key, unknown, source=self.name, failed=self._ledger_failed)

    def _ledger_failed(self, ledger: OutcomeLedger, key: str, error: BaseException) -> None:
        name = ledger_name(ledger)
        _log.error(
            "%s: could not record the unknown outcome of idempotency key %r in ledger %s",
            self.name,
            key,
            name,
            exc_info=error,
        )
        if self._events.enabled:  # also when the caller is gone: the count must not miss it
            self._events.emit(
                LedgerWriteFailed(
                    at=self._clock.now(),
                    source=self.name,
                    ledger=name,
                    key=key,
                    error=type(error).__name__,
                )
            )

    async def _attempt(
        self,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        number: int,
        key: str | None,
    ) -> T:
        budget, token, started = self._admit()
        breaker = self.breaker
        token_ctx = enter_attempt(number, key)
        bulkhead = self.bulkhead
        admitted = bulkhead is None
        scoped = budget is None and bulkhead is None
        try:
            if scoped:
                result = await fn(*args, **kwargs)
            else:
                async with DeadlineScope(budget, None):
                    scoped = True
                    if bulkhead is None:
                        result = await fn(*args, **kwargs)
                    else:
                        async with cast(AdmitsWork, bulkhead).admit():
                            admitted = True
                            result = await fn(*args, **kwargs)
        except DeadlineExceeded as expired:
            if not scoped:
                # A budget below the clock's resolution (``left - reserve`` of 1e-16 s): the
                # scope expired on entry. Nothing was sent, so no unknown outcome (D4, D6).
                raise self._unsent(
                    token, Reason.DEADLINE_TOO_SHORT, "no usable time left"
                ) from expired
            if not admitted:
                # Expired while queued for the bulkhead: never sent, so not an unknown outcome.
                raise self._unsent(
                    token, Reason.QUEUE_TIMEOUT, "attempt budget spent in the queue"
                ) from expired
            self._after_failure(expired, token, started)
            raise
        except Exception as error:
            self._after_failure(error, token, started)
            raise
        except BaseException:
            if breaker is not None:
                breaker.release(token, failed=None)
            raise
        finally:
            exit_attempt(token_ctx)
            self._calls.pop()  # `_leave`, inline
        if breaker is not None or self.throttle is not None:
            self._after_success(token, started)
        return result

    def _attempt_blocking(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        number: int,
        key: str | None,
    ) -> T:
        budget, token, started = self._admit()
        if budget is not None and not budget > 0.0:
            # The guards took what was left: nothing is sent, so no unknown outcome (D4).
            self._leave()
            raise self._unsent(token, Reason.DEADLINE_TOO_SHORT, "no usable time left")
        token_ctx = enter_attempt(number, key)
        bulkhead = self.bulkhead
        try:
            # The scope sets the attempt's deadline for ``fn`` (its timeouts, its headers) and
            # bounds the wait in the bulkhead's queue; a blocking call cannot be cancelled, so
            # ``fn`` must keep to it.
            with DeadlineScope(budget, None):
                if bulkhead is None:
                    result = fn(*args, **kwargs)
                else:
                    # Admitted per attempt, as on the async path; a refusal (`Rejected`, also
                    # for time spent queued) was never sent. Leaving settles the permit.
                    with cast(AdmitsWorkBlocking, bulkhead).admit():
                        scope = current_deadline()
                        left = math.inf if scope is None else scope.remaining()
                        if not (left > 0.0 and left >= self.min_useful):
                            # Admitted as its budget ran out: not sent, as on the async
                            # path (an uncancellable call cannot be sent with no time).
                            raise self._refuse(
                                Reason.QUEUE_TIMEOUT,
                                f"{self.name}: attempt budget spent in the queue",
                            )
                        result = fn(*args, **kwargs)
        except Exception as error:
            self._after_failure(error, token, started)
            raise
        except BaseException:
            if self.breaker is not None:
                self.breaker.release(token, failed=None)
            raise
        finally:
            exit_attempt(token_ctx)
            self._leave()
        self._after_success(token, started)
        return result

    # -- what both kinds of attempt share -------------------------------------------------

    def _admit(self) -> tuple[float | None, int, float]:
        """The guards before an attempt: its budget (D4), ``max_active``, the breaker and the
        throttle. Returns ``(budget, breaker token, start time)`` with the attempt counted as
        active (`_leave` when it is over), or raises the refusal."""
        dependency_call(self.name)  # a drill marks this dependency failed (G3); free otherwise
        budget: float | None
        deadline = current_deadline()
        taken = 0.0
        if deadline is None:
            budget = self.timeout
        else:
            # The attempt must expire strictly before the request does, or the request's
            # own cancellation wins the race and a mutation's unknown outcome goes unrecorded.
            taken = deadline.clock.now()  # read before the budget: never later than its own
            try:
                # The rule the client adapters share (`brownout.wire.attempt_budget`).
                budget = attempt_budget(
                    self.timeout,
                    reserve=self.reserve,
                    min_useful=self.min_useful,
                    deadline=deadline,
                )
            except Rejected as refused:
                # Counted as this dependency's shed, as its other local refusals are (O1).
                raise self._refuse(refused.reason, f"{self.name}: {refused.detail}") from None
        max_active = self.max_active
        calls = self._calls
        if max_active is None:
            calls.append(None)  # atomic: threads and the loop may share the count
        else:
            lock = self._active_lock
            lock.acquire()  # check-and-count as one step (a `_leave` needs no lock)
            try:
                active = len(calls)
                if active < max_active:
                    calls.append(None)
            finally:
                lock.release()
            if active >= max_active:
                raise self._refuse(Reason.OVERLOADED, f"{self.name}: {active} calls in flight")
        breaker = self.breaker
        try:
            token = breaker.acquire() if breaker is not None else 0
            throttle = self.throttle
            if throttle is not None:
                try:
                    throttle.check()
                except Rejected:
                    if breaker is not None:
                        breaker.release(token, failed=None)
                    raise
        except BaseException:
            self._leave()
            raise
        timed = breaker is not None and breaker.slow_call_duration is not None
        started = self._clock.now() if timed else 0.0
        if deadline is not None and budget is not None:
            # The scope starts the budget as a duration: what the guards took since it was
            # taken (a preempted thread, a slow guard) comes out of it (D4).
            budget -= deadline.clock.now() - taken
        return budget, token, started

    def _leave(self) -> None:
        self._calls.pop()

    def _unsent(self, token: int, reason: Reason, detail: str) -> Rejected:
        """A refusal of an attempt that was admitted but never sent (its breaker place freed)."""
        if self.breaker is not None:
            self.breaker.release(token, failed=None)
        return self._refuse(reason, f"{self.name}: {detail}")

    def _after_success(self, token: int, started: float) -> None:
        breaker = self.breaker
        if breaker is not None:
            timed = breaker.slow_call_duration is not None
            duration = self._clock.now() - started if timed else 0.0
            breaker.release(token, failed=False, duration=duration)
        if self.throttle is not None:
            self.throttle.record_accept()

    def _after_failure(self, error: Exception, token: int, started: float) -> None:
        throttle = self.throttle
        if throttle is not None:
            failure = self.retry.classify(error)
            # Accepted: the dependency answered something other than an overload refusal.
            if failure.sent and not failure.transient and not failure.do_not_retry:
                throttle.record_accept()
        breaker = self.breaker
        if breaker is not None:
            timed = breaker.slow_call_duration is not None
            duration = self._clock.now() - started if timed else 0.0
            breaker.release(token, failed=breaker.is_failure(error), duration=duration)

    def _kept_back(self) -> float:
        """What every attempt keeps back from the request's time: the reserve, at least
        `ATTEMPT_EDGE` (an attempt always ends before its request)."""
        return self.reserve if self.reserve > ATTEMPT_EDGE else ATTEMPT_EDGE

    def _refuse(self, reason: Reason, detail: str) -> Rejected:
        if self._events.enabled:
            from ._context import current

            ctx = current()
            self._events.emit(
                RequestShed(
                    self._clock.now(),
                    self.name,
                    ctx.operation,
                    ctx.priority,
                    ctx.caller,
                    reason,
                    ctx.remaining(),
                    0.0,
                )
            )
        return Rejected(reason, detail)

    def __repr__(self) -> str:
        return f"Dependency({self.name!r}, timeout={self.timeout}, retry={self.retry!r})"


def _run_to_end(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from blocking code, in the current context, on the process's one
    private event loop (`_private_loop`), blocking this thread until it is done.

    One loop for every write, not one per write: a client bound to the loop it first ran on
    (``redis.asyncio``'s connection pool) keeps working across writes and threads."""
    loop = _private_loop()
    if loop_or_none() is loop:
        # Called from a coroutine on that loop (a fallback calling back): a loop of its own.
        with concurrent.futures.ThreadPoolExecutor(1) as helper:
            context = contextvars.copy_context()
            return helper.submit(context.run, asyncio.run, _awaited(awaitable)).result()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    context = contextvars.copy_context()

    async def run() -> None:
        try:
            done.set_result(await awaitable)
        except BaseException as error:  # the caller's thread raises it
            done.set_exception(error)

    def start() -> None:
        task = loop.create_task(run(), context=context)
        _PRIVATE_TASKS.add(task)
        task.add_done_callback(_PRIVATE_TASKS.discard)

    loop.call_soon_threadsafe(start)
    return done.result()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


_PRIVATE: list[tuple[int, asyncio.AbstractEventLoop]] = []  # (pid, loop): one per process
_PRIVATE_LOCK = threading.Lock()
_PRIVATE_TASKS: set[asyncio.Task[None]] = set()  # writes in progress (strong refs)


def _private_loop() -> asyncio.AbstractEventLoop:
    """The event loop the blocking path awaits on, on a daemon thread started on first use
    (again in a forked child: the parent's thread did not come with it)."""
    pid = os.getpid()
    with _PRIVATE_LOCK:
        if _PRIVATE and _PRIVATE[0][0] == pid:
            return _PRIVATE[0][1]
        loop = asyncio.new_event_loop()
        threading.Thread(
            target=loop.run_forever, name="brownout-blocking-loop", daemon=True
        ).start()
        _PRIVATE[:] = [(pid, loop)]
        return loop
