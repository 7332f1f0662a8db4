"""Dependency: D4 call budget, D5 cancellation, breaker/throttle/bulkhead/capacity guards (A6),
retries (R1-R5) and unknown outcomes (D6), composed. Virtual time (looptime)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Any

import looptime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
import brownout.events
import brownout.testing
from brownout import (
    Bulkhead,
    CircuitBreaker,
    ClientThrottle,
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    OutcomeState,
    Reason,
    Reconciler,
    Rejected,
    ResponseError,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    StopReason,
    UnknownOutcome,
)
from brownout._retry import OutcomeRecord
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.looptime


def policy(attempts: int = 3) -> RetryPolicy:
    return RetryPolicy(
        attempts,
        budget=RetryBudget(ratio=0.1, min_per_second=10),
        backoff=ExponentialBackoff(0.01, cap=0.05, rng=random.Random(1)),
    )


async def test_the_readme_example_composes_every_guard() -> None:
    seen: list[tuple[int, str | None, float | None]] = []

    async def charge(order_id: str) -> str:
        ctx = brownout.current()
        seen.append((ctx.attempt, ctx.idempotency_key, ctx.remaining()))
        if len(seen) < 3:
            raise ResponseError(503)
        return f"charged {order_id}"

    payments = Dependency(
        "payments",
        timeout=0.8,
        reserve=0.05,
        min_useful=0.05,
        retry=RetryPolicy(attempts=3, budget=RetryBudget(ratio=0.1, min_per_second=10)),
        breaker=CircuitBreaker(failure_rate=0.5, window=20, open_for=5.0),
        bulkhead=Bulkhead("payments", limit=FixedLimit(16)),
    )
    async with brownout.deadline(2.0):
        assert await payments.call(charge, "o-1", idempotent=False) == "charged o-1"
    assert [a for a, _, _ in seen] == [1, 2, 3]
    assert len({k for _, k, _ in seen}) == 1
    assert seen[0][2] == pytest.approx(0.8)  # min(timeout, remaining - reserve)


async def test_per_attempt_budget_is_min_of_timeout_and_remaining_minus_reserve() -> None:
    got: list[float | None] = []

    async def fn() -> None:
        got.append(brownout.remaining())

    dep = Dependency("d", timeout=0.8, reserve=0.05)
    async with brownout.deadline(0.5):
        await dep.call(fn, idempotent=True)
    assert got == [pytest.approx(0.45)]


class _SlowBreaker(CircuitBreaker):
    """A guard that takes time between the budget and the attempt (a preempted thread)."""

    def __init__(self, clock: brownout.testing.ManualClock) -> None:
        super().__init__(clock=clock)
        self.manual = clock

    def acquire(self) -> int:
        self.manual.advance(0.2)
        return super().acquire()


@pytest.mark.parametrize("timeout", [None, 0.7])
async def test_time_spent_in_the_guards_comes_out_of_the_attempts_budget(
    timeout: float | None,
) -> None:
    """D4: the attempt's deadline is fixed when its budget is taken, so time that passes
    before the attempt starts (here 0.2 s in the breaker) is spent from it, and the attempt
    still ends by the request's deadline less the reserve. A budget carried as a duration and
    started after the guards ended 0.2 s late."""
    clock = brownout.testing.ManualClock(100.0)
    request_ends = brownout.Deadline(101.0, clock)
    seen: list[tuple[float, float]] = []

    async def fn() -> None:
        ctx = brownout.current()
        assert ctx.deadline is not None
        seen.append((ctx.deadline.remaining(), clock.now()))

    dep = Dependency("d", timeout=timeout, reserve=0.1, breaker=_SlowBreaker(clock))
    async with brownout.deadline(request_ends):
        await dep.call(fn, idempotent=True)
    [(remaining, at)] = seen
    assert at == pytest.approx(100.2)
    # min(timeout, 1.0 - 0.1) from when the budget was taken, less the 0.2 s since
    assert remaining == pytest.approx(min(timeout or 10.0, 0.9) - 0.2)
    assert at + remaining <= request_ends.at - 0.1 + 1e-9


async def test_too_little_time_is_refused_before_sending() -> None:
    """D4: 40 ms left, the call needs 150 ms: refused, never sent."""
    sent = 0

    async def fn() -> None:
        nonlocal sent
        sent += 1

    dep = Dependency("d", timeout=1.0, min_useful=0.15)
    async with brownout.deadline(0.04):
        with pytest.raises(Rejected) as info:
            await dep.call(fn, idempotent=True)
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT and sent == 0


async def test_an_attempt_is_cancelled_at_its_budget_and_an_idempotent_call_retried() -> None:
    """D5: the slow attempt stops at its budget (no late work), then the retry succeeds."""
    finished: list[int] = []

    async def fn() -> str:
        attempt = brownout.current().attempt
        if attempt == 1:
            await asyncio.sleep(10)
        finished.append(attempt)
        return "ok"

    dep = Dependency("d", timeout=0.2, retry=policy())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await dep.call(fn, idempotent=True) == "ok"
    assert finished == [2]
    assert loop.time() - t0 < 0.5


async def test_a_mutation_that_times_out_is_recorded_as_unknown_and_reconciled() -> None:
    """D6 / T3: the server applies the mutation after the client gave up; the ledger and
    the reconciler find it by key, and the retry caused no duplicate (server dedupes)."""
    applied: dict[str, int] = {}
    received: list[str] = []

    async def server_apply(key: str) -> None:
        received.append(key)
        await asyncio.sleep(1.0)  # slower than the client's patience
        if key not in applied:  # the server deduplicates by Idempotency-Key
            applied[key] = 1

    background: set[asyncio.Task[None]] = set()

    async def charge(amount: int) -> str:
        key = brownout.current().idempotency_key
        assert key is not None
        # The request reached the server: its work continues even if the client gives up.
        task = asyncio.get_running_loop().create_task(server_apply(key))
        background.add(task)
        await asyncio.shield(task)
        return "charged"

    ledger = InMemoryOutcomeLedger()
    dep = Dependency("payments", timeout=0.3, retry=policy(2), ledger=ledger)
    with pytest.raises(UnknownOutcome) as info:
        await dep.call(charge, 10)
    key = info.value.idempotency_key
    assert key is not None
    record = await ledger.get(key)
    assert record is not None and record.state is OutcomeState.PENDING

    await asyncio.gather(*background)
    assert received == [key, key]  # two attempts reached the server with one key
    assert applied == {key: 1}  # ... and had one effect

    async def check(r: OutcomeRecord) -> OutcomeState:
        return OutcomeState.APPLIED if r.key in applied else OutcomeState.NOT_APPLIED

    resolved = await Reconciler(ledger, check).run_once()
    assert [r.key for r in resolved] == [key]
    assert await ledger.pending() == []


async def test_breaker_opens_and_then_refuses_without_calling() -> None:
    calls = 0

    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise ResponseError(503)

    dep = Dependency(
        "d", breaker=CircuitBreaker(window=4, minimum_calls=4, open_for=5.0), retry=policy(1)
    )
    for _ in range(4):
        with pytest.raises(ResponseError):
            await dep.call(fn, idempotent=True)
    with pytest.raises(Rejected) as info:
        await dep.call(fn, idempotent=True)
    assert info.value.reason is Reason.BREAKER_OPEN and calls == 4
    assert info.value.retry_after is not None and 3.0 < info.value.retry_after <= 6.0


async def test_breaker_fallback_answers_when_open() -> None:
    async def fallback(refused: Rejected) -> str:
        return "stale"

    async def fn() -> str:
        return "fresh"

    breaker = CircuitBreaker(fallback=fallback)
    dep = Dependency("d", breaker=breaker)
    breaker.force_open()
    assert await dep.call(fn, idempotent=True) == "stale"


async def test_a_retry_refused_by_the_breaker_surfaces_the_real_failure() -> None:
    breaker = CircuitBreaker(window=1, minimum_calls=1, open_for=60.0)
    original = ResponseError(503)

    async def fn() -> None:
        raise original

    dep = Dependency("d", breaker=breaker, retry=policy(3))
    with pytest.raises(RetriesExhausted) as info:
        await dep.call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.REFUSED and info.value.error is original


async def test_throttle_refuses_locally_once_the_dependency_keeps_refusing() -> None:
    calls = 0

    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise ResponseError(503)

    dep = Dependency("d", throttle=ClientThrottle(rng=random.Random(1)))
    throttled = 0
    reasons: set[Reason] = set()
    for _ in range(200):
        try:
            await dep.call(fn, idempotent=True)
        except Rejected as e:
            reasons.add(e.reason)
            throttled += 1
        except ResponseError:
            pass
    assert throttled > 150 and calls + throttled == 200
    assert reasons == {Reason.THROTTLED}


async def test_validation_errors_count_as_accepts_for_the_throttle() -> None:
    async def fn() -> None:
        raise ResponseError(422)

    throttle = ClientThrottle(rng=random.Random(1))
    dep = Dependency("d", throttle=throttle)
    for _ in range(100):
        with pytest.raises(ResponseError):
            await dep.call(fn, idempotent=True)
    assert throttle.probability() == 0.0


async def test_max_active_refuses_when_full() -> None:
    gate = asyncio.Event()

    async def fn() -> None:
        await gate.wait()

    dep = Dependency("d", max_active=2)
    tasks = [asyncio.create_task(dep.call(fn, idempotent=True)) for _ in range(2)]
    await asyncio.sleep(0)
    assert dep.active == 2
    with pytest.raises(Rejected) as info:
        await dep.call(fn, idempotent=True)
    assert info.value.reason is Reason.OVERLOADED
    gate.set()
    await asyncio.gather(*tasks)
    assert dep.active == 0


async def test_bulkhead_limits_concurrency_and_queueing_spends_the_attempt_budget() -> None:
    running = peak = 0

    async def fn() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.1)
        running -= 1

    bulkhead = Bulkhead("d", limit=FixedLimit(2), queue=FifoQueue(max_size=2, max_wait=1.0))
    dep = Dependency("d", timeout=1.0, bulkhead=bulkhead)
    results = await asyncio.gather(
        *(dep.call(fn, idempotent=True) for _ in range(6)), return_exceptions=True
    )
    assert peak == 2  # A1: the dependency's own concurrency budget
    refused = [r for r in results if isinstance(r, Rejected)]
    assert [r.reason for r in refused] == [Reason.QUEUE_FULL] * 2  # A6: max pending


async def test_concurrent_retries_are_capped_per_dependency() -> None:
    gate = asyncio.Event()

    async def fn() -> str:
        if brownout.current().attempt == 1:
            raise ResponseError(503)
        await gate.wait()
        return "ok"

    dep = Dependency("d", retry=policy(3), max_concurrent_retries=1)
    first = asyncio.create_task(dep.call(fn, idempotent=True))
    await asyncio.sleep(0.5)
    with pytest.raises(RetriesExhausted) as info:
        await dep.call(fn, idempotent=True)
    assert info.value.stopped_by is StopReason.CONCURRENT_RETRIES
    gate.set()
    assert await first == "ok"


async def test_kwargs_pass_through_and_reserved_names_do_not() -> None:
    async def fn(a: int, *, b: int) -> Any:
        return (a, b, brownout.current().idempotency_key)

    dep = Dependency("d")
    assert await dep.call(fn, 1, b=2, idempotency_key="k") == (1, 2, "k")


async def test_a_mutation_cut_off_by_the_request_deadline_is_still_an_unknown_outcome() -> None:
    """D6 with no reserve and no timeout: the attempt still ends (by 1 ms) before the request,
    so the policy sees the timeout and records the unknown outcome instead of a bare cancel."""

    async def hangs() -> None:
        await asyncio.sleep(10)

    ledger = InMemoryOutcomeLedger()
    dep = Dependency("d", ledger=ledger)
    with pytest.raises(UnknownOutcome) as info:
        async with brownout.deadline(0.5):
            await dep.call(hangs, idempotency_key="k-9")
    assert info.value.idempotency_key == "k-9"
    assert [r.key for r in await ledger.pending()] == ["k-9"]


async def test_a_loop_stalled_past_the_reserve_still_records_the_lost_mutation_once() -> None:
    """D6 when the request's deadline and the attempt's fire in one loop iteration (the loop
    stalled past the reserve): the request's `DeadlineExceeded` wins, as for any work its
    deadline cuts, and the mutation sent and unanswered is still one event and one ledger
    entry (a busy host made this race in the gRPC accounting test)."""
    hub = brownout.events.EventHub()
    ledger = InMemoryOutcomeLedger()
    dep = Dependency("d", reserve=0.05, ledger=ledger, events=hub)
    loop = asyncio.get_running_loop()

    async def stalls() -> None:
        await asyncio.sleep(0.4)
        loop.setup_looptime(start=loop.time() + 1.0)  # past both deadlines before a timer runs
        await asyncio.sleep(10)

    with brownout.testing.EventRecorder(hub) as recorder:
        with pytest.raises(brownout.DeadlineExceeded):
            async with brownout.deadline(0.5):
                await dep.call(stalls, idempotency_key="k-7")
    assert [e.idempotency_key for e in recorder.of(brownout.events.OutcomeUnknown)] == ["k-7"]
    assert [r.key for r in await ledger.pending()] == ["k-7"]
    assert dep.active == 0


async def test_an_attempt_that_expires_in_the_bulkhead_queue_was_never_sent() -> None:
    gate = asyncio.Event()

    async def holds() -> None:
        await gate.wait()

    bulkhead = Bulkhead(
        "d", limit=FixedLimit(1), queue=FifoQueue(max_size=4, max_wait=10.0), reserve=0
    )
    ledger = InMemoryOutcomeLedger()
    patient = Dependency("d", bulkhead=bulkhead)
    dep = Dependency("d", timeout=0.2, bulkhead=bulkhead, ledger=ledger)
    first = asyncio.create_task(patient.call(holds, idempotent=True))
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as info:
        await dep.call(holds)  # a mutation, but it never left the queue
    assert info.value.reason in {Reason.QUEUE_TIMEOUT, Reason.DEADLINE_EXPIRED}
    assert len(ledger) == 0
    gate.set()
    await first


@settings(max_examples=40, deadline=None)
@given(
    outcomes=st.lists(
        st.tuples(st.sampled_from(["ok", "503", "reset", "422"]), st.floats(0.0, 0.6)),
        min_size=1,
        max_size=10,
    ),
    calls=st.integers(1, 15),
    request_deadline=st.floats(0.05, 3.0),
    timeout=st.floats(0.05, 1.0),
    reserve=st.floats(0.0, 0.1),
)
def test_property_attempts_stay_within_budget_and_inside_the_deadline_minus_reserve(
    outcomes: list[tuple[str, float]],
    calls: int,
    request_deadline: float,
    timeout: float,
    reserve: float,
) -> None:
    """R3/R4/D4/D5: through a Dependency, retries never exceed ratio x originals + minimum,
    no attempt runs past ``request deadline - reserve`` (it is cancelled), and no attempt
    starts with less than ``min_useful`` left."""
    ratio, minimum, window = 0.25, 0.002, 1000.0  # the minimum: 2 retries per run
    min_useful = 0.02
    dep = Dependency(
        "prop",
        timeout=timeout,
        reserve=reserve,
        min_useful=min_useful,
        retry=RetryPolicy(
            4,
            budget=RetryBudget(ratio=ratio, min_per_second=minimum, window=window),
            backoff=ExponentialBackoff(0.02, cap=0.5, rng=random.Random(0)),
        ),
    )
    attempts = 0
    violations: list[str] = []
    script = iter(outcomes * 200)

    async def fn(limit: float) -> str:
        nonlocal attempts
        attempts += 1
        loop = asyncio.get_running_loop()
        left = brownout.remaining()
        assert left is not None
        if left < min_useful - 1e-9:
            violations.append(f"started with {left:.3f} s left")
        kind, latency = next(script)
        try:
            await asyncio.sleep(latency)
        finally:
            if loop.time() > limit + 1e-6:
                violations.append("ran past deadline - reserve")
        if kind == "503":
            raise ResponseError(503)
        if kind == "reset":
            raise ConnectionResetError
        if kind == "422":
            raise ResponseError(422)
        return kind

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(calls):
            limit = loop.time() + request_deadline - reserve
            try:
                async with brownout.deadline(request_deadline):
                    await dep.call(fn, limit, idempotent=True)
            except (brownout.BrownoutError, ResponseError, ConnectionError, TimeoutError):
                pass

    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert violations == []
    assert attempts - calls <= ratio * calls + minimum * window
    assert attempts <= 4 * calls


async def test_drills_reach_every_dependency_call_and_check_breaker_fallbacks() -> None:
    """G3: a drill marks a dependency failed; a breaker fallback that calls it fails the drill."""
    import brownout
    from brownout.testing import DrillFailed, DrillOutage, drill

    calls: list[str] = []

    async def fetch() -> str:
        calls.append("fetch")
        return "live"

    dep = brownout.Dependency("recs", timeout=1.0)
    with drill(failed=["recs"]):
        with pytest.raises(DrillOutage):
            await dep.call(fetch, idempotent=True)
    assert calls == []
    assert await dep.call(fetch, idempotent=True) == "live"

    async def bad_fallback(refused: brownout.Rejected) -> str:
        return await dep.call(fetch, idempotent=True)  # the mistake G3 warns about

    opened = brownout.CircuitBreaker(failure_rate=0.5, window=2, minimum_calls=1)
    guarded = brownout.Dependency("recs-front", timeout=1.0, breaker=opened)
    opened.fallback = bad_fallback

    async def boom() -> str:
        raise ConnectionError("down")

    for _ in range(3):  # trip the breaker
        with contextlib.suppress(Exception):
            await guarded.call(boom, idempotent=True)
    with pytest.raises(DrillFailed):
        with drill(failed=["recs"]):
            with contextlib.suppress(Exception):
                await guarded.call(fetch, idempotent=True)


def _policy(attempts: int = 3, **kw: Any) -> RetryPolicy:
    kw.setdefault("backoff", ExponentialBackoff(0.01, cap=0.05, rng=random.Random(1)))
    kw.setdefault("budget", RetryBudget(ratio=0.1, min_per_second=100))
    return RetryPolicy(attempts, **kw)


# -- D6 / T3: recording and reconciling unknown outcomes ---------------------------------------


class _BrokenLedger(InMemoryOutcomeLedger):
    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        raise ConnectionError("ledger store unreachable")


async def _hang() -> None:
    await asyncio.sleep(100)


async def test_a_failing_ledger_write_still_raises_unknown_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D6, O1: the failed write was only a log line; it is now a counted event, and the
    caller's `UnknownOutcome` says the key was not recorded (the documented fallback)."""
    hub = brownout.events.EventHub()
    stats = hub.subscribe(brownout.Stats())
    seen = brownout.testing.EventRecorder(hub).start()
    ledger = _BrokenLedger()
    shop = Dependency("shop", timeout=0.1, retry=RetryPolicy(1), ledger=ledger, events=hub)
    with caplog.at_level(logging.ERROR, logger="brownout"):
        with pytest.raises(UnknownOutcome) as lost:
            await shop.call(_hang)
    key = lost.value.idempotency_key
    assert key is not None and lost.value.recorded is False
    assert any(key in note and "ConnectionError" in note for note in lost.value.__notes__)
    assert any("ledger" in r.getMessage() for r in caplog.records)  # not swallowed silently
    failed = seen.of(brownout.events.LedgerWriteFailed)
    assert [(e.source, e.ledger, e.key, e.error) for e in failed] == [
        ("shop", "_BrokenLedger", key, "ConnectionError")
    ]
    assert stats.ledger_write_failures == {("shop", "_BrokenLedger", "ConnectionError"): 1}

    fine = Dependency("shop", timeout=0.1, retry=RetryPolicy(1), ledger=InMemoryOutcomeLedger())
    with pytest.raises(UnknownOutcome) as kept:
        await fine.call(_hang)
    assert kept.value.recorded is True and not getattr(kept.value, "__notes__", [])


