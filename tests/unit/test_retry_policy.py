"""RetryPolicy (R1-R5, D5, D6, A6) on virtual time (looptime)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import looptime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import (
    ExponentialBackoff,
    Reason,
    Rejected,
    ResponseError,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    StopReason,
    TransientError,
    UnknownOutcome,
)
from brownout.events import AttemptRetried, Event, EventHub, OutcomeUnknown, RetryBudgetExhausted
from brownout.wire import Failure, parse_pushback


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def script(*outcomes: BaseException | Any) -> tuple[Callable[[], Awaitable[Any]], list[Any]]:
    """A callable failing/succeeding per ``outcomes``; logs each attempt's context."""
    seen: list[Any] = []
    queue = list(outcomes)

    async def fn() -> Any:
        ctx = brownout.current()
        seen.append((ctx.attempt, ctx.idempotency_key, asyncio.get_running_loop().time()))
        outcome = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return fn, seen


def fast_policy(attempts: int = 3, **kw: Any) -> RetryPolicy:
    kw.setdefault("backoff", ExponentialBackoff(0.01, cap=0.1, rng=random.Random(1)))
    kw.setdefault("budget", RetryBudget(ratio=0.1, min_per_second=100))
    return RetryPolicy(attempts, **kw)


@pytest.mark.looptime
async def test_transient_failures_are_retried_with_the_same_key_and_growing_attempt() -> None:
    fn, seen = script(ResponseError(503), ResponseError(503), "ok")
    assert await fast_policy().call(fn) == "ok"
    assert [a for a, _, _ in seen] == [1, 2, 3]
    keys = {k for _, k, _ in seen}
    assert len(keys) == 1 and None not in keys  # R5: one generated key for the mutation


@pytest.mark.looptime
async def test_idempotent_calls_get_no_generated_key_but_keep_a_given_one() -> None:
    fn, seen = script(ResponseError(502), "ok")
    await fast_policy().call(fn, idempotent=True)
    assert [k for _, k, _ in seen] == [None, None]
    fn, seen = script(ResponseError(502), "ok")
    await fast_policy().call(fn, idempotency_key="order-7")
    assert [k for _, k, _ in seen] == ["order-7", "order-7"]


@pytest.mark.parametrize(
    "error",
    [
        ResponseError(400),
        ResponseError(404),
        ResponseError(409),
        ResponseError(500),
        ResponseError(grpc_code="FAILED_PRECONDITION"),
        ResponseError(grpc_code="INVALID_ARGUMENT"),
        ValueError("bug"),
        Rejected(Reason.OVERLOADED),
    ],
)
@pytest.mark.looptime
async def test_permanent_failures_are_not_retried_and_raise_unchanged(error: Exception) -> None:
    fn, seen = script(error, "ok")
    with pytest.raises(type(error)) as info:
        await fast_policy().call(fn, idempotent=True)
    assert info.value is error
    assert len(seen) == 1


@pytest.mark.parametrize(
    "error",
    [
        ResponseError(429),
        ResponseError(502),
        ResponseError(503),
        ResponseError(504),
        ResponseError(grpc_code="UNAVAILABLE"),
        TransientError("reset"),
        ConnectionRefusedError(),
        ConnectionResetError(),
        TimeoutError(),
    ],
)
@pytest.mark.looptime
async def test_transient_failures_are_retried(error: Exception) -> None:
    fn, seen = script(error, "ok")
    assert await fast_policy().call(fn, idempotent=True) == "ok"
    assert len(seen) == 2


@pytest.mark.looptime
async def test_cancellation_is_never_retried() -> None:
    started = asyncio.Event()
    attempts = 0

    async def slow() -> None:
        nonlocal attempts
        attempts += 1
        started.set()
        await asyncio.sleep(10)

    task = asyncio.create_task(fast_policy().call(slow, idempotent=True))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert attempts == 1


