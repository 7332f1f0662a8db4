"""The durable-queue core without a broker: the envelope, the decisions, and `MessageRunner`
and `Publisher` against a recording broker (the real brokers are in tests/integration)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import (
    Bulkhead,
    DeadlineExceeded,
    Priority,
    Reason,
    Rejected,
    ResponseError,
    RetryBudget,
    UnknownOutcome,
)
from brownout.durable import (
    ENVELOPE_FIELDS,
    BacklogBound,
    Envelope,
    EnvelopeError,
    Message,
    MessagePolicy,
    MessageRunner,
    Park,
    ParkReason,
    Publisher,
    RetryLater,
    Run,
)
from brownout.events import (
    EventHub,
    MessageCompleted,
    MessageParked,
    MessagePublished,
    MessageRefused,
    MessageRetried,
    MessageStarted,
)
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue
from brownout.testing import ManualClock

START = 1_800_000_000.0  # a wall-clock time (2027)


# -- the envelope ---------------------------------------------------------------------------


def test_an_envelope_round_trips_through_text_headers() -> None:
    env = Envelope(
        enqueued_at=START,
        valid_until=START + 2.5,
        attempt=3,
        idempotency_key="k-1",
        priority=Priority.SHEDDABLE,
        caller="billing",
        operation="charge",
    ).with_history(START + 1, "retry", "TimeoutError: slow")
    headers = env.encode()
    assert set(headers) <= set(ENVELOPE_FIELDS)
    assert all(isinstance(v, str) for v in headers.values())
    assert Envelope.decode(headers) == env
    assert Envelope.decode({k: v.encode() for k, v in headers.items()}) == env


@pytest.mark.parametrize(
    ("headers", "field_name"),
    [
        ({}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "soon"}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "nan"}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "-1"}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "1e300"}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "1", "brownout-valid-until": "inf"}, "brownout-valid-until"),
        ({"brownout-enqueued-at": "1", "brownout-attempt": "0"}, "brownout-attempt"),
        ({"brownout-enqueued-at": "1", "brownout-attempt": "+2"}, "brownout-attempt"),
        ({"brownout-enqueued-at": "1", "brownout-attempt": "9" * 400}, "brownout-attempt"),
        ({"brownout-enqueued-at": "1", "brownout-priority": "urgent"}, "brownout-priority"),
        ({"brownout-enqueued-at": "1", "brownout-caller": "x" * 300}, "brownout-caller"),
        ({"brownout-enqueued-at": "1", "brownout-caller": "a\nb"}, "brownout-caller"),
        ({"brownout-enqueued-at": b"\xff"}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": 12}, "brownout-enqueued-at"),
        ({"brownout-enqueued-at": "1", "brownout-history": "{"}, "brownout-history"),
        ({"brownout-enqueued-at": "1", "brownout-history": "[1]"}, "brownout-history"),
        ({"brownout-enqueued-at": "1", "brownout-history": '[{"at": "x"}]'}, "brownout-history"),
    ],
)
def test_a_malformed_envelope_names_its_field(headers: dict[str, Any], field_name: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.decode(headers)
    assert info.value.field == field_name
    assert field_name in str(info.value)


@settings(deadline=None)  # a first example on a loaded host can take longer than 200 ms
@given(st.dictionaries(st.sampled_from(ENVELOPE_FIELDS), st.one_of(st.text(), st.binary())))
def test_decoding_any_headers_gives_an_envelope_or_an_envelope_error(headers: dict) -> None:
    try:
        env = Envelope.decode(headers)
    except EnvelopeError:
        return
    assert Envelope.decode(env.encode()) == env


def test_history_is_bounded() -> None:
    env = Envelope(enqueued_at=START)
    for i in range(100):
        env = env.next_attempt(START + i, "retry", "x" * 1000)
    assert env.attempt == 101
    assert len(env.history) == 16 and env.history[-1].at == START + 99
    assert len(env.encode()["brownout-history"]) < 8_000


async def test_stamping_takes_the_request_context() -> None:
    async with brownout.request(
        deadline=2.0, priority=Priority.SHEDDABLE, caller="web", idempotency_key="abc"
    ):
        env = Envelope.stamp(START, brownout.current(), ttl=60.0, operation="mail")
    assert env.enqueued_at == START and env.attempt == 1
    assert env.valid_until is not None and START + 1.5 < env.valid_until <= START + 2.0
    assert (env.priority, env.caller, env.idempotency_key, env.operation) == (
        Priority.SHEDDABLE,
        "web",
        "abc",
        "mail",
    )
    outside = Envelope.stamp(START, brownout.current(), ttl=60.0)
    assert outside.valid_until == START + 60.0
    assert outside.idempotency_key is not None and len(outside.idempotency_key) == 32
    assert Envelope.stamp(START, None).valid_until is None


# -- the decisions --------------------------------------------------------------------------


def test_before_runs_useful_work_with_its_remaining_time() -> None:
    policy = MessagePolicy(max_age=60.0)
    env = Envelope(enqueued_at=START, valid_until=START + 10.0)
    run = policy.before(env, START + 4.0)
    assert isinstance(run, Run) and run.attempt == 1 and run.budget == pytest.approx(6.0)
    # the age bound is the shorter one
    run = MessagePolicy(max_age=5.0).before(env, START + 4.0)
    assert isinstance(run, Run) and run.budget == pytest.approx(1.0)
    # no deadline, no age bound: no budget
    run = MessagePolicy().before(Envelope(enqueued_at=START), START + 3600)
    assert isinstance(run, Run) and run.budget is None


@pytest.mark.parametrize(
    ("env", "now", "policy", "reason"),
    [
        (
            Envelope(enqueued_at=START, valid_until=START + 1.0),
            START + 1.0,
            MessagePolicy(),
            "expired",
        ),
        (
            Envelope(enqueued_at=START, valid_until=START + 1.0),
            START + 0.95,
            MessagePolicy(min_useful=0.1),
            "expired",
        ),
        (Envelope(enqueued_at=START), START + 60.0, MessagePolicy(max_age=60.0), "too_old"),
        (Envelope(enqueued_at=START, attempt=5), START, MessagePolicy(max_attempts=4), "attempts"),
        (Envelope(enqueued_at=START + 10.0), START, MessagePolicy(max_skew=5.0), "malformed"),
    ],
)
def test_before_parks_work_that_cannot_be_useful(
    env: Envelope, now: float, policy: MessagePolicy, reason: str
) -> None:
    decision = policy.before(env, now)
    assert isinstance(decision, Park) and decision.reason == reason
    assert decision.envelope is not None


def test_a_producer_clock_ahead_within_the_skew_counts_as_age_zero() -> None:
    env = Envelope(enqueued_at=START + 2.0, valid_until=START + 5.0)
    run = MessagePolicy(max_age=10.0, max_skew=5.0).before(env, START)
    assert isinstance(run, Run) and run.budget == pytest.approx(5.0)
    assert env.age(START) == 0.0


def test_broker_redeliveries_count_as_attempts() -> None:
    policy = MessagePolicy(max_attempts=3)
    env = Envelope(enqueued_at=START, attempt=2)
    run = policy.before(env, START, redeliveries=1)
    assert isinstance(run, Run) and run.attempt == 3
    parked = policy.before(env, START, redeliveries=2)
    assert isinstance(parked, Park) and parked.reason is ParkReason.ATTEMPTS


def test_malformed_messages_park_or_run_as_declared() -> None:
    error = EnvelopeError("brownout-enqueued-at", "missing")
    parked = MessagePolicy().malformed(error, START)
    assert isinstance(parked, Park) and parked.reason is ParkReason.MALFORMED
    assert parked.envelope is None and "enqueued-at" in parked.detail
    run = MessagePolicy(on_malformed="run", default_ttl=30.0).malformed(error, START)
    assert isinstance(run, Run) and run.budget == pytest.approx(30.0)
    assert run.envelope.history[-1].event == "malformed"


def _run(env: Envelope | None = None, attempt: int = 1, budget: float | None = 100.0) -> Run:
    return Run(env or Envelope(enqueued_at=START, valid_until=START + 100.0), attempt, budget)


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("reset"),
        TimeoutError(),
        ResponseError(503),
        Rejected(Reason.BREAKER_OPEN),
        Rejected(Reason.OVERLOADED),
        UnknownOutcome("charge", "k"),
    ],
)
def test_transient_failures_retry_later_with_the_next_attempt(error: Exception) -> None:
    decision = MessagePolicy().after_failure(_run(), error, START + 1.0)
    assert isinstance(decision, RetryLater)
    assert decision.envelope.attempt == 2 and 0.0 <= decision.delay <= 1.0
    assert decision.envelope.history[-1].event == "retry"
    assert decision.envelope.idempotency_key == _run().envelope.idempotency_key


@pytest.mark.parametrize(
    "error",
    [ValueError("bad payload"), ResponseError(400), Rejected(Reason.DO_NOT_RETRY), KeyError("x")],
)
def test_permanent_failures_park(error: Exception) -> None:
    decision = MessagePolicy().after_failure(_run(), error, START + 1.0)
    assert isinstance(decision, Park) and decision.reason is ParkReason.FAILED


def test_a_deadline_cut_parks_expired() -> None:
    decision = MessagePolicy().after_failure(_run(), DeadlineExceeded(), START + 1.0)
    assert isinstance(decision, Park) and decision.reason is ParkReason.EXPIRED


def test_the_last_attempt_parks_and_a_retry_that_would_expire_parks() -> None:
    policy = MessagePolicy(max_attempts=3)
    last = policy.after_failure(_run(attempt=3), TimeoutError(), START)
    assert isinstance(last, Park) and last.reason is ParkReason.ATTEMPTS
    short = Envelope(enqueued_at=START, valid_until=START + 1.0)
    pushback = ResponseError(503, retry_after=5.0)
    late = policy.after_failure(_run(short), pushback, START)
    assert isinstance(late, Park) and late.reason is ParkReason.EXPIRED


def test_a_spent_retry_budget_slows_retries_down_instead_of_looping() -> None:
    clock = ManualClock()
    budget = RetryBudget(0.1, min_per_second=0.0, window=10.0, clock=clock)
    policy = MessagePolicy(retry_budget=budget)
    for _ in range(20):  # 20 messages run: 2 retries allowed
        policy.before(Envelope(enqueued_at=START), START)
    delays = [policy.after_failure(_run(), TimeoutError(), START) for _ in range(5)]
    assert all(isinstance(d, RetryLater) for d in delays)
    assert [d.budget_exhausted for d in delays] == [False, False, True, True, True]  # type: ignore[union-attr]
    assert all(d.delay == 60.0 for d in delays[2:])  # type: ignore[union-attr]


def test_a_retry_after_longer_than_the_backoff_wins() -> None:
    decision = MessagePolicy().after_failure(_run(), ResponseError(503, retry_after=7.0), START)
    assert isinstance(decision, RetryLater) and decision.delay == 7.0


def test_a_backlog_bound_refuses_unless_exempt() -> None:
    bound = BacklogBound(max_depth=100, max_age=30.0, exempt=Priority.CRITICAL_PLUS)
    bound.check(99, 29.0, Priority.SHEDDABLE)
    bound.check(None, None, Priority.SHEDDABLE)  # unknown is not over
    with pytest.raises(Rejected) as full:
        bound.check(100, 0.0, Priority.CRITICAL)
    assert full.value.reason is Reason.BACKLOG_FULL and "max_depth" in str(full.value)
    with pytest.raises(Rejected) as old:
        bound.check(1, 31.0, Priority.CRITICAL)
    assert "max_age" in str(old.value) and old.value.retry_after == 1.0
    bound.check(10_000, 1e6, Priority.CRITICAL_PLUS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_age": 0},
        {"max_age": math.inf},
        {"max_attempts": 0},
        {"min_useful": -1},
        {"max_skew": math.nan},
        {"on_malformed": "drop"},
        {"default_ttl": -1},
    ],
)
def test_bad_policy_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MessagePolicy(**kwargs)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        BacklogBound()
    with pytest.raises(ValueError):
        BacklogBound(max_depth=-1)
    with pytest.raises(ValueError):
        BacklogBound(max_age=math.nan)


# -- the runner against a recording broker --------------------------------------------------


@dataclass
class Delivered:
    body: bytes
    headers: Mapping[str, Any]
    redeliveries: int = 0


@dataclass
class Recording:
    """A broker that records what the runner asked of it, in order."""

    log: list[tuple[str, Any]] = field(default_factory=list)
    fail_park: bool = False

    async def ack(self, delivery: Any) -> None:
        self.log.append(("ack", delivery))

    async def retry_later(self, delivery: Any, envelope: Envelope, delay: float) -> None:
        self.log.append(("retry", (envelope, delay)))

    async def park(
        self, delivery: Any, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        if self.fail_park:
            raise ConnectionError("broker down")
        self.log.append(("park", (envelope, reason, detail)))


def _hub() -> tuple[EventHub, list[Any]]:
    events = EventHub()
    seen: list[Any] = []

    class Sink:
        accepts_tallies = False

        def emit(self, event: Any) -> None:
            seen.append(event)

    events.subscribe(Sink())
    return events, seen


class Wall:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _delivery(env: Envelope, **extra: str) -> Delivered:
    return Delivered(b"payload", {**env.encode(), **extra})


async def test_a_message_runs_in_its_request_context_and_is_acknowledged() -> None:
    broker, (events, seen) = Recording(), _hub()
    got: list[Any] = []

    async def handler(message: Message) -> None:
        ctx = brownout.current()
        got.append((message.body, message.headers, message.attempt, ctx, brownout.remaining()))

    env = Envelope(
        enqueued_at=START - 1.0,
        valid_until=START + 5.0,
        idempotency_key="k",
        priority=Priority.SHEDDABLE,
        caller="web",
        operation="mail",
    )
    runner = MessageRunner(handler, broker, queue="mail", events=events, wall=Wall())
    decision = await runner.process(_delivery(env, **{"x-trace": "t"}))
    assert isinstance(decision, Run)
    body, headers, attempt, ctx, left = got[0]
    assert body == b"payload" and headers == {"x-trace": "t"} and attempt == 1
    assert (ctx.priority, ctx.caller, ctx.operation, ctx.idempotency_key) == (
        Priority.SHEDDABLE,
        "web",
        "mail",
        "k",
    )
    assert left is not None and 4.5 < left <= 5.0
    assert [kind for kind, _ in broker.log] == ["ack"]
    assert [type(e) for e in seen] == [MessageStarted, MessageCompleted]
    assert seen[0].source == "mail" and seen[0].age == pytest.approx(1.0)


async def test_the_handler_is_cancelled_at_the_message_deadline_and_parked() -> None:
    broker, (events, seen) = Recording(), _hub()

    async def slow(message: Message) -> None:
        await asyncio.sleep(10)

    env = Envelope(enqueued_at=START, valid_until=START + 0.05)
    runner = MessageRunner(slow, broker, queue="q", events=events, wall=Wall())
    decision = await asyncio.wait_for(runner.process(_delivery(env)), 2.0)
    assert isinstance(decision, Park) and decision.reason is ParkReason.EXPIRED
    assert [kind for kind, _ in broker.log] == ["park", "ack"]  # parked copy stored first
    parked_env, reason, _ = broker.log[0][1]
    assert reason == "expired" and parked_env.history[-1].event == "parked"
    assert isinstance(seen[-1], MessageParked) and seen[-1].reason == "expired"


async def test_a_transient_failure_is_enqueued_again_before_the_ack() -> None:
    broker, (events, seen) = Recording(), _hub()

    async def failing(message: Message) -> None:
        raise ConnectionResetError("dependency reset")

    runner = MessageRunner(failing, broker, queue="q", events=events, wall=Wall())
    decision = await runner.process(_delivery(Envelope(enqueued_at=START)))
    assert isinstance(decision, RetryLater)
    assert [kind for kind, _ in broker.log] == ["retry", "ack"]
    again, delay = broker.log[0][1]
    assert again.attempt == 2 and 0 <= delay <= 1.0
    assert isinstance(seen[-1], MessageRetried) and seen[-1].attempt == 2
    assert seen[-1].cause == "ConnectionResetError" and not seen[-1].deferred


async def test_expired_and_malformed_messages_never_run() -> None:
    broker, (events, _) = Recording(), _hub()
    ran: list[Message] = []

    async def handler(message: Message) -> None:
        ran.append(message)

    runner = MessageRunner(
        handler, broker, queue="q", policy=MessagePolicy(max_age=60), events=events, wall=Wall()
    )
    stale = await runner.process(_delivery(Envelope(enqueued_at=START - 61)))
    junk = await runner.process(Delivered(b"?", {"brownout-attempt": "x"}))
    assert isinstance(stale, Park) and stale.reason is ParkReason.TOO_OLD
    assert isinstance(junk, Park) and junk.reason is ParkReason.MALFORMED
    assert ran == []
    assert [kind for kind, _ in broker.log] == ["park", "ack", "park", "ack"]
    assert broker.log[2][1][0] is None  # a malformed message is parked as it came


async def test_a_broker_that_cannot_park_leaves_the_delivery_unacknowledged() -> None:
    broker = Recording(fail_park=True)

    async def handler(message: Message) -> None:
        raise ValueError("bad")

    runner = MessageRunner(handler, broker, queue="q", events=EventHub(), wall=Wall())
    with pytest.raises(ConnectionError):
        await runner.process(_delivery(Envelope(enqueued_at=START)))
    assert broker.log == []  # no ack: the broker delivers it again


async def test_a_full_consumer_defers_without_using_an_attempt() -> None:
    broker, (events, seen) = Recording(), _hub()
    bulkhead = Bulkhead(
        "consumer", limit=FixedLimit(1), queue=FifoQueue(1, max_wait=0.05), events=events
    )
    release = asyncio.Event()

    async def handler(message: Message) -> None:
        await release.wait()

    runner = MessageRunner(
        handler, broker, queue="q", bulkhead=bulkhead, events=events, wall=Wall()
    )
    first = asyncio.create_task(runner.process(_delivery(Envelope(enqueued_at=START))))
    await asyncio.sleep(0)
    second = asyncio.create_task(runner.process(_delivery(Envelope(enqueued_at=START))))
    third = await runner.process(_delivery(Envelope(enqueued_at=START, attempt=2)))
    assert isinstance(third, RetryLater) and third.envelope.attempt == 2
    assert third.envelope.history[-1].event == "deferred"
    release.set()
    await first
    await second
    deferred = [e for e in seen if isinstance(e, MessageRetried)]
    assert len(deferred) >= 1 and all(e.deferred for e in deferred)


async def test_a_publisher_stamps_refuses_over_the_bound_and_measures_once_per_period() -> None:
    sent: list[tuple[bytes, dict[str, str]]] = []
    readings: list[int] = []
    depth = [0]
    clock = ManualClock()
    events, seen = _hub()

    async def send(body: bytes, headers: dict[str, str]) -> None:
        sent.append((body, headers))

    async def measure() -> tuple[int | None, float | None]:
        readings.append(depth[0])
        await asyncio.sleep(0)
        return depth[0], None

    publisher = Publisher(
        "orders",
        send,
        bound=BacklogBound(max_depth=10, exempt=Priority.CRITICAL_PLUS),
        measure=measure,
        refresh=1.0,
        events=events,
        wall=Wall(),
        clock=clock,
    )
    async with brownout.request(deadline=3.0, caller="web"):
        await asyncio.gather(*(publisher.publish(b"o") for _ in range(5)))
    assert len(sent) == 5 and len(readings) == 1
    env = Envelope.decode(sent[0][1])
    assert env.caller == "web" and env.valid_until is not None
    depth[0] = 10
    await publisher.publish(b"o")  # the reading is fresh for a second
    clock.advance(1.0)
    with pytest.raises(Rejected) as info:
        await publisher.publish(b"o")
    assert info.value.reason is Reason.BACKLOG_FULL
    await publisher.publish(b"vip", priority=Priority.CRITICAL_PLUS)
    assert len(sent) == 7
    assert sum(isinstance(e, MessagePublished) for e in seen) == 7
    assert sum(isinstance(e, MessageRefused) for e in seen) == 1


async def test_a_publisher_without_measure_cannot_have_a_bound() -> None:
    async def send(body: bytes, headers: dict[str, str]) -> None:
        pass

    with pytest.raises(ValueError, match="measure"):
        Publisher("q", send, bound=BacklogBound(max_depth=1))


# -- signals: Stats and the Prometheus exporter count what the durable core decided --------


async def test_message_decisions_become_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from brownout import Stats
    from brownout.export.prometheus import register

    events = EventHub()
    stats = events.subscribe(Stats())
    broker = Recording()

    async def handler(message: Message) -> None:
        if message.body == b"bad":
            raise ValueError("bad")
        if message.body == b"flaky":
            raise ConnectionResetError("reset")

    runner = MessageRunner(
        handler,
        broker,
        queue="orders",
        policy=MessagePolicy(max_age=60),
        events=events,
        wall=Wall(),
    )
    for body, age in ((b"ok", 2.0), (b"ok", 30.0), (b"bad", 1.0), (b"flaky", 1.0), (b"ok", 61.0)):
        delivery = Delivered(body, Envelope(enqueued_at=START - age).encode())
        await runner.process(delivery)

    depth = [7]

    async def send(body: bytes, headers: dict[str, str]) -> None:
        pass

    async def measure() -> tuple[int | None, float | None]:
        return depth[0], 12.5

    publisher = Publisher(
        "orders",
        send,
        bound=BacklogBound(max_depth=10),
        measure=measure,
        events=events,
        refresh=0.0,
        wall=Wall(),
    )
    await publisher.publish(b"x")
    depth[0] = 10
    with pytest.raises(Rejected):
        await publisher.publish(b"x")
    stats.watch(publisher)

    assert stats.count("msg_started", source="orders") == 4
    assert stats.count("msg_completed", source="orders") == 2
    assert stats.count("msg_parked", reason="failed") == 1
    assert stats.count("msg_parked", reason="too_old") == 1
    assert stats.count("msg_retried", reason="ConnectionResetError") == 1
    assert stats.count("msg_published") == 1
    assert stats.count("msg_refused", reason="backlog_full") == 1
    assert stats.message_age["orders"].count == 4

    registry = CollectorRegistry()
    register(stats, registry)
    text = generate_latest(registry).decode()
    assert 'brownout_messages_completed_total{caller="unknown",operation="unknown"' in text
    assert "brownout_messages_parked_total{" in text and 'reason="too_old"' in text
    assert 'brownout_backlog_depth_messages{source="orders"} 10.0' in text
    assert 'brownout_backlog_oldest_age_seconds{source="orders"} 12.5' in text
    assert 'brownout_message_age_seconds_bucket{le="+Inf",source="orders"} 4.0' in text


async def test_a_backlog_monitor_keeps_gauges_fresh_and_drops_stale_ones() -> None:
    from brownout.durable import BacklogMonitor

    clock = ManualClock()
    readings = [(3, 1.5)]

    async def measure() -> tuple[int | None, float | None]:
        if not readings:
            raise ConnectionError("broker down")
        return readings.pop(0)

    monitor = BacklogMonitor("orders", measure, period=5.0, clock=clock)
    assert list(monitor.gauges()) == []  # nothing measured yet
    assert await monitor.sample() == (3, 1.5)
    assert list(monitor.gauges()) == [
        ("backlog_depth", {"source": "orders"}, 3.0),
        ("backlog_oldest_age", {"source": "orders"}, 1.5),
    ]
    assert await monitor.sample() == (None, None)  # the broker is down: logged, counted
    assert monitor.failures == 1
    clock.advance(15.0)
    assert len(list(monitor.gauges())) == 2  # three periods old: still reported
    clock.advance(0.1)
    assert list(monitor.gauges()) == []  # older: reported as nothing, not as a stale value
    with pytest.raises(ValueError):
        BacklogMonitor("q", measure, period=0)


async def test_a_backlog_monitor_runs_until_cancelled() -> None:
    from brownout.durable import BacklogMonitor

    calls: list[int] = []

    async def measure() -> tuple[int | None, float | None]:
        calls.append(1)
        return len(calls), None

    monitor = BacklogMonitor("q", measure, period=0.01)
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(calls) >= 3
    assert next(iter(monitor.gauges()))[0] == "backlog_depth"