async def test_a_ledger_write_that_fails_after_the_caller_left_is_still_counted() -> None:
    """The caller is cancelled while the (shielded) write is on the wire; the write then
    fails: nobody gets `UnknownOutcome`, so the event is the only trace besides the log."""

    class SlowBroken(InMemoryOutcomeLedger):
        name = "slow"

        async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
            await asyncio.sleep(0.05)
            raise TimeoutError

    hub = brownout.events.EventHub()
    stats = hub.subscribe(brownout.Stats())
    shop = Dependency("shop", retry=RetryPolicy(1), ledger=SlowBroken(), events=hub)
    with pytest.raises((UnknownOutcome, brownout.DeadlineExceeded)):
        async with brownout.deadline(0.5):
            await shop.call(_hang)
    assert stats.ledger_write_failures == {}  # still on the wire
    await asyncio.sleep(0.1)
    assert stats.ledger_write_failures == {("shop", "slow", "TimeoutError"): 1}


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


# -- D6: an unknown outcome stays unknown until an answer settles it ---------------------------


async def test_dependency_records_it_in_the_ledger() -> None:
    outcomes: list[Exception] = [
        brownout._retry.TransientError("read timeout", sent=True),
        brownout._retry.TransientError("refused", sent=False),
    ]

    async def charge() -> None:
        raise outcomes.pop(0)

    ledger = InMemoryOutcomeLedger()
    shop = Dependency("shop", retry=_policy(2), ledger=ledger)
    with pytest.raises(UnknownOutcome):
        await shop.call(charge, idempotency_key="order-8")
    assert [r.key for r in await ledger.pending()] == ["order-8"]


