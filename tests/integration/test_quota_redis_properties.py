"""Property tests of the Redis quota store against the in-memory one and against docs/quotas.md
(F1, S2), on a real redis-server.

How each store gets "now": `InMemoryQuotaStore` reads its injected clock; the Lua script reads
the Redis server's ``TIME`` unless the client passes one (`RedisQuotaStore.decide_at`, made for
this). So:

- the script and the in-memory store are driven with ONE virtual clock (``decide_at`` and a
  `ManualClock`), over several keys, costs and epoch-sized times, and must answer the same
  ``allowed`` and ``remaining``; ``retry_after`` and ``reset`` only up to the script's whole
  microseconds (it rounds them up, so a Redis Retry-After is never early);
- on the server's own clock (``decide``, production) what can be tested is tested: with a rate
  so slow that the test's real seconds refill nothing, the decisions are the in-memory store's,
  the key's state is stamped with the server's ``TIME``, and the key expires when full again;
- absurd costs, times and keys get the in-memory store's ``ValueError`` without a round trip, or
  an ordinary decision of their own key;
- with Redis unreachable (127.0.0.1:1, connection refused, with and without redis-py's own
  retries) `Quota` follows its failure policy within the store's timeout, asks the dead store
  only on the documented jittered, doubling probe schedule, announces the outage once, and
  when the store is back (a gate in front of the shared Redis) the first probe restores the
  shared quota with the shared state as the outage left it.

Virtual time and real key expiry: ``decide_at`` sets each key's expiry (``PX``) from virtual
time, but Redis expires it on its real clock, so rates here are slow enough (<= 2/s: every key
lives >= 0.5 s) that no key expires during one example. Every example uses its own key prefix
under one per-run prefix, and the run's keys are deleted at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import socket
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests import services

import brownout
from brownout import InMemoryQuotaStore, Quota, Reason, RedisQuotaStore
from brownout._quota import GcraPolicy, decide
from brownout.events import Event, EventHub, QuotaBackendChanged
from brownout.testing import ManualClock

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = pytest.mark.integration

HOST, PORT = services.REDIS.host, services.REDIS.port
DEAD_PORT = 1  # nothing listens on tcpmux: connection refused at once
RUN = f"bq-prop:{uuid.uuid4().hex[:12]}:"
_examples = itertools.count()
SETTINGS = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module", autouse=True)
def shared_redis(redis_server: services.Service) -> Iterator[None]:
    """The shared Redis (the tests fail when it does not answer); this run's keys are deleted
    after."""
    yield

    async def clean() -> int:
        c = redis_asyncio.Redis(host=HOST, port=PORT)
        try:
            keys = [k async for k in c.scan_iter(match=RUN + "*", count=1000)]
            if keys:
                await c.delete(*keys)
            return len([k async for k in c.scan_iter(match=RUN + "*", count=1000)])
        finally:
            await c.aclose()

    assert asyncio.run(clean()) == 0


def fresh_prefix() -> str:
    """A key space of its own for one hypothesis example, under this run's prefix."""
    return f"{RUN}{next(_examples)}:"


def live_client() -> object:
    return redis_asyncio.Redis(host=HOST, port=PORT, retry=None)


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


# -- 1. the script and the in-memory store on one virtual clock ------------------------------
US = 1e-6


@settings(SETTINGS, max_examples=150)
@given(
    rate=st.one_of(st.floats(0.01, 2.0), st.sampled_from([1 / 3, 0.1, 2.0])),
    burst=st.integers(1, 20),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.one_of(st.floats(0.0, 4.0), st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0])),
            st.integers(1, 20),
        ),
        min_size=1,
        max_size=60,
    ),
    start=st.sampled_from([0.0, 12_345.678, 1.7e9, 1_700_000_000.123456]),
)
async def test_the_script_and_the_memory_store_agree_on_one_virtual_clock(
    rate: float, burst: int, steps: list[tuple[str, float, int]], start: float
) -> None:
    policy = GcraPolicy(rate, burst)
    clock = ManualClock(start)
    memory = InMemoryQuotaStore(clock=clock)
    client = live_client()
    store = RedisQuotaStore(client, prefix=fresh_prefix(), timeout=2.0)  # type: ignore[arg-type]
    try:
        for key, gap, raw_cost in steps:
            cost = min(raw_cost, burst)
            clock.advance(gap / rate)
            now = clock.now()
            mem = memory.decide_now(key, policy, cost)
            red = await store.decide_at(key, policy, cost, now)
            assert red.allowed == mem.allowed, (key, now, cost, mem, red)
            assert red.remaining == mem.remaining, (key, now, cost, mem, red)
            # Whole microseconds, rounded up (plus the µs float's own spacing at 1.7e15).
            assert mem.retry_after - US <= red.retry_after <= mem.retry_after + 2 * US
            assert mem.reset - US <= red.reset <= mem.reset + 2 * US
            assert red.tat == pytest.approx(mem.tat, abs=US)
            if not red.allowed:
                # Redis's Retry-After is honest: the same request is allowed then, not before.
                assert decide(policy, red.tat, now + red.retry_after, cost).allowed
    finally:
        await client.aclose()  # type: ignore[attr-defined]


