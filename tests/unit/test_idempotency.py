"""The idempotency layer's core on virtual time: keys, fingerprints, states, leases, bounds.

The store here is the real `InMemoryIdempotencyStore` on a `ManualClock`; the Redis and
PostgreSQL stores run the same decisions in tests/integration/test_idempotency_stores.py.
"""

from __future__ import annotations

import json

import pytest

from brownout import deadline
from brownout.events import EventHub, IdempotencyDecided
from brownout.idempotency import (
    OFF,
    REPLAYED_HEADER,
    Idempotency,
    IdempotencyKeyInvalid,
    IdempotencyRule,
    IdempotentAnswer,
    InMemoryIdempotencyStore,
    NoTransaction,
    Ticket,
    fingerprint,
    parse_key,
    store_key,
    transaction,
)
from brownout.testing import ManualClock


class Outcomes:
    accepts_tallies = True

    def __init__(self) -> None:
        self.seen: list[str] = []

    def emit(self, event: object) -> None:
        if isinstance(event, IdempotencyDecided):
            self.seen.append(event.outcome)


def layer(**kw: object) -> tuple[Idempotency, InMemoryIdempotencyStore, ManualClock, Outcomes]:
    clock = ManualClock(100.0)
    store = InMemoryIdempotencyStore(int(kw.pop("max_entries", 100)), clock=clock)  # type: ignore[call-overload]
    events = EventHub()
    outcomes = Outcomes()
    events.subscribe(outcomes)
    idem = Idempotency(store, events=events, clock=clock, **kw)  # type: ignore[arg-type]
    return idem, store, clock, outcomes


async def begin(
    idem: Idempotency,
    key: str | None = '"k1"',
    body: bytes = b'{"amount": 10}',
    *,
    method: str = "POST",
    target: str = "/payments",
    caller: str = "alice",
    remaining: float | None = None,
) -> IdempotentAnswer | Ticket | None:
    return await idem.begin(
        method=method,
        target=target,
        operation="/payments",
        key=key,
        body=body,
        caller=caller,
        remaining=remaining,
    )


def problem(answer: object, status: int, kind: str) -> IdempotentAnswer:
    assert isinstance(answer, IdempotentAnswer), answer
    assert answer.status == status
    assert ("content-type", "application/problem+json") in answer.headers
    doc = json.loads(answer.body)
    assert doc["status"] == status and doc["reason"] == f"idempotency_{kind}"
    return answer


# -- keys and fingerprints ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ('"abc"', "abc"),
        ("abc", "abc"),
        (' "a b" ', "a b"),
        ('"a\\"b"', 'a"b'),
        ("x" * 255, "x" * 255),
    ],
)
def test_keys_are_structured_field_strings_or_tokens(raw: str, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw", ['""', "", '"abc', 'a"b', '"a\\b"', "x" * 256, "caf\u00e9", '"a\\"']
)
def test_bad_keys_are_refused(raw: str) -> None:
    with pytest.raises(IdempotencyKeyInvalid):
        parse_key(raw)


def test_fingerprint_covers_method_target_and_body() -> None:
    base = fingerprint("POST", "/p?x=1", b"{}")
    assert fingerprint("post", "/p?x=1", b"{}") == base
    assert fingerprint("PATCH", "/p?x=1", b"{}") != base
    assert fingerprint("POST", "/p?x=2", b"{}") != base
    assert fingerprint("POST", "/p?x=1", b"{ }") != base


def test_keys_are_bound_to_the_caller() -> None:
    assert store_key("alice", "k") != store_key("bob", "k")
    assert store_key("a\x00b", "c") != store_key("a", "b\x00c")
    assert len(store_key("alice", "x" * 255)) == 64


# -- the states -----------------------------------------------------------------------------
async def test_first_runs_repeat_replays_byte_identical() -> None:
    idem, _, _, outcomes = layer()
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    assert (
        await ticket.complete(
            201, [("Content-Type", "application/json"), ("Date", "x")], b'{"id":7}'
        )
        is None
    )
    replay = await begin(idem)
    assert isinstance(replay, IdempotentAnswer) and replay.replayed
    assert replay.status == 201 and replay.body == b'{"id":7}'
    assert replay.headers == (("content-type", "application/json"), (REPLAYED_HEADER, "true"))
    assert outcomes.seen == ["executed", "stored", "replayed"]