async def test_an_error_answer_to_the_retry_does_not_settle_a_lost_attempt() -> None:
    """D6: attempt 1 was sent and lost; the retry is answered 409 (the same key is still in
    progress). Attempt 1 may have been applied: UnknownOutcome, and the key in the ledger."""
    outcomes: list[Exception] = [
        brownout._retry.TransientError("read timeout", sent=True),
        ResponseError(409),
    ]

    async def charge() -> None:
        raise outcomes.pop(0)

    ledger = InMemoryOutcomeLedger()
    shop = Dependency("shop", retry=_policy(2), ledger=ledger)
    with pytest.raises(UnknownOutcome):
        await shop.call(charge, idempotency_key="order-9")
    assert [r.key for r in await ledger.pending()] == ["order-9"]


async def test_a_budget_below_the_clocks_resolution_is_refused_not_an_unknown_outcome() -> None:
    """D4/D6: at t=1.0 with 0.1 s left and a 0.1 s reserve, ``left - reserve`` is 8e-17 s:
    positive, but ``now + budget == now``, so the attempt's scope expired before anything was
    sent. That used to surface as a lost attempt: UnknownOutcome and a ledger entry for a
    mutation that never left, and a failure counted against the breaker."""
    sent: list[int] = []

    async def charge() -> None:
        sent.append(1)

    ledger = InMemoryOutcomeLedger()
    breaker = CircuitBreaker(failure_rate=0.5, window=1, minimum_calls=1)
    shop = Dependency("shop", reserve=0.1, breaker=breaker, ledger=ledger)
    await asyncio.sleep(1.0)
    with pytest.raises(Rejected) as info:
        async with brownout.deadline(0.1):
            await shop.call(charge, idempotency_key="order-10")
    assert not isinstance(info.value, UnknownOutcome)
    assert info.value.reason is Reason.DEADLINE_TOO_SHORT
    assert sent == [] and len(ledger) == 0
    assert breaker.state is brownout._retry.BreakerState.CLOSED