# -- 2. the server's own clock ----------------------------------------------------------------
@settings(SETTINGS, max_examples=40)
@given(
    burst=st.integers(1, 12),
    costs=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 12)), max_size=25),
)
async def test_on_the_servers_clock_decisions_are_the_memory_stores_and_keys_expire_when_full(
    burst: int, costs: list[tuple[str, int]]
) -> None:
    """``decide`` uses Redis ``TIME``. At 1 unit per 1000 s the test's real time refills
    nothing, so every decision is the in-memory store's on a frozen clock; the stored TAT is
    the server's time, and the key's expiry is its ``reset``."""
    policy = GcraPolicy(0.001, burst)
    memory = InMemoryQuotaStore(clock=ManualClock(0.0))
    client = live_client()
    prefix = fresh_prefix()
    store = RedisQuotaStore(client, prefix=prefix, timeout=2.0)  # type: ignore[arg-type]
    first: float | None = None
    try:
        for key, raw_cost in costs:
            cost = min(raw_cost, burst)
            before_s, before_us = await client.time()  # type: ignore[attr-defined]
            red = await store.decide(key, policy, cost)
            after_s, after_us = await client.time()  # type: ignore[attr-defined]
            before, after = before_s + before_us * US, after_s + after_us * US
            first = before if first is None else first
            mem = memory.decide_now(key, policy, cost)
            assert (red.allowed, red.remaining) == (mem.allowed, mem.remaining)
            # The frozen model is ahead of the server by the server time this example took.
            elapsed = after - first + 2 * US
            assert mem.retry_after - elapsed <= red.retry_after <= mem.retry_after + 2 * US
            assert mem.reset - elapsed <= red.reset <= mem.reset + 2 * US
            # The TAT is the server's TIME (not this process's clock) plus what still drains.
            assert before - 2 * US <= red.tat - red.reset <= after + 2 * US
            pttl = await client.pttl(store.key_name(key))  # type: ignore[attr-defined]
            assert 0 < pttl <= math.ceil(red.reset * 1000) + 1
    finally:
        await client.aclose()  # type: ignore[attr-defined]


# -- 3. absurd inputs ---------------------------------------------------------------------------
@settings(SETTINGS, max_examples=60)
@given(
    cost=st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=6, max_value=10**30),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    ),
    now=st.one_of(st.none(), st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 1e20, -1e15])),
)
async def test_absurd_costs_and_times_are_the_memory_stores_value_error_without_a_round_trip(
    cost: float, now: float | None
) -> None:
    """The error a caller gets for an impossible cost or clock reading does not depend on the
    store, and such a request never reaches Redis: a script error would read as an outage and
    switch every key of the quota to its fallback."""
    policy = GcraPolicy(10.0, 5)
    client = live_client()
    store = RedisQuotaStore(client, prefix=fresh_prefix(), timeout=1.0)  # type: ignore[arg-type]
    memory = InMemoryQuotaStore(clock=ManualClock(5.0))
    try:
        with pytest.raises(ValueError) as from_memory:
            memory.decide_now("k", policy, cost)  # type: ignore[arg-type]
        with pytest.raises(ValueError) as from_redis:
            if now is None:
                await store.decide("k", policy, cost)  # type: ignore[arg-type]
            else:
                await store.decide_at("k", policy, cost, now)  # type: ignore[arg-type]
        assert str(from_redis.value) == str(from_memory.value)
        if now is not None:  # a valid cost at an unusable time
            with pytest.raises(ValueError, match="now"):
                await store.decide_at("k", policy, 1, now)
        assert store.calls == 0
        quota = Quota(10.0, 5, store=store, events=EventHub())
        with pytest.raises(ValueError, match="cost"):
            await quota.check("k", cost)  # type: ignore[arg-type]
        assert not quota.fallback_active and quota.store_failures == 0
    finally:
        await client.aclose()  # type: ignore[attr-defined]


