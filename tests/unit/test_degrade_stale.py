"""StaleCache (G1, G4): stale-while-revalidate with a hard maximum staleness, single flight,
LRU bound, age reporting, and loader failures, on virtual time (looptime)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import FailClosed, Priority, StaleCache
from brownout.events import Event, EventHub, StaleServed
from brownout.testing import ManualClock
from brownout.wire import STALE_AGE_HEADER, stale_headers

pytestmark = pytest.mark.looptime


class Source:
    """A loader whose answers, latency and failures the test controls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self.fail: BaseException | None = None
        self.seen_priority: list[Priority] = []

    async def __call__(self) -> str:
        self.calls += 1
        self.seen_priority.append(brownout.current().priority)
        n = self.calls
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return f"v{n}"


def cache(**kw: float) -> StaleCache[str, str]:
    args: dict[str, float] = {"max_entries": 100, "fresh_for": 5.0, "max_staleness": 60.0}
    args.update(kw)
    return StaleCache(
        max_entries=int(args["max_entries"]),
        fresh_for=args["fresh_for"],
        max_staleness=args["max_staleness"],
        failure_backoff=args.get("failure_backoff", 1.0),
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fresh_then_stale_while_revalidating() -> None:
    c = cache()
    src = Source(delay=1.0)
    value, age = await c.get("home", src)
    assert (value, age) == ("v1", pytest.approx(1.0))  # age counts from when the load began
    await asyncio.sleep(2)
    assert await c.get("home", src) == ("v1", pytest.approx(3.0))
    assert src.calls == 1
    await asyncio.sleep(3)  # 6 s old: stale
    value, age = await c.get("home", src)
    assert (value, age) == ("v1", pytest.approx(6.0))  # served at once, not after the refresh
    await settle()
    assert src.calls == 2
    await asyncio.sleep(1.5)  # the refresh (1 s) landed
    value, age = await c.get("home", src)
    assert value == "v2"
    assert age == pytest.approx(1.5)


async def test_background_refresh_is_low_priority_and_detached() -> None:
    c = cache()
    src = Source()
    async with brownout.request(priority=Priority.CRITICAL_PLUS, deadline=0.5):
        await c.get("k", src)
    await asyncio.sleep(10)
    async with brownout.request(priority=Priority.CRITICAL_PLUS, deadline=0.5):
        await c.get("k", src)
    await settle()
    # The foreground load runs in the caller's context; the refresh is background work (S3).
    assert src.seen_priority == [Priority.CRITICAL_PLUS, Priority.SHEDDABLE]


async def test_single_flight_on_miss_and_on_refresh() -> None:
    c = cache()
    src = Source(delay=1.0)
    results = await asyncio.gather(*(c.get("k", src) for _ in range(50)))
    assert {r.value for r in results} == {"v1"}
    assert src.calls == 1
    await asyncio.sleep(10)
    stale = await asyncio.gather(*(c.get("k", src) for _ in range(50)))
    assert {r.value for r in stale} == {"v1"}
    assert src.calls == 2  # one refresh for 50 stale hits
    # Different keys load independently.
    await asyncio.gather(c.get("a", src), c.get("b", src))
    assert src.calls == 4


async def test_refresh_failure_serves_stale_until_max_then_propagates() -> None:
    c = cache(failure_backoff=2.0)
    src = Source()
    await c.get("k", src)
    src.fail = ConnectionError("origin down")
    await asyncio.sleep(10)
    assert (await c.get("k", src)).value == "v1"
    await settle()  # the refresh failed in the background
    assert src.calls == 2
    assert (await c.get("k", src)).value == "v1"  # still stale, within the backoff
    assert src.calls == 2
    await asyncio.sleep(2)
    assert (await c.get("k", src)).value == "v1"
    await settle()
    assert src.calls == 3  # retried after the backoff, failed again
    await asyncio.sleep(60 - 12 - 0.001)
    value, age = await c.get("k", src)
    assert value == "v1"
    assert age <= 60.0
    await asyncio.sleep(0.01)  # now older than max_staleness: never served
    with pytest.raises(ConnectionError, match="origin down"):
        await c.get("k", src)
    src.fail = None
    value, age = await c.get("k", src)
    assert value.startswith("v")
    assert age == 0.0


async def test_miss_failure_propagates_and_caches_nothing() -> None:
    c = cache()
    src = Source()
    src.fail = TimeoutError()
    results = await asyncio.gather(*(c.get("k", src) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results)
    assert src.calls == 1
    assert "k" not in c


async def test_lru_bound() -> None:
    c = cache(max_entries=3)
    src = Source()
    for key in "abc":
        await c.get(key, src)
    await c.get("a", src)  # a is now the most recently used
    await c.get("d", src)
    assert len(c) == 3
    assert "b" not in c
    assert all(k in c for k in "acd")


async def test_per_call_bounds_for_degraded_modes() -> None:
    """A degraded mode may accept older content and skip refreshes entirely (G1)."""
    c = cache()
    src = Source()
    await c.get("k", src)
    await asyncio.sleep(30)
    value, age = await c.get("k", src, fresh_for=300.0, max_staleness=300.0)
    assert (value, age) == ("v1", pytest.approx(30.0))
    assert src.calls == 1  # treated as fresh: no refresh load on the struggling origin
    assert c.peek("k") is not None
    assert c.peek("k", max_staleness=10.0) is None


async def test_last_waiter_leaving_cancels_the_load() -> None:
    """D5: a load nobody waits for any more stops and frees what it holds."""
    c = cache()
    cancelled = asyncio.Event()

    async def slow() -> str:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await c.get("k", slow)
    await settle()
    assert cancelled.is_set()
    src = Source()
    assert (await c.get("k", src)).value == "v1"  # a new caller starts a new load


async def test_one_waiter_leaving_does_not_cancel_others() -> None:
    c = cache()
    src = Source(delay=2.0)
    impatient = asyncio.create_task(c.get("k", src))
    patient = asyncio.create_task(c.get("k", src))
    await asyncio.sleep(1)
    impatient.cancel()
    assert (await patient).value == "v1"
    assert src.calls == 1


async def test_load_timeout_bounds_loads() -> None:
    c: StaleCache[str, str] = StaleCache(
        max_entries=10, fresh_for=1, max_staleness=10, load_timeout=0.5
    )
    with pytest.raises(TimeoutError):
        await c.get("k", Source(delay=5))


async def test_fail_closed_loader_is_never_answered_from_memory() -> None:
    """G4: if authoritative data was (wrongly) put behind a cache, failing closed evicts it."""
    c = cache()
    src = Source()
    await c.get("k", src)
    src.fail = FailClosed("authorization")
    await asyncio.sleep(10)
    await c.get("k", src)  # stale hit starts a refresh, which fails closed
    await settle()
    assert "k" not in c
    with pytest.raises(FailClosed):
        await c.get("k", src)


async def test_stale_events_and_headers() -> None:
    events: list[Event] = []
    hub = EventHub()
    hub.subscribe(type("S", (), {"emit": staticmethod(events.append)})())
    c: StaleCache[str, str] = StaleCache(
        max_entries=10, fresh_for=1, max_staleness=10, name="home", events=hub
    )
    src = Source()
    await c.get("k", src)
    await asyncio.sleep(2)
    await c.get("k", src)
    stale = [e for e in events if isinstance(e, StaleServed)]
    assert len(stale) == 1
    assert stale[0].source == "home"
    assert stale[0].age == pytest.approx(2.0)
    assert stale[0].refreshing
    assert stale_headers(12.3456) == {"age": "12", STALE_AGE_HEADER: "12.346"}
    assert stale_headers(-1) == {"age": "0", STALE_AGE_HEADER: "0.000"}


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        StaleCache(max_entries=0, fresh_for=1, max_staleness=2)
    with pytest.raises(ValueError):
        StaleCache(max_entries=1, fresh_for=3, max_staleness=2)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcde"),  # key
            st.booleans(),  # the origin is up
            st.floats(min_value=0, max_value=30),  # time passing before the call
        ),
        min_size=1,
        max_size=40,
    )
)
def test_property_never_older_than_max_and_bounded(steps: list[tuple[str, bool, float]]) -> None:
    """Whatever the keys, timing and origin failures: nothing older than max_staleness is
    ever served, a failed load with nothing servable raises, and the size stays bounded."""

    async def scenario() -> None:
        clock = ManualClock()
        c: StaleCache[str, int] = StaleCache(
            max_entries=3, fresh_for=5, max_staleness=20, failure_backoff=1, clock=clock
        )
        version = 0
        up = True

        async def origin() -> int:
            nonlocal version
            if not up:
                raise ConnectionError
            version += 1
            return version

        for key, up, dt in steps:
            clock.advance(dt)
            try:
                value, age = await c.get(key, origin)
            except ConnectionError:
                assert not up
                assert c.peek(key) is None  # nothing servable was withheld
            else:
                assert 0 <= age <= 20
                assert value <= version
            for _ in range(3):
                await asyncio.sleep(0)  # let background refreshes land
            assert len(c) <= 3

    asyncio.run(scenario())