@pytest.mark.looptime
async def test_unkeyed_mutation_is_not_resent_after_it_may_have_been_sent() -> None:
    policy = fast_policy(idempotency_keys=False)
    fn, seen = script(ResponseError(502), "ok")  # answered, possibly applied
    with pytest.raises(ResponseError):
        await policy.call(fn)
    assert len(seen) == 1
    fn, seen = script(TransientError("lost", sent=True), "ok")  # sent, never answered
    with pytest.raises(UnknownOutcome) as info:
        await policy.call(fn)
    assert info.value.idempotency_key is None and len(seen) == 1
    # never sent (connection refused) or refused by the server (503): safe to resend
    fn, seen = script(TransientError("refused", sent=False), ResponseError(503), "ok")
    assert await policy.call(fn) == "ok"
    assert len(seen) == 3


@pytest.mark.looptime
async def test_keyed_mutation_that_stays_unanswered_ends_as_unknown_outcome() -> None:
    hub = EventHub()
    rec = hub.subscribe(Recorder())
    policy = fast_policy(events=hub)
    fn, seen = script(TransientError("read timeout", sent=True))
    with pytest.raises(UnknownOutcome) as info:
        await policy.call(fn, idempotency_key="k-1")
    assert info.value.idempotency_key == "k-1"
    assert len(seen) == 3  # retried with the key (the server deduplicates), then unknown
    assert [e.idempotency_key for e in rec.of(OutcomeUnknown)] == ["k-1"]  # type: ignore[attr-defined]


@pytest.mark.looptime
async def test_a_gateway_timeout_leaves_a_mutation_unknown_not_answered() -> None:
    """A 504 is a gateway's: its upstream may have applied the change (D6). A keyed mutation
    is retried with its key and, still 504, ends as an unknown outcome to reconcile; an
    unkeyed one is not resent."""
    fn, seen = script(ResponseError(504), ResponseError(504), ResponseError(504))
    with pytest.raises(UnknownOutcome) as info:
        await fast_policy().call(fn, idempotency_key="k-504")
    assert info.value.idempotency_key == "k-504" and len(seen) == 3
    fn, seen = script(ResponseError(504), "ok")
    with pytest.raises(UnknownOutcome):
        await fast_policy(idempotency_keys=False).call(fn)
    assert len(seen) == 1
    assert brownout.wire.classify(ResponseError(504)).outcome_unknown
    assert not brownout.wire.classify(ResponseError(503)).outcome_unknown  # refused: not applied


@pytest.mark.looptime
async def test_exhausted_attempts_raise_retries_exhausted_carrying_the_original_error() -> None:
    last = ResponseError(503, response="the-response")
    fn, seen = script(ResponseError(503), last)
    with pytest.raises(RetriesExhausted) as info:
        await fast_policy(3).call(fn, idempotent=True)
    e = info.value
    assert isinstance(e, Rejected) and e.reason is Reason.DO_NOT_RETRY  # R1: tell upstream
    assert e.stopped_by is StopReason.ATTEMPTS and e.attempts == 3 and len(seen) == 3
    assert e.error is last and e.__cause__ is last and e.response == "the-response"


@pytest.mark.looptime
async def test_a_single_attempt_policy_is_not_a_retry_layer() -> None:
    err = ResponseError(503)
    fn, seen = script(err)
    with pytest.raises(ResponseError) as info:
        await fast_policy(1).call(fn, idempotent=True)
    assert info.value is err and len(seen) == 1


@pytest.mark.parametrize(
    "error",
    [
        ResponseError(503, do_not_retry=True),
        ResponseError(grpc_code="UNAVAILABLE", do_not_retry=True),
        RetriesExhausted(ResponseError(503), attempts=3, stopped_by=StopReason.ATTEMPTS),
    ],
)
@pytest.mark.looptime
async def test_do_not_retry_from_below_is_honoured_and_passed_up(error: Exception) -> None:
    fn, seen = script(error, "ok")
    with pytest.raises(RetriesExhausted) as info:
        await fast_policy().call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.DO_NOT_RETRY and len(seen) == 1


@pytest.mark.looptime
async def test_retry_after_and_pushback_set_the_minimum_wait() -> None:
    fn, seen = script(ResponseError(503, retry_after=2.5), "ok")
    await fast_policy().call(fn, idempotent=True)
    assert seen[1][2] - seen[0][2] == pytest.approx(2.5, abs=1e-3)