@settings(SETTINGS, max_examples=40)
@given(
    keys=st.lists(
        st.one_of(
            st.text(max_size=12),  # "", NUL, lone surrogates (aiohttp's surrogateescape)
            st.sampled_from(["", "\x00", "\udcff", "\ud800x", "k" * 200_000, "a:b", "*"]),
        ),
        min_size=1,
        max_size=5,
        unique=True,
    )
)
async def test_any_string_is_a_redis_key_of_its_own(keys: list[str]) -> None:
    """Empty, huge (200 kB), NUL, glob-looking or non-UTF-8 keys: each gets its own shared
    allowance, as in the in-memory store; none is an error or a store failure. Two lone
    surrogates and "?" are always among them: an encoding that replaced or dropped surrogates
    would merge their buckets."""
    keys = list(dict.fromkeys([*keys, "\udcff", "\udcfe", "?"]))
    policy = GcraPolicy(0.001, 2)
    client = live_client()
    store = RedisQuotaStore(client, prefix=fresh_prefix(), timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(0.001, 2, store=store, events=EventHub())
    try:
        for key in keys:
            d = await quota.check(key, 2)
            assert d.backend == "shared" and d.allowed and d.remaining == 0, key[:20]
        for key in keys:
            d = await quota.check(key, 1)
            assert d.backend == "shared" and not d.allowed, key[:20]
            assert d.retry_after == pytest.approx(1 / policy.rate, rel=1e-3)
        assert quota.store_failures == 0
    finally:
        await client.aclose()  # type: ignore[attr-defined]


# -- 4. Redis unreachable: the failure policy, its time bound, its probe schedule --------------
TIMEOUT = 0.05
MARGIN = 0.25  # a noisy machine's scheduling, on top of the documented bound


@settings(SETTINGS, max_examples=30)
@given(
    on_failure=st.sampled_from(["open", "closed"]),
    instances=st.integers(1, 8),
    client_retries=st.booleans(),
    probe_backoff=st.sampled_from([0.05, 0.5]),
    seed=st.integers(0, 2**16),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 20),
            st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0, 3.0]),
            st.sampled_from([None, None, 0.01, 1.0]),  # the request's own deadline
        ),
        min_size=1,
        max_size=25,
    ),
)
async def test_an_unreachable_redis_gets_the_failure_policy_within_the_timeout(
    on_failure: str,
    instances: int,
    client_retries: bool,
    probe_backoff: float,
    seed: int,
    steps: list[tuple[str, int, float, float | None]],
) -> None:
    """docs/quotas.md, "When Redis is slow or unreachable": every check returns within the
    store's timeout (or half the request's remaining time, if shorter); fail-open decides by
    the local share (``rate / expected_instances``, ``burst / expected_instances``, costs
    clamped to it), fail-closed refuses with DEPENDENCY_UNAVAILABLE and Retry-After = time to
    the next probe; the dead store is asked only when a probe is due (jittered 0.5..1 x a
    backoff doubling up to its cap), one outage is announced once, and timeouts cut short by
    the requests' own deadlines count against Redis once they add up to its timeout."""
    kwargs: dict[str, object] = {} if client_retries else {"retry": None}
    client = redis_asyncio.Redis(host="127.0.0.1", port=DEAD_PORT, **kwargs)
    store = RedisQuotaStore(client, prefix=fresh_prefix(), timeout=TIMEOUT)
    clock = ManualClock(1000.0)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    max_backoff = 4 * probe_backoff
    quota = Quota(
        100.0,
        20,
        store=store,
        on_store_failure=on_failure,  # type: ignore[arg-type]
        expected_instances=instances,
        probe_backoff=probe_backoff,
        max_probe_backoff=max_backoff,
        clock=clock,
        events=events,
        rng=random.Random(seed),
    )
    local = InMemoryQuotaStore(clock=clock)  # the model of the fail-open fallback
    share = GcraPolicy(100.0, 20).scaled(instances)
    loop = asyncio.get_running_loop()
    down = False  # has the outage been noticed (by the model)?
    backoff = probe_backoff
    last_call = -math.inf
    waited = 0.0  # what timeouts cut short by a deadline have waited (the model)
    try:
        for key, cost, advance, own_deadline in steps:
            clock.advance(advance)
            now = clock.now()
            calls = store.calls
            started = loop.time()
            async with asyncio.timeout(TIMEOUT + 2 * MARGIN):  # a hang fails, not stalls
                if own_deadline is None:
                    d = await quota.check(key, cost)
                else:
                    with brownout.deadline(own_deadline):
                        d = await quota.check(key, cost)
            bound = TIMEOUT if own_deadline is None else min(TIMEOUT, own_deadline / 2)
            assert loop.time() - started < bound + MARGIN
            asked = store.calls - calls
            assert asked <= 1
            if down:
                since = now - last_call
                if since < 0.5 * backoff:
                    assert asked == 0, "the dead store was asked before its probe was due"
                if since >= backoff:
                    assert asked == 1, "a due probe was not sent"
            else:
                assert asked == 1  # nothing known yet: the store is asked
            if asked:
                # A failure trips the fallback, and a failed probe backs off. A timeout cut
                # short by the request's own deadline (redis-py's retries turn "refused" into
                # a timeout) counts once those cut short add up to the store's timeout.
                cut = own_deadline / 2 if own_deadline is not None else TIMEOUT
                trip = True
                if client_retries and cut < TIMEOUT and not down:
                    waited += cut
                    if abs(waited - TIMEOUT) < cut / 2:  # within the clock's drift: either
                        trip = quota.fallback_active
                    else:
                        trip = waited >= TIMEOUT
                if trip:
                    if down:
                        backoff = min(backoff * 2, max_backoff)
                    down = True
                    last_call = now
            assert quota.fallback_active == down
            if on_failure == "open":
                expected = local.decide_now(key, share, min(cost, share.burst))
                assert d.backend == "fallback" and d.policy == share
                assert (d.allowed, d.remaining) == (expected.allowed, expected.remaining)
                assert d.retry_after == expected.retry_after
            else:
                assert d.backend == "closed" and not d.allowed
                assert d.reason is Reason.DEPENDENCY_UNAVAILABLE
                assert 0 < d.retry_after <= max(backoff, 0.001)
                assert d.headers() == {"Retry-After": str(max(1, math.ceil(d.retry_after)))}
        changes = [e for e in sink.events if isinstance(e, QuotaBackendChanged)]
        assert [e.fallback for e in changes] == ([True] if down else [])
        if changes:
            cause = "did not answer within 50 ms" if client_retries else "ConnectionError"
            assert cause in changes[0].detail
        assert quota.store_failures == store.calls
    finally:
        await client.aclose()