async def test_a_retry_is_not_decided_when_its_wait_leaves_no_time_to_send_it() -> None:
    """R4: 50 ms left, the server says Retry-After 50 ms, attempts take no time (estimate 0)
    and the reserve is 0. The policy used to accept ``0.05 + 0 + 0 <= 0.05`` and wait out
    the whole deadline: the request's own expiry then ended the call (DeadlineExceeded, a 504
    at the edge) instead of the policy giving up with the server's answer. The Dependency
    keeps at least 1 ms back for every attempt, so the R4 check must count it too."""
    sent: list[float] = []

    async def busy() -> None:
        sent.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
        raise ResponseError(503, retry_after=0.05)

    dep = Dependency(
        "d",
        retry=RetryPolicy(
            2,
            expected_attempt_time=0.0,
            budget=RetryBudget(ratio=1.0, min_per_second=10),
            backoff=ExponentialBackoff(0.0),
        ),
    )
    with pytest.raises(RetriesExhausted) as info:
        async with brownout.deadline(0.1):
            await dep.call(busy, idempotent=True)
    assert info.value.stopped_by is StopReason.DEADLINE
    assert isinstance(info.value.error, ResponseError) and len(sent) == 1


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_dependency_refuses_a_timeout_that_cannot_send_anything(timeout: float) -> None:
    # Without a deadline, timeout=0 used to cancel every attempt before it was sent and report
    # it as an unknown outcome (a pending ledger entry, a breaker failure) for nothing sent.
    with pytest.raises(ValueError):
        Dependency("shop", timeout=timeout)


