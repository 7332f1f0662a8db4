"""`SyncMessageRunner`: the same decisions and events as `MessageRunner`, in the caller's
thread, on an injected wall clock and a manual monotonic clock."""

from __future__ import annotations

from typing import Any

import pytest

import brownout
from brownout._retry import ExponentialBackoff
from brownout.durable import Envelope, MessagePolicy, Park, RetryLater, Run, SyncMessageRunner
from brownout.events import EventHub, MessageCompleted, MessageParked, MessageRetried
from brownout.testing import EventRecorder, ManualClock

START = 1_700_000_000.0


class Broker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def ack(self, delivery: Any) -> None:
        self.calls.append(("ack", None))

    def retry_later(self, delivery: Any, envelope: Envelope, delay: float) -> None:
        self.calls.append(("retry", (envelope.attempt, delay)))

    def park(self, delivery: Any, envelope: Envelope | None, reason: str, detail: str) -> None:
        self.calls.append(("park", reason))


class Delivery:
    def __init__(self, headers: dict[str, str], redeliveries: int = 0) -> None:
        self.body = b"x"
        self.headers = headers
        self.redeliveries = redeliveries


class Control(Exception):
    pass


def runner(wall: list[float], **policy: Any) -> tuple[SyncMessageRunner, Broker, EventRecorder]:
    broker, events = Broker(), EventHub()
    recorder = EventRecorder(events).start()
    run = SyncMessageRunner(
        broker,
        queue="q",
        policy=MessagePolicy(backoff=ExponentialBackoff(0.05, cap=0.1), **policy),
        passthrough=(Control,),
        events=events,
        wall=lambda: wall[0],
        clock=ManualClock(),
    )
    return run, broker, recorder


def headers(ttl: float, key: str = "k") -> dict[str, str]:
    return Envelope.stamp(START, None, ttl=ttl, idempotency_key=key).encode()


def test_runs_inside_the_message_context_and_returns_the_result() -> None:
    wall = [START + 1.0]
    run, broker, recorder = runner(wall)

    def handler(message: Any) -> float | None:
        assert brownout.current().idempotency_key == "k"
        return brownout.remaining()

    outcome = run.process(Delivery(headers(ttl=10.0)), handler)
    assert isinstance(outcome.decision, Run)
    assert outcome.result == pytest.approx(9.0)
    assert broker.calls == [("ack", None)]
    assert len(recorder.of(MessageCompleted)) == 1
    assert brownout.current().idempotency_key is None  # restored


def test_expired_and_malformed_messages_are_parked_without_running() -> None:
    wall = [START + 5.0]
    run, broker, recorder = runner(wall)
    ran: list[int] = []
    expired = run.process(Delivery(headers(ttl=1.0)), lambda m: ran.append(1))
    malformed = run.process(Delivery({"brownout-enqueued-at": "soon"}), lambda m: ran.append(2))
    assert [type(expired.decision), type(malformed.decision)] == [Park, Park]
    assert ran == []
    assert [e.reason for e in recorder.of(MessageParked)] == ["expired", "malformed"]
    assert broker.calls == [("park", "expired"), ("ack", None)] * 1 + [
        ("park", "malformed"),
        ("ack", None),
    ]


def test_transient_failures_retry_then_park_out_of_attempts() -> None:
    wall = [START]
    run, _broker, recorder = runner(wall, max_attempts=2)

    def down(message: Any) -> None:
        raise ConnectionError("down")

    first = run.process(Delivery(headers(ttl=60.0)), down)
    assert isinstance(first.decision, RetryLater)
    second = run.process(Delivery(first.decision.envelope.encode()), down)
    assert isinstance(second.decision, Park) and second.decision.reason.value == "attempts"
    assert [e.attempt for e in recorder.of(MessageRetried)] == [2]


def test_a_failure_past_the_deadline_is_parked_expired_and_control_flow_passes() -> None:
    wall = [START]
    run, _, _ = runner(wall)

    def late(message: Any) -> None:
        run.clock.advance(2.0)  # type: ignore[attr-defined]
        raise ConnectionError("late")

    outcome = run.process(Delivery(headers(ttl=1.0)), late)
    assert isinstance(outcome.decision, Park) and outcome.decision.reason.value == "expired"

    def control(message: Any) -> None:
        raise Control

    with pytest.raises(Control):
        run.process(Delivery(headers(ttl=60.0)), control)