async def test_repeat_while_running_is_409_with_retry_after_the_lease() -> None:
    idem, _, clock, outcomes = layer(lease_margin=5.0)
    ticket = await begin(idem, remaining=2.0)
    assert isinstance(ticket, Ticket)
    clock.advance(1.5)
    answer = problem(await begin(idem, remaining=2.0), 409, "in_progress")
    assert ("retry-after", "6") in answer.headers  # 2 + 5 - 1.5 = 5.5, rounded up
    assert answer.grpc_code == "ABORTED"
    assert outcomes.seen == ["executed", "in_progress"]


async def test_same_key_other_payload_is_422_running_or_done() -> None:
    idem, *_ = layer()
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    problem(await begin(idem, body=b'{"amount": 11}'), 422, "mismatch")
    await ticket.complete(200, [], b"ok")
    problem(await begin(idem, body=b'{"amount": 11}'), 422, "mismatch")
    problem(await begin(idem, target="/refunds"), 422, "mismatch")
    problem(await begin(idem, method="PATCH"), 422, "mismatch")


async def test_another_caller_with_the_same_key_runs_its_own() -> None:
    idem, *_ = layer()
    first = await begin(idem)
    assert isinstance(first, Ticket)
    await first.complete(200, [], b"alice's")
    second = await begin(idem, caller="bob")
    assert isinstance(second, Ticket)


async def test_missing_key_is_400_only_where_required() -> None:
    idem, _, _, outcomes = layer(operations={"/payments": IdempotencyRule(required=True)})
    answer = problem(await begin(idem, key=None), 400, "missing")
    assert answer.grpc_code == "INVALID_ARGUMENT"
    problem(await begin(idem, key='"'), 400, "invalid")
    relaxed, *_ = layer()
    assert await begin(relaxed, key=None) is None
    assert outcomes.seen == ["missing", "invalid"]


async def test_methods_and_operations_not_covered_pass_through() -> None:
    idem, *_ = layer(operations={"/payments": OFF})
    assert await begin(idem) is None
    idem, *_ = layer()
    assert await begin(idem, method="GET") is None
    assert await begin(idem, method="DELETE") is None
    assert isinstance(await begin(idem, method="patch"), Ticket)


async def test_key_from_the_request_context_when_no_header() -> None:
    from brownout import request

    idem, *_ = layer()
    with request(idempotency_key="ctx-key"):
        ticket = await begin(idem, key=None)
    assert isinstance(ticket, Ticket)
    problem(await begin(idem, key="ctx-key"), 409, "in_progress")


# -- how a run ends -------------------------------------------------------------------------
async def test_5xx_and_exceptions_release_the_key() -> None:
    idem, store, _, outcomes = layer()
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    await ticket.complete(503, [], b"down")
    assert len(store) == 0
    again = await begin(idem)
    assert isinstance(again, Ticket)
    await again.release()
    assert isinstance(await begin(idem), Ticket)
    assert outcomes.seen == ["executed", "released", "executed", "released", "executed"]


async def test_cancelled_run_stays_locked_until_the_lease_ends_then_runs_again() -> None:
    idem, _, clock, outcomes = layer(lease_margin=1.0)
    ticket = await begin(idem, remaining=3.0)
    assert isinstance(ticket, Ticket)
    ticket.abandon()
    clock.advance(3.9)
    problem(await begin(idem, remaining=3.0), 409, "in_progress")
    clock.advance(0.2)  # lease: 3 s of deadline + 1 s of margin
    retry = await begin(idem, remaining=3.0)
    assert isinstance(retry, Ticket)
    # the first run, still going past its lease, can no longer store over the retry's key
    await ticket.complete(200, [], b"late")
    await retry.complete(200, [], b"retry")
    replay = await begin(idem)
    assert isinstance(replay, IdempotentAnswer) and replay.body == b"retry"
    assert outcomes.seen == [
        "executed",
        "abandoned",
        "in_progress",
        "executed",
        "stored",
        "replayed",
    ]


async def test_completion_after_the_lease_is_lost_not_stored() -> None:
    idem, _store, clock, outcomes = layer(lease_margin=0.0)
    ticket = await begin(idem, remaining=1.0)
    assert isinstance(ticket, Ticket)
    clock.advance(1.5)
    await ticket.complete(200, [], b"late")
    assert outcomes.seen[-1] == "lease_lost"
    assert isinstance(await begin(idem), Ticket)