class Gate:
    """A TCP gate in front of the shared Redis: open, it forwards; shut, nothing listens on its
    port (connection refused) and the connections it carried are cut."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def open(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def shut(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            await self._server.wait_closed()
            self._server = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, PORT)
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._writers -= {writer, up_writer}


@pytest.fixture
async def gate() -> AsyncIterator[Gate]:
    g = Gate()
    await g.open()
    try:
        yield g
    finally:
        await g.shut()


@settings(SETTINGS, max_examples=25)
@given(
    on_failure=st.sampled_from(["open", "closed"]),
    seed=st.integers(0, 2**16),
    before=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 3)), max_size=6),
    outage=st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.7]), min_size=1, max_size=10),
    after=st.lists(st.sampled_from([0.01, 0.05, 0.2, 0.5]), min_size=1, max_size=30),
)
async def test_when_redis_is_back_the_first_probe_restores_the_shared_quota(
    gate: Gate,
    on_failure: str,
    seed: int,
    before: list[tuple[str, int]],
    outage: list[float],
    after: list[float],
) -> None:
    """docs/quotas.md: "The first successful probe switches back to the shared quota." It comes
    no later than one (capped) backoff after the store is back; the shared state is what the
    outage left (the fallback never wrote to it), the local fallback is forgotten, and the
    recovery is announced."""
    rate, burst = 0.001, 6  # nothing refills during the test: shared state is exact
    prefix = fresh_prefix()
    client = redis_asyncio.Redis(host="127.0.0.1", port=gate.port, retry=None)
    store = RedisQuotaStore(client, prefix=prefix, timeout=0.2)
    clock = ManualClock(0.0)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    quota = Quota(
        rate,
        burst,
        store=store,
        on_store_failure=on_failure,  # type: ignore[arg-type]
        expected_instances=2,
        probe_backoff=0.1,
        max_probe_backoff=0.4,
        clock=clock,
        events=events,
        rng=random.Random(seed),
    )
    used = {"a": 0, "b": 0}
    await gate.open()  # an earlier (failed) example may have left it shut
    try:
        for key, cost in before:
            d = await quota.check(key, cost)
            assert d.backend == "shared"
            used[key] += cost if d.allowed else 0
        await gate.shut()
        for advance in outage:
            clock.advance(advance)
            d = await quota.check("a")
            assert d.backend == ("fallback" if on_failure == "open" else "closed")
        assert quota.fallback_active
        await gate.open()
        back_at = clock.now()
        recovered = None
        for advance in after:
            clock.advance(advance)
            calls = store.calls
            d = await quota.check("b")
            if store.calls > calls:  # the first probe since the store is back
                recovered = d
                break
            assert d.backend in ("fallback", "closed")
        if recovered is None:
            assert clock.now() - back_at < 0.4  # no probe was due yet
            return
        assert clock.now() - back_at <= 0.4 + max(after)
        assert recovered.backend == "shared" and not quota.fallback_active
        assert len(quota._fallback) == 0  # the local allowances are forgotten
        used["b"] += 1 if recovered.allowed else 0
        assert recovered.remaining == max(burst - used["b"], 0)
        d = await quota.check("a", 1)
        assert d.backend == "shared"
        assert d.allowed == (used["a"] < burst)
        assert d.remaining == max(burst - used["a"] - (1 if d.allowed else 0), 0)
        changes = [e.fallback for e in sink.events if isinstance(e, QuotaBackendChanged)]
        assert changes == [True, False]
    finally:
        await client.aclose()
