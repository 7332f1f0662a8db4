"""Review of the retry layer: edge cases of R2-R6, D6 and T3 (virtual time, looptime)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest

import brownout
from brownout import CircuitBreaker, Dependency, RetryBudget, RetryPolicy, UnknownOutcome
from brownout.clock import ManualClock
from brownout.retry import (
    BreakerState,
    DecorrelatedJitterBackoff,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    OutcomeRecord,
    OutcomeState,
    Reconciler,
    ResponseError,
    RetriesExhausted,
    StopReason,
    parse_pushback,
)

pytestmark = pytest.mark.looptime


def _policy(attempts: int = 3, **kw: Any) -> RetryPolicy:
    kw.setdefault("backoff", ExponentialBackoff(0.01, cap=0.05, rng=random.Random(1)))
    kw.setdefault("budget", RetryBudget(ratio=0.1, min_per_second=100))
    return RetryPolicy(attempts, **kw)


# -- R4: the attempt-time estimate -------------------------------------------------------------


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


async def test_nan_in_the_deadline_arithmetic_stops_rather_than_retrying() -> None:
    """A NaN term must not make ``backoff + expected + reserve > left`` silently false (R4)."""
    calls = 0

    async def unavailable() -> None:
        nonlocal calls
        calls += 1
        raise ResponseError(503)

    policy = _policy(expected_attempt_time=0.5, reserve=float("nan"))
    with pytest.raises(RetriesExhausted) as info:
        async with brownout.deadline(0.3):
            await policy.call(unavailable, idempotent=True)
    assert info.value.stopped_by is StopReason.DEADLINE and calls == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: ExponentialBackoff(float("nan")),
        lambda: ExponentialBackoff(0.1, cap=float("nan")),
        lambda: ExponentialBackoff(0.1, multiplier=float("nan")),
        lambda: DecorrelatedJitterBackoff(float("nan")),
        lambda: DecorrelatedJitterBackoff(0.1, cap=float("nan")),
    ],
)
def test_backoff_rejects_nan_parameters(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


# -- pushback parsing ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["\u00b2", "\u00b9\u00b3"])
def test_retry_after_parser_never_raises_on_non_ascii_digits(value: str) -> None:
    # httpx decodes header bytes as latin-1: a 0xB2 byte is "²", which str.isdigit() accepts.
    retry_after, never = parse_pushback({"retry-after": value})
    assert never is False
    assert retry_after is None


# -- D6 / T3: recording and reconciling unknown outcomes ---------------------------------------


class _BrokenLedger(InMemoryOutcomeLedger):
    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        raise ConnectionError("ledger store unreachable")


async def _hang() -> None:
    await asyncio.sleep(100)


async def test_a_failing_ledger_write_still_raises_unknown_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shop = Dependency("shop", timeout=0.1, retry=RetryPolicy(1), ledger=_BrokenLedger())
    with caplog.at_level(logging.ERROR, logger="brownout"):
        with pytest.raises(UnknownOutcome):
            await shop.call(_hang)
    assert any("ledger" in r.getMessage() for r in caplog.records)  # not swallowed silently


class _SlowLedger(InMemoryOutcomeLedger):
    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        await asyncio.sleep(0.01)  # a network round trip (Redis)
        await super().record_unknown(key, dependency=dependency, detail=detail)


async def test_the_request_deadline_does_not_cut_off_the_ledger_write() -> None:
    ledger = _SlowLedger()
    shop = Dependency("shop", retry=RetryPolicy(1), ledger=ledger)
    with pytest.raises((UnknownOutcome, brownout.DeadlineExceeded)):
        async with brownout.deadline(0.5):
            await shop.call(_hang)
    await asyncio.sleep(0.05)
    assert len(await ledger.pending()) == 1


async def test_entries_left_for_a_human_do_not_starve_newer_ones() -> None:
    ledger = InMemoryOutcomeLedger()
    for key in ("stuck-1", "stuck-2", "fresh"):
        await ledger.record_unknown(key, dependency="shop")

    async def check(record: OutcomeRecord) -> OutcomeState:
        return OutcomeState.PENDING if record.key.startswith("stuck") else OutcomeState.APPLIED

    reconciler = Reconciler(ledger, check, batch=2, max_checks=1)
    for _ in range(3):
        await reconciler.run_once()
    fresh = await ledger.get("fresh")
    assert fresh is not None and fresh.state is OutcomeState.APPLIED


class _FlakyLedger(InMemoryOutcomeLedger):
    failures = 1

    async def pending(self, limit: int = 100) -> list[OutcomeRecord]:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("ledger store blipped")
        return await super().pending(limit)


async def test_reconciler_run_survives_a_ledger_blip() -> None:
    ledger = _FlakyLedger()
    await ledger.record_unknown("k", dependency="shop")

    async def check(record: OutcomeRecord) -> OutcomeState:
        return OutcomeState.APPLIED

    task = asyncio.create_task(Reconciler(ledger, check).run(interval=1.0))
    await asyncio.sleep(2.5)
    try:
        assert not task.done(), task.exception()
        record = await ledger.get("k")
        assert record is not None and record.state is OutcomeState.APPLIED
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- R6: breaker configuration ---------------------------------------------------------------


def test_count_breaker_with_minimum_calls_above_its_window_still_opens() -> None:
    breaker = CircuitBreaker(window=5, minimum_calls=10, clock=ManualClock())
    for _ in range(50):
        if breaker.state is BreakerState.OPEN:
            break
        breaker.release(breaker.acquire(), failed=True)
    assert breaker.state is BreakerState.OPEN


# -- D6: an unknown outcome stays unknown until an answer settles it ---------------------------


@pytest.mark.parametrize(
    "later",
    [
        brownout.retry.TransientError("refused", sent=False),  # never left: says nothing
        ResponseError(503),  # refused by the server: says nothing of attempt 1
    ],
)
async def test_a_mutation_sent_and_unanswered_once_stays_unknown_after_later_attempts(
    later: Exception,
) -> None:
    outcomes: list[Exception] = [brownout.retry.TransientError("read timeout", sent=True), later]

    async def charge() -> None:
        raise outcomes.pop(0)

    with pytest.raises(UnknownOutcome) as info:
        await _policy(2).call(charge, idempotency_key="order-7")
    assert info.value.idempotency_key == "order-7"


async def test_dependency_records_it_in_the_ledger() -> None:
    outcomes: list[Exception] = [
        brownout.retry.TransientError("read timeout", sent=True),
        brownout.retry.TransientError("refused", sent=False),
    ]

    async def charge() -> None:
        raise outcomes.pop(0)

    ledger = InMemoryOutcomeLedger()
    shop = Dependency("shop", retry=_policy(2), ledger=ledger)
    with pytest.raises(UnknownOutcome):
        await shop.call(charge, idempotency_key="order-8")
    assert [r.key for r in await ledger.pending()] == ["order-8"]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_dependency_refuses_a_timeout_that_cannot_send_anything(timeout: float) -> None:
    # Without a deadline, timeout=0 used to cancel every attempt before it was sent and report
    # it as an unknown outcome (a pending ledger entry, a breaker failure) for nothing sent.
    with pytest.raises(ValueError):
        Dependency("shop", timeout=timeout)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reserve": -5.0},
        {"reserve": float("nan")},
        {"reserve": float("inf")},
        {"min_useful": -1.0},
        {"min_useful": float("nan")},
        {"max_active": -1},
    ],
)
def test_dependency_refuses_reserves_that_would_add_time(kwargs: dict[str, float]) -> None:
    # A negative reserve let outbound budgets run past the request's deadline (the streaming
    # gRPC interceptor passed it on unchecked); NaN made budgets NaN.
    with pytest.raises(ValueError):
        Dependency("shop", timeout=1.0, **kwargs)  # type: ignore[arg-type]