def test_dependency_refuses_a_timeout_shorter_than_what_a_call_needs() -> None:
    # timeout 50 ms, min_useful 100 ms: every call with a deadline was refused
    # (DEADLINE_TOO_SHORT) while every call without one was sent with 50 ms (D4).
    with pytest.raises(ValueError):
        Dependency("shop", timeout=0.05, min_useful=0.1)
    Dependency("shop", timeout=0.1, min_useful=0.1)


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


async def test_bounded_unknown_outcome_writes_leave_no_reference_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage turns 10,000 mutations (each its own key) into unknown outcomes: the
    shielded ledger writes are held only while they run, and the ledger keeps its bound
    (10,000, not 100,000: each call runs the whole retry and deadline machinery)."""
    from brownout._retry.idempotency import _WRITES as _LEDGER_WRITES

    caplog.set_level(logging.ERROR, logger="brownout.retry")  # one warning per dropped key

    async def hangs() -> None:
        await asyncio.sleep(10)

    ledger = InMemoryOutcomeLedger(max_entries=1000)
    dep = Dependency("payments", ledger=ledger)
    for i in range(10):
        async with asyncio.TaskGroup() as tg:
            for j in range(1000):

                async def one(key: str) -> None:
                    with contextlib.suppress(UnknownOutcome):
                        async with brownout.deadline(0.05):
                            await dep.call(hangs, idempotency_key=key)

                tg.create_task(one(f"order-{i}-{j}"))
        assert not _LEDGER_WRITES
    assert len(ledger) == 1000 and ledger.evicted == 9_000


async def test_calls_refused_for_lack_of_time_are_counted_as_shed() -> None:
    # O1: the dependency's other local refusals (breaker open, throttled, overloaded) were
    # counted; one refused because the request's time could not cover it was not.
    hub = brownout.events.EventHub()
    stats = brownout.Stats()
    hub.subscribe(stats)
    dep = Dependency("search", timeout=1.0, min_useful=0.1, retry=policy(), events=hub)
    sent: list[int] = []

    async def call() -> str:
        sent.append(1)
        return "ok"

    async with brownout.deadline(0.03):  # 30 ms left, the call needs 100 ms
        with pytest.raises(Rejected) as refused:
            await dep.call(call, idempotent=True)
    assert refused.value.reason is Reason.DEADLINE_TOO_SHORT
    assert sent == []
    assert stats.count("shed", source="search", reason="deadline_too_short") == 1


async def test_each_attempt_takes_the_shared_attempt_budget_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One rule for `Dependency` and the client adapters (`brownout.wire.attempt_budget`),
    # called, not restated: a change to it reaches both.
    import brownout._dependency as dependency_module
    from brownout.wire import attempt_budget

    asked: list[tuple[float | None, float, float]] = []

    def spy(
        timeout: float | None, *, reserve: float, min_useful: float, deadline: Any
    ) -> float | None:
        asked.append((timeout, reserve, min_useful))
        return attempt_budget(timeout, reserve=reserve, min_useful=min_useful, deadline=deadline)

    monkeypatch.setattr(dependency_module, "attempt_budget", spy)
    got: list[float | None] = []

    async def fn() -> None:
        got.append(brownout.remaining())

    dep = Dependency("d", timeout=0.8, reserve=0.05, min_useful=0.01)
    async with brownout.deadline(0.5):
        await dep.call(fn, idempotent=True)
    assert asked == [(0.8, 0.05, 0.01)]
    assert got == [pytest.approx(0.45)]