def test_parse_pushback_reads_every_marker() -> None:
    assert parse_pushback({"brownout-retry": "never"}) == (None, True)
    assert parse_pushback({"grpc-retry-pushback-ms": "-1"}) == (None, True)
    assert parse_pushback({"grpc-retry-pushback-ms": "junk"}) == (None, True)
    assert parse_pushback({"grpc-retry-pushback-ms": "250"}) == (0.25, False)
    assert parse_pushback({"retry-after": "3"}) == (3.0, False)
    assert parse_pushback({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == (0.0, False)
    assert parse_pushback({"retry-after": "soon"}) == (None, False)
    assert parse_pushback({}) == (None, False)


@pytest.mark.looptime
async def test_a_retry_that_cannot_fit_the_deadline_is_not_sent() -> None:
    """R4: backoff + expected attempt time + reserve must fit in what is left."""
    policy = fast_policy(expected_attempt_time=0.5, reserve=0.05)
    fn, seen = script(ResponseError(503), "ok")
    async with brownout.deadline(0.5):
        with pytest.raises(RetriesExhausted) as info:
            await policy.call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.DEADLINE and len(seen) == 1
    fn, seen = script(ResponseError(503), "ok")
    async with brownout.deadline(1.0):
        assert await policy.call(fn, idempotent=True) == "ok"


@pytest.mark.looptime
async def test_a_long_retry_after_that_outlives_the_deadline_stops_retrying() -> None:
    fn, seen = script(ResponseError(429, retry_after=30.0), "ok")
    async with brownout.deadline(5.0):
        with pytest.raises(RetriesExhausted) as info:
            await fast_policy().call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.DEADLINE and len(seen) == 1


@pytest.mark.looptime
async def test_a_pushback_longer_than_max_pushback_stops_instead_of_parking_the_call() -> None:
    """Without a deadline, a ``Retry-After: 3600`` used to hold the call (and its task) for an
    hour before the retry; past ``max_pushback`` the layer gives up at once."""
    fn, seen = script(ResponseError(503, retry_after=3600.0), "ok")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RetriesExhausted) as info:
        await fast_policy().call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.PUSHBACK and len(seen) == 1
    assert loop.time() - started < 1.0
    # within the bound it is waited out, as before
    fn, seen = script(ResponseError(503, retry_after=20.0), "ok")
    assert await fast_policy(max_pushback=20.0).call(fn, idempotent=True) == "ok"
    assert seen[1][2] - seen[0][2] == pytest.approx(20.0, abs=1e-3)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="max_pushback"):
            RetryPolicy(max_pushback=bad)


@pytest.mark.looptime
async def test_an_empty_budget_returns_the_original_error_and_emits_an_event() -> None:
    hub = EventHub()
    rec = hub.subscribe(Recorder())
    policy = fast_policy(budget=RetryBudget(ratio=0.0, min_per_second=0.1, window=10.0), events=hub)
    first = ResponseError(503)
    fn, _ = script(first, "ok")
    assert await policy.call(fn, idempotent=True) == "ok"  # the one reserve retry
    second = ResponseError(503)
    fn, seen = script(second, "ok")
    with pytest.raises(RetriesExhausted) as info:
        await policy.call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.BUDGET and info.value.error is second
    assert len(seen) == 1
    assert len(rec.of(RetryBudgetExhausted)) == 1
    assert [e.attempt for e in rec.of(AttemptRetried)] == [2]


@pytest.mark.looptime
async def test_concurrent_retries_are_capped() -> None:
    policy = fast_policy(max_concurrent_retries=1)
    gate = asyncio.Event()
    calls: list[int] = []

    async def fn() -> str:
        calls.append(brownout.current().attempt)
        if brownout.current().attempt == 1:
            raise ResponseError(503)
        await gate.wait()
        return "ok"

    first = asyncio.create_task(policy.call(fn, idempotent=True))
    await asyncio.sleep(1.0)  # first is now in its retry, holding the only slot
    with pytest.raises(RetriesExhausted) as info:
        await policy.call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.CONCURRENT_RETRIES
    gate.set()
    assert await first == "ok"
    assert policy.slots is not None and policy.slots.in_use == 0