@pytest.mark.looptime
async def test_hung_background_refresh_does_not_block_the_key_forever() -> None:
    """G1/D5: with the default ``load_timeout=None`` a background refresh that hangs must not
    pin the key: once the value is too old, callers join that refresh; when they all give up
    it is cancelled, and the next caller loads again (the origin has recovered by then)."""
    c: StaleCache[str, str] = StaleCache(max_entries=10, fresh_for=1.0, max_staleness=5.0)
    state = {"hang": False, "calls": 0}

    async def loader() -> str:
        state["calls"] += 1
        n = state["calls"]
        if state["hang"]:
            await asyncio.Event().wait()  # a black-holed connection: never answers
        return f"v{n}"

    assert (await c.get("k", loader)).value == "v1"
    await asyncio.sleep(2)
    state["hang"] = True
    assert (await c.get("k", loader)).value == "v1"  # stale: one background refresh, hung
    await asyncio.sleep(10)  # now older than max_staleness: nothing may be served from memory
    state["hang"] = False  # the origin is back
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await c.get("k", loader)  # joins the hung refresh, gives up
    async with asyncio.timeout(1):
        served = await c.get("k", loader)  # must load again, not wait on the hung refresh
    assert served.value == "v3"


# -- bounded memory (100,000 distinct keys, as a crawler would send) ---------------------------


