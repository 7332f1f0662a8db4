"""FailClosedGuard (G4): authoritative data is never served cached, stale or defaulted.

The matrix: every failure mode of the source (error, timeout, deadline, breaker open, other
refusals, a hang past the caller's deadline) x every way the guard can be wired (alone,
wrongly behind a StaleCache, wrongly reading through a StaleCache). After a successful read,
a failed read must never return the earlier value. Virtual time (looptime); the property
test runs arbitrary success/failure sequences.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import DeadlineExceeded, FailClosed, FailClosedGuard, Reason, Rejected, StaleCache
from brownout.events import Event, EventHub, GuardFailedClosed
from brownout.testing import ManualClock


class AuthzSource:
    """An authorization service: returns a new decision token per call, or fails as told."""

    def __init__(self) -> None:
        self.calls = 0
        self.failure: str | None = None

    async def __call__(self, user: str) -> str:
        self.calls += 1
        token = f"allow:{user}:{self.calls}"
        match self.failure:
            case None:
                return token
            case "error":
                raise ConnectionError("authz unreachable")
            case "raises_timeout":
                raise TimeoutError
            case "hangs":
                await asyncio.sleep(3600)
                return token
            case "deadline":
                async with brownout.deadline(0.01):  # the hop's own deadline expires inside
                    await asyncio.sleep(1)
                return token
            case "breaker_open":
                raise Rejected(Reason.BREAKER_OPEN, "authz breaker open", retry_after=5)
            case "budget_exhausted":
                raise Rejected(Reason.BUDGET_EXHAUSTED)
            case "overloaded":
                raise Rejected(Reason.OVERLOADED)
            case "unknown_500":
                raise RuntimeError("HTTP 500")
        raise AssertionError(self.failure)


FAILURES = [
    "error",
    "raises_timeout",
    "hangs",
    "deadline",
    "breaker_open",
    "budget_exhausted",
    "overloaded",
    "unknown_500",
]

Read = Callable[[FailClosedGuard, AuthzSource, StaleCache[str, str]], Awaitable[str]]


async def direct(guard: FailClosedGuard, src: AuthzSource, _: StaleCache[str, str]) -> str:
    return await guard.call(src, "ann")


async def guard_behind_cache(
    guard: FailClosedGuard, src: AuthzSource, cache: StaleCache[str, str]
) -> str:
    # The mistake: putting an authoritative read behind a content cache.
    value, _age = await cache.get("authz:ann", lambda: guard.call(src, "ann"))
    return value


async def cache_inside_guard(
    guard: FailClosedGuard, src: AuthzSource, cache: StaleCache[str, str]
) -> str:
    # The other mistake: the guarded source reads through a content cache.
    async def cached_source(user: str) -> str:
        value, _age = await cache.get(f"authz:{user}", lambda: src(user))
        return value

    return await guard.call(cached_source, "ann")


WIRINGS = {"direct": direct, "behind_cache": guard_behind_cache, "cache_inside": cache_inside_guard}


@pytest.mark.looptime
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("wiring", list(WIRINGS))
async def test_guarded_key_never_served_stale(failure: str, wiring: str) -> None:
    read = WIRINGS[wiring]
    guard = FailClosedGuard("authorization", timeout=0.5)
    cache: StaleCache[str, str] = StaleCache(max_entries=10, fresh_for=60, max_staleness=3600)
    src = AuthzSource()
    earlier: str | None = None
    if wiring == "direct":
        earlier = await read(guard, src, cache)
        assert earlier == "allow:ann:1"
    else:
        # Misuse fails closed from the very first read, so nothing is ever cached.
        with pytest.raises(FailClosed, match="cache"):
            await read(guard, src, cache)
        assert len(cache) == 0
    src.failure = failure
    for _ in range(3):
        with pytest.raises(FailClosed) as info:
            await read(guard, src, cache)
        assert info.value.reason is Reason.DEPENDENCY_UNAVAILABLE
        assert info.value.what == "authorization"
        await asyncio.sleep(1)
    assert len(cache) == 0
    src.failure = None
    if wiring == "direct":
        value = await read(guard, src, cache)
        assert value != earlier  # a new decision from the source, never a remembered one
        assert value == f"allow:ann:{src.calls}"


@pytest.mark.looptime
async def test_callers_deadline_expiring_is_not_a_value() -> None:
    """The caller's own deadline expires while the source hangs: the caller gets
    DeadlineExceeded (cancellation propagates through the guard), never a value."""
    guard = FailClosedGuard("payment-state")  # no timeout of its own
    src = AuthzSource()
    assert await guard.call(src, "ann")
    src.failure = "hangs"
    with pytest.raises(DeadlineExceeded):
        async with brownout.deadline(0.2):
            await guard.call(src, "ann")


@pytest.mark.looptime
async def test_outer_cancellation_propagates() -> None:
    guard = FailClosedGuard("tenant-isolation")
    src = AuthzSource()
    src.failure = "hangs"
    task = asyncio.create_task(guard.call(src, "ann"))
    await asyncio.sleep(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_decorator_and_events() -> None:
    events: list[Event] = []
    hub = EventHub()
    hub.subscribe(type("S", (), {"emit": staticmethod(events.append)})())
    guard = FailClosedGuard("inventory-ownership", clock=ManualClock(7.0), events=hub)

    @guard
    async def owner_of(item: str) -> str:
        if item == "broken":
            raise ConnectionError
        return "warehouse-3"

    assert await owner_of("sku-1") == "warehouse-3"
    with pytest.raises(FailClosed, match="inventory-ownership is unavailable"):
        await owner_of("broken")
    [event] = events
    assert isinstance(event, GuardFailedClosed)
    assert (event.at, event.what, event.cause) == (7.0, "inventory-ownership", "ConnectionError")


def test_guard_validates() -> None:
    with pytest.raises(ValueError):
        FailClosedGuard("")
    with pytest.raises(ValueError):
        FailClosedGuard("audit", timeout=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([None, *FAILURES[:2], *FAILURES[4:]]), min_size=1, max_size=12))
def test_property_every_answer_comes_from_this_call(steps: list[str | None]) -> None:
    """Whatever the sequence of successes and failures, an answer is the source's answer to
    *this* call; a failed call always raises FailClosed."""

    async def scenario() -> None:
        guard = FailClosedGuard("audit")
        src = AuthzSource()
        for failure in steps:
            src.failure = failure
            before = src.calls
            try:
                value = await guard.call(src, "ann")
            except FailClosed:
                assert failure is not None
            else:
                assert failure is None
                assert value == f"allow:ann:{before + 1}"

    asyncio.run(scenario())


@pytest.mark.looptime
async def test_through_a_real_dependency_with_breaker_and_timeout() -> None:
    """The same guarantee with the real outbound path: errors trip the real CircuitBreaker,
    and every later call (BREAKER_OPEN) and a hung call (the Dependency's timeout) fail
    closed; a remembered decision is never returned."""
    from brownout import CircuitBreaker, Dependency

    events = EventHub()
    breaker = CircuitBreaker(window=4, minimum_calls=4, open_for=30, events=events)
    authz = Dependency("authz", timeout=0.2, breaker=breaker, events=events)
    guard = FailClosedGuard("authorization", events=events)
    src = AuthzSource()

    async def read() -> str:
        return await guard.call(authz.call, src, "ann", idempotent=True)

    assert await read() == "allow:ann:1"
    src.failure = "error"
    causes = []
    for _ in range(8):
        with pytest.raises(FailClosed) as info:
            await read()
        causes.append(type(info.value.__cause__).__name__)
    assert causes[0] == "ConnectionError"
    assert causes[-1] == "Rejected"  # the breaker opened
    assert isinstance(info.value.__cause__, Rejected)
    assert info.value.__cause__.reason is Reason.BREAKER_OPEN

    hung = Dependency("authz-2", timeout=0.2, events=events)
    src.failure = "hangs"
    with pytest.raises(FailClosed):
        await guard.call(hung.call, src, "ann", idempotent=True)


@pytest.mark.looptime
async def test_every_refusal_is_counted_even_when_it_comes_from_inside() -> None:
    """O2/G4: a guard whose source fails closed itself (it reads another guarded source that
    is down, or wrongly reads through a StaleCache, which refuses) also refuses: that
    refusal is counted for it. It used to be re-raised uncounted, so a 503
    dependency_unavailable showed in no GuardFailedClosed (found by test_degrade_properties)."""
    events: list[Event] = []
    hub = EventHub()
    hub.subscribe(type("S", (), {"emit": staticmethod(events.append)})())
    authorization = FailClosedGuard("authorization", events=hub)
    payments = FailClosedGuard("payment-state", events=hub)
    cache: StaleCache[str, str] = StaleCache(max_entries=10, fresh_for=60, max_staleness=3600)

    async def payments_down() -> str:
        raise ConnectionError

    async def reads_payments() -> str:
        return await payments.call(payments_down)

    async def reads_a_cache() -> str:
        async def load() -> str:
            return "allow"

        return (await cache.get("authz", load)).value

    for source in (reads_payments, reads_a_cache):
        with pytest.raises(FailClosed):
            await authorization.call(source)
    counted = [(e.what, e.cause) for e in events if isinstance(e, GuardFailedClosed)]
    assert counted == [
        ("payment-state", "ConnectionError"),
        ("authorization", "FailClosed"),
        ("authorization", "FailClosed"),
    ]
    assert len(cache) == 0