@pytest.mark.looptime
async def test_attempt_timeout_cancels_the_attempt_and_retries_idempotent_calls() -> None:
    attempts: list[float | None] = []

    async def slow_then_fast() -> str:
        attempts.append(brownout.remaining())
        if len(attempts) == 1:
            await asyncio.sleep(10)
        return "ok"

    assert await fast_policy().call(slow_then_fast, idempotent=True, attempt_timeout=0.2) == "ok"
    assert attempts[0] == pytest.approx(0.2)


@pytest.mark.looptime
async def test_user_classifier_is_consulted_first() -> None:
    class Flaky(Exception):
        pass

    def mine(error: BaseException) -> Failure | None:
        return Failure(transient=True, sent=False) if isinstance(error, Flaky) else None

    fn, seen = script(Flaky(), "ok")
    assert await fast_policy(classifier=mine).call(fn) == "ok"
    assert len(seen) == 2


@pytest.mark.looptime
async def test_events_name_the_next_attempt_and_the_cause() -> None:
    hub = EventHub()
    rec = hub.subscribe(Recorder())
    fn, _ = script(ResponseError(503), TimeoutError(), "ok")
    async with brownout.request(operation="charge"):
        await fast_policy(events=hub, name="payments").call(fn, idempotent=True)
    got = [(e.source, e.operation, e.attempt, e.cause) for e in rec.of(AttemptRetried)]
    assert got == [
        ("payments", "charge", 2, "ResponseError"),
        ("payments", "charge", 3, "TimeoutError"),
    ]


# -- property: never more than the budget, never past the deadline ---------------------------


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(st.sampled_from(["ok", "503", "timeout", "400"]), min_size=1, max_size=12),
    calls=st.integers(1, 20),
    deadline=st.floats(0.05, 5.0),
    attempts=st.integers(1, 5),
    min_per_second=st.sampled_from([0.0, 0.001, 0.005]),  # 0, 1 or 5 retries per run
    seed=st.integers(0, 1000),
)
def test_property_retries_stay_within_budget_and_deadline(
    outcomes: list[str],
    calls: int,
    deadline: float,
    attempts: int,
    min_per_second: float,
    seed: int,
) -> None:
    """Retries never exceed ratio x originals + the minimum, and no attempt outlives the
    deadline of its call (virtual time)."""
    ratio, window = 0.2, 1000.0  # one window spans the whole run: the bound is exact
    budget = RetryBudget(ratio=ratio, min_per_second=min_per_second, window=window)
    policy = RetryPolicy(
        attempts,
        budget=budget,
        backoff=ExponentialBackoff(0.05, cap=1.0, rng=random.Random(seed)),
    )
    counter = {"originals": 0, "attempts": 0}
    late: list[float] = []
    cycle = iter(outcomes * 100)

    async def fn() -> str:
        counter["attempts"] += 1
        ctx = brownout.current()
        assert ctx.deadline is not None
        outcome = next(cycle)
        if outcome == "timeout":
            await asyncio.sleep(0.3)
            raise TimeoutError
        await asyncio.sleep(0.01)
        if ctx.deadline.expired:
            late.append(ctx.deadline.at)
        if outcome == "503":
            raise ResponseError(503)
        if outcome == "400":
            raise ResponseError(400)
        return outcome

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(calls):
            counter["originals"] += 1
            end = loop.time() + deadline
            try:
                async with brownout.deadline(deadline):
                    await policy.call(fn, idempotent=True)
            except (brownout.BrownoutError, ResponseError, TimeoutError):
                pass
            assert loop.time() <= end + 1e-6

    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    retries = counter["attempts"] - counter["originals"]
    assert retries <= ratio * counter["originals"] + min_per_second * window
    assert retries <= (attempts - 1) * counter["originals"]
    assert not late


def _policy(attempts: int = 3, **kw: Any) -> RetryPolicy:
    kw.setdefault("backoff", ExponentialBackoff(0.01, cap=0.05, rng=random.Random(1)))
    kw.setdefault("budget", RetryBudget(ratio=0.1, min_per_second=100))
    return RetryPolicy(attempts, **kw)