async def test_lease_follows_the_request_deadline() -> None:
    idem, _, _clock, _ = layer(lease_margin=0.5, default_lease=30.0)
    with deadline(2.0):
        ticket = await begin(idem)  # remaining from the context
    assert isinstance(ticket, Ticket)
    answer = problem(await begin(idem), 409, "in_progress")
    assert ("retry-after", "3") in answer.headers
    idem2, _, _, _ = layer(lease_margin=0.5, default_lease=30.0)
    await begin(idem2)
    answer = problem(await begin(idem2), 409, "in_progress")
    assert ("retry-after", "31") in answer.headers


async def test_answers_expire_after_the_rule_ttl() -> None:
    idem, _, clock, _ = layer(ttl=100.0, operations={"/payments": IdempotencyRule(ttl=10.0)})
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    await ticket.complete(200, [], b"ok")
    clock.advance(9.0)
    assert isinstance(await begin(idem), IdempotentAnswer)
    clock.advance(1.5)
    assert isinstance(await begin(idem), Ticket)


async def test_ending_twice_counts_once() -> None:
    idem, _, _, outcomes = layer()
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    await ticket.complete(200, [], b"ok")
    await ticket.release()
    ticket.abandon()
    assert outcomes.seen == ["executed", "stored"]
    assert isinstance(await begin(idem), IdempotentAnswer)


# -- bounds ---------------------------------------------------------------------------------
async def test_store_evicts_oldest_answers_and_refuses_when_running_keys_fill_it() -> None:
    idem, store, _, outcomes = layer(max_entries=2)
    for key in ("a", "b", "c"):
        t = await begin(idem, key=key)
        assert isinstance(t, Ticket)
        await t.complete(200, [], key.encode())
    assert len(store) == 2 and store.evicted == 1
    assert isinstance(await begin(idem, key="a"), Ticket)  # evicted: runs again
    assert isinstance(await begin(idem, key="d"), Ticket)
    answer = problem_503(await begin(idem, key="e"))
    assert answer.grpc_code == "UNAVAILABLE"
    assert store.refused == 1 and outcomes.seen[-1] == "unavailable_closed"


def problem_503(answer: object) -> IdempotentAnswer:
    assert isinstance(answer, IdempotentAnswer), answer
    assert answer.status == 503 and json.loads(answer.body)["reason"] == "dependency_unavailable"
    return answer


async def test_fail_open_runs_without_deduplication() -> None:
    idem, _store, _, outcomes = layer(max_entries=1, on_outage="open")
    assert isinstance(await begin(idem, key="a"), Ticket)
    assert await begin(idem, key="b") is None
    assert outcomes.seen == ["executed", "unavailable_open"]


async def test_bodies_and_answers_are_bounded() -> None:
    idem, store, _, outcomes = layer(max_body=10, max_response=50)
    problem(await begin(idem, body=b"x" * 11), 413, "too_large")
    ticket = await begin(idem, body=b"x" * 10)
    assert isinstance(ticket, Ticket)
    await ticket.complete(200, [], b"y" * 51)
    assert len(store) == 0 and outcomes.seen[-1] == "unstorable"


def test_bad_settings_are_refused() -> None:
    store = InMemoryIdempotencyStore()
    for kw in ({"ttl": 0}, {"ttl": float("nan")}, {"lease_margin": -1}, {"max_body": 0}):
        with pytest.raises(ValueError):
            Idempotency(store, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Idempotency(store, on_outage="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        InMemoryIdempotencyStore(float("nan"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        IdempotencyRule(ttl=-1)


async def test_transaction_outside_a_transactional_run_is_an_error() -> None:
    idem, *_ = layer()
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket) and ticket.connection is None
    with pytest.raises(NoTransaction):
        transaction()


async def test_stats_count_decisions_by_layer_and_outcome() -> None:
    from brownout import Stats

    clock = ManualClock()
    events = EventHub()
    stats = Stats()
    events.subscribe(stats)
    idem = Idempotency(
        InMemoryIdempotencyStore(clock=clock), events=events, clock=clock, name="payments"
    )
    ticket = await begin(idem)
    assert isinstance(ticket, Ticket)
    await ticket.complete(200, [], b"ok")
    await begin(idem)
    await begin(idem)
    assert stats.idempotency == {
        ("payments", "executed"): 1,
        ("payments", "stored"): 1,
        ("payments", "replayed"): 2,
    }