async def test_bounded_entries_under_100k_distinct_keys() -> None:
    c = cache(max_entries=50)
    src = Source()
    for i in range(100_000):
        await c.get(f"item-{i}", src)
    assert len(c) == 50
    # private: a finished flight left in the table costs memory but shows nowhere public
    assert not c._flights  # every load landed and let go of its flight


async def test_bounded_hanging_refreshes_of_evicted_keys_do_not_pile_up() -> None:
    """A refresh that never answers (a hung dependency, no ``load_timeout``) of a key the LRU
    then evicts refreshes nothing anyone can read: it is stopped, so the number of refreshes
    in flight stays within ``max_entries`` however many keys go by."""
    c = cache(max_entries=10, fresh_for=1.0)
    ok, hung = Source(), Source(delay=10**9)
    for i in range(1000):
        await c.get(f"item-{i}", ok)
        await asyncio.sleep(2.0)  # stale now
        await c.get(f"item-{i}", hung)  # served stale; starts a refresh that hangs
        await settle()
    assert len(c) == 10
    assert len(asyncio.all_tasks()) <= 10 + 1  # the hung refreshes were cancelled, not leaked


async def test_bounded_refreshes_in_flight_even_when_keys_are_invalidated() -> None:
    c = cache(max_entries=10, fresh_for=1.0)
    ok, hung = Source(), Source(delay=10**9)
    for i in range(1000):
        await c.get(f"item-{i}", ok)
        await asyncio.sleep(2.0)
        await c.get(f"item-{i}", hung)
        c.invalidate(f"item-{i}")  # its refresh keeps running, as documented
        await settle()
    assert len(asyncio.all_tasks()) <= 10 + 1  # refreshes in flight: at most one a key held
    value, _age = await c.get("new", ok)  # still answered (a foreground load)
    assert value.startswith("v")


async def test_a_slow_load_answer_older_than_fresh_for_is_counted_stale() -> None:
    """O2/G1: a caller that waited for a load slower than ``fresh_for`` gets content that old
    (its age counts from when the load began, and `stale_headers` says so): StaleServed
    counts it like a stale answer from memory (found by test_degrade_properties)."""
    events: list[Event] = []
    hub = EventHub()
    hub.subscribe(type("S", (), {"emit": staticmethod(events.append)})())
    c: StaleCache[str, str] = StaleCache(
        max_entries=10, fresh_for=1, max_staleness=10, name="home", events=hub
    )
    value, age = await c.get("k", Source(delay=3.0))
    assert (value, age) == ("v1", pytest.approx(3.0))
    stale = [e for e in events if isinstance(e, StaleServed)]
    assert [(e.source, e.age, e.refreshing) for e in stale] == [("home", 3.0, False)]
    await c.get("fast", Source(delay=0.5))  # within fresh_for: not stale
    assert len([e for e in events if isinstance(e, StaleServed)]) == 1


async def test_joined_load_reports_its_age_even_if_the_entry_is_gone_when_it_lands() -> None:
    """G1: a caller that joined a load reports the age of that load's content, even if the
    entry was evicted (or invalidated) before the caller resumed. It used to fall back to
    the time the caller arrived: 2 s instead of 5 s, under-reporting stale content."""
    c = cache(max_entries=1, fresh_for=1.0)
    first = asyncio.create_task(c.get("a", Source(delay=5.0)))
    await asyncio.sleep(3)
    joined = asyncio.create_task(c.get("a", Source(delay=5.0)))  # joins the load begun at 0
    other = asyncio.create_task(c.get("b", Source(delay=2.0)))  # lands at 5 too: evicts "a"
    assert await first == ("v1", pytest.approx(5.0))
    assert await joined == ("v1", pytest.approx(5.0))
    assert await other == ("v1", pytest.approx(2.0))
    assert "a" not in c