# -- R4: the attempt-time estimate -------------------------------------------------------------


@pytest.mark.looptime
async def test_first_observed_attempt_time_is_the_estimate_not_a_fifth_of_it() -> None:
    """A fresh policy saw one 1 s attempt; 0.5 s is left: a retry cannot fit (R4)."""
    attempts = 0

    async def slow_failure() -> None:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(1.0)
        raise TimeoutError

    policy = _policy()
    with pytest.raises(RetriesExhausted) as info:
        async with brownout.deadline(1.5):
            await policy.call(slow_failure, idempotent=True)
    assert info.value.stopped_by is StopReason.DEADLINE
    assert attempts == 1
    assert policy.expected() == pytest.approx(1.0)


@pytest.mark.looptime
async def test_nan_in_the_deadline_arithmetic_stops_rather_than_retrying() -> None:
    """A NaN term must not make ``backoff + expected + reserve > left`` silently false (R4):
    the policy refuses a NaN reserve or attempt time when it is made, and a NaN reserve given
    to one `execute` (the adapters' building block) stops rather than retries."""
    calls = 0

    async def unavailable(attempt: int, key: str | None) -> None:
        nonlocal calls
        calls += 1
        raise ResponseError(503)

    for bad in ({"reserve": math.nan}, {"expected_attempt_time": math.nan}, {"reserve": -1.0}):
        with pytest.raises(ValueError):
            _policy(**bad)
    policy = _policy(expected_attempt_time=0.5)
    with pytest.raises(RetriesExhausted) as info:
        async with brownout.deadline(0.3):
            await policy.execute(unavailable, idempotent=True, reserve=math.nan)
    assert info.value.stopped_by is StopReason.DEADLINE and calls == 1


# -- pushback parsing ------------------------------------------------------------------------


@pytest.mark.looptime
@pytest.mark.parametrize("value", ["\u00b2", "\u00b9\u00b3"])
def test_retry_after_parser_never_raises_on_non_ascii_digits(value: str) -> None:
    # httpx decodes header bytes as latin-1: a 0xB2 byte is "²", which str.isdigit() accepts.
    retry_after, never = parse_pushback({"retry-after": value})
    assert never is False
    assert retry_after is None


# -- D6: an unknown outcome stays unknown until an answer settles it ---------------------------


@pytest.mark.looptime
@pytest.mark.parametrize(
    "later",
    [
        brownout._retry.TransientError("refused", sent=False),  # never left: says nothing
        ResponseError(503),  # refused by the server: says nothing of attempt 1
        ResponseError(409),  # "a request with this key is still in progress"
        ResponseError(500),  # the retry failed: attempt 1 may still have been applied
        ResponseError(422),  # an answer to the retry, not to attempt 1
    ],
)
async def test_a_mutation_sent_and_unanswered_once_stays_unknown_after_later_attempts(
    later: Exception,
) -> None:
    outcomes: list[Exception] = [brownout._retry.TransientError("read timeout", sent=True), later]

    async def charge() -> None:
        raise outcomes.pop(0)

    with pytest.raises(UnknownOutcome) as info:
        await _policy(2).call(charge, idempotency_key="order-7")
    assert info.value.idempotency_key == "order-7"
    assert info.value.__cause__ is later  # the caller still sees the last answer


@pytest.mark.looptime
async def test_originals_refused_locally_deposit_nothing_in_the_budget() -> None:
    # R3: while a breaker is open, 100 originals are refused before reaching the dependency.
    # They deposited 100 tokens (10 retries at ratio 0.1), which paid for a wave of retries
    # against the dependency as it came back.
    budget = RetryBudget(ratio=0.1, min_per_second=0.0, window=10.0)
    policy = fast_policy(budget=budget)
    for _ in range(100):
        fn, _ = script(Rejected(Reason.BREAKER_OPEN, "open"))
        with pytest.raises(Rejected):
            await policy.call(fn, idempotent=True)
    assert not budget.try_acquire_retry()  # nothing was earned
    for _ in range(10):
        fn, _ = script("ok")
        assert await policy.call(fn, idempotent=True) == "ok"
    assert budget.try_acquire_retry()  # ten originals that were tried: one retry
