"""The message scope (the handler's request context without a timer per message) and the
envelope decoder's fast path: the same results as `brownout.request` and the checked
constructor."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import brownout
from brownout import DeadlineExceeded, Priority
from brownout._context import NO_REQUEST
from brownout._durable.scope import MessageScope, MessageSweeper
from brownout.durable import Envelope, EnvelopeError, HistoryEntry

START = 1_800_000_000.0


def _env(**kw: object) -> Envelope:
    fields: dict[str, object] = {
        "enqueued_at": START,
        "priority": Priority.SHEDDABLE,
        "caller": "web",
        "operation": "mail",
        "idempotency_key": "k1",
    }
    fields.update(kw)
    return Envelope(**fields)  # type: ignore[arg-type]


async def test_the_scope_sets_the_same_context_as_a_request_scope() -> None:
    env = _env()
    async with brownout.request(
        deadline=50.0,
        priority=env.priority,
        caller=env.caller,
        operation=env.operation,
        attempt=3,
        idempotency_key=env.idempotency_key,
    ) as expected:
        pass
    scope = MessageScope()
    got = scope.enter(50.0, env, 3, MessageSweeper())
    try:
        assert brownout.current() is got
        for name in ("priority", "caller", "operation", "attempt", "idempotency_key"):
            assert getattr(got, name) == getattr(expected, name)
        assert got.deadline is not None and expected.deadline is not None
        assert got.deadline.origin == expected.deadline.origin == "local"
        assert got.deadline.remaining() == pytest.approx(50.0, abs=0.5)
    finally:
        scope.exit(None)
    assert brownout.current() is NO_REQUEST


async def test_the_scope_only_shortens_an_enclosing_deadline_and_keeps_its_key() -> None:
    async with brownout.request(deadline=2.0, idempotency_key="outer") as outer:
        scope = MessageScope()
        ctx = scope.enter(60.0, _env(idempotency_key=None), 1, MessageSweeper())
        try:
            assert ctx.deadline is outer.deadline
            assert ctx.idempotency_key == "outer"
        finally:
            scope.exit(None)
        assert brownout.current() is outer


async def test_a_near_deadline_gets_its_timer_at_once_a_far_one_at_a_sweep() -> None:
    sweeper = MessageSweeper(period=1.0)
    near, far = MessageScope(), MessageScope()
    far.enter(30.0, _env(), 1, sweeper)
    near.enter(1.5, _env(), 1, sweeper)  # (nested: exits first)
    try:
        assert near._handle is not None and near not in sweeper.pending
        assert far._handle is None and far in sweeper.pending
        assert sweeper.timer is not None
        sweeper.period = 0.0  # the next sweep finds every message old
        sweeper._sweep()
        assert far._handle is not None and not sweeper.pending
        assert far._handle.when() == pytest.approx(far._at)
    finally:
        near.exit(None)
        far.exit(None)
    assert far._handle is None and near._handle is None


async def test_a_message_that_ends_early_leaves_no_timer_behind() -> None:
    sweeper = MessageSweeper(period=1.0)
    scope = MessageScope()
    scope.enter(30.0, _env(), 1, sweeper)
    scope.exit(None)
    assert not sweeper.pending and scope._handle is None


@pytest.mark.parametrize("period", [10.0, 0.01])
async def test_the_handler_is_cancelled_at_its_deadline_either_way(period: float) -> None:
    # period 10: the timer is armed at once; period 0.01: by a sweep
    sweeper = MessageSweeper(period=period)

    async def handler() -> None:
        scope = MessageScope()
        scope.enter(0.1, _env(), 1, sweeper)
        try:
            await asyncio.sleep(10)
        except BaseException as error:
            scope.exit(error)
            raise
        scope.exit(None)

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(handler(), 5.0)
    assert time.monotonic() - started < 4.0
    assert not sweeper.pending


async def test_an_outer_cancellation_is_not_a_deadline() -> None:
    sweeper = MessageSweeper()
    entered = asyncio.Event()

    async def handler() -> None:
        scope = MessageScope()
        scope.enter(30.0, _env(), 1, sweeper)
        try:
            entered.set()
            await asyncio.sleep(10)
        except BaseException as error:
            scope.exit(error)
            raise

    task = asyncio.ensure_future(handler())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not sweeper.pending


async def test_a_deadline_already_past_raises_before_the_handler() -> None:
    scope = MessageScope()
    with pytest.raises(DeadlineExceeded):
        scope.enter(-0.1, _env(), 1, MessageSweeper())
    assert brownout.current() is NO_REQUEST


def test_decode_gives_the_checked_envelope_for_bytes_text_and_bytearray() -> None:
    env = _env(
        valid_until=START + 30,
        attempt=4,
        history=(HistoryEntry(START + 1, "retry", "boom"),),
    )
    text = env.encode()
    for headers in (
        text,
        {k: v.encode() for k, v in text.items()},
        {k: bytearray(v.encode()) for k, v in text.items()},
    ):
        got = Envelope.decode(headers)
        assert type(got) is Envelope and got == env and hash(got) == hash(env)
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.attempt = 9  # type: ignore[misc]


def test_decode_still_refuses_what_it_refused() -> None:
    good = {k: v.encode() for k, v in _env().encode().items()}
    for name, value, detail in (
        ("brownout-enqueued-at", b"\xff", "not UTF-8"),
        ("brownout-enqueued-at", b"x" * 20_000, "longer than"),
        ("brownout-enqueued-at", b"-1", "not a Unix time"),
        ("brownout-attempt", b"0", "not an attempt number"),
        ("brownout-caller", b"a\x00b", "printable"),
        ("brownout-priority", 7, "not text"),
    ):
        with pytest.raises(EnvelopeError, match=detail) as caught:
            Envelope.decode({**good, name: value})
        assert caught.value.field == name
    # more bytes than the limit but fewer characters (multi-byte UTF-8): still read
    history = '[{"at":1,"event":"e","detail":"' + "é" * 9000 + '"}]'
    assert len(history.encode()) > 16_384 >= len(history)
    got = Envelope.decode({**good, "brownout-history": history.encode()})
    assert got.history[0].detail == "é" * 256
