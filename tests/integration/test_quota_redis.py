"""The Redis quota store against a real redis-server (F1, S2).

- the Lua script decides exactly like the pure GCRA, one EVALSHA per decision, keys expire;
- instances with different clocks share one quota (time is the server's);
- several PROCESSES sharing one quota admit within 5% of the configured rate over 10 s;
- a slow Redis (a socket that never answers) and a killed Redis fall back within the
  timeout (fail-open: local share; fail-closed: 503 reason) without hanging or hammering;
  a restarted Redis is picked up again automatically.

The shared server is 127.0.0.1:6379 (``BROWNOUT_TEST_REDIS``; the tests that need it fail
when it does not answer). Tests that kill or slow a server use their own throwaway
redis-server (the binary on PATH) on a free port; every test uses a unique key prefix.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests import services

import brownout
from brownout import Quota, Reason, RedisQuotaStore
from brownout._quota import GcraPolicy, decide
from brownout.events import Event, EventHub, QuotaBackendChanged
from brownout.testing import ManualClock

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = pytest.mark.integration

REDIS_SERVER = shutil.which("redis-server")
SHARED_HOST, SHARED_PORT = services.REDIS.host, services.REDIS.port
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")
ROOT = Path(__file__).resolve().parents[2]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait_until_answers(port: int, seconds: float = 5.0) -> None:
    stop = time.monotonic() + seconds
    while not _answers(port):
        if time.monotonic() > stop:
            raise RuntimeError(f"redis-server on port {port} did not come up")
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", autouse=True)
def shared_redis(redis_server: services.Service) -> None:
    """The shared Redis: the tests fail with how to start it when it does not answer."""


class ThrowawayRedis:
    """A private redis-server that a test may kill and restart on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if REDIS_SERVER is None:
            pytest.fail(
                "no redis-server binary on PATH: this test starts and kills a Redis of its "
                "own. Install it: apt-get install redis-server",
                pytrace=False,
            )
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", *NO_PERSISTENCE],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_until_answers(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def throwaway() -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis()
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def prefix() -> str:
    return f"bq-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def client() -> AsyncIterator[object]:
    c = redis_asyncio.Redis(host=SHARED_HOST, port=SHARED_PORT)
    try:
        yield c
    finally:
        await c.aclose()


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


# -- the script ------------------------------------------------------------------------------
async def test_script_decides_exactly_like_the_pure_gcra(client: object, prefix: str) -> None:
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    policy = GcraPolicy(rate=7.0, burst=4)
    import random

    rng = random.Random(42)
    now = 1_700_000_000.0  # an epoch-sized time, as the server's TIME would be
    tat: float | None = None
    for _ in range(300):
        now += rng.choice([0.0, 0.0, 0.01, 0.05, 0.1, 0.3, 1.0])
        cost = rng.choice([1, 1, 1, 2, 4])
        expected = decide(policy, tat, now, cost)
        got = await store.decide_at("k", policy, cost, now)
        assert got.allowed == expected.allowed
        assert got.remaining == expected.remaining
        assert got.retry_after == pytest.approx(expected.retry_after, abs=3e-6)
        assert got.reset == pytest.approx(expected.reset, abs=3e-6)
        if expected.allowed:
            tat = expected.tat


async def test_one_evalsha_per_decision_and_eval_only_when_the_script_is_unknown(
    throwaway: ThrowawayRedis, prefix: str
) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=throwaway.port)
    try:
        store = RedisQuotaStore(c, prefix=prefix, timeout=1.0)
        quota = Quota(rate=1000.0, burst=50, store=store, events=EventHub())
        await c.config_resetstat()
        for i in range(40):
            assert (await quota.check(f"caller-{i % 4}")).backend == "shared"
        stats = await c.info("commandstats")
        calls = {k: v["calls"] for k, v in stats.items()}
        # First call: EVALSHA misses (NOSCRIPT), EVAL loads it; then one EVALSHA each.
        assert calls.get("cmdstat_evalsha") == 40
        assert calls.get("cmdstat_eval") == 1
        assert store.script_loads == 1
        await c.script_flush()
        assert (await quota.check("caller-0")).allowed
        assert store.script_loads == 2
    finally:
        await c.aclose()


async def test_keys_expire_by_themselves_when_their_bucket_is_full(
    client: object, prefix: str
) -> None:
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(rate=100.0, burst=10, store=store, events=EventHub())
    for _ in range(10):
        assert (await quota.check("caller-42")).allowed
    refused = await quota.check("caller-42")
    assert not refused.allowed
    assert refused.reason is Reason.QUOTA
    assert 0 < refused.retry_after <= 0.011
    ttl = await client.pttl(store.key_name("caller-42"))  # type: ignore[attr-defined]
    assert 0 < ttl <= 101  # ten units at 100/s: the key matters for at most 100 ms
    await asyncio.sleep(0.25)
    assert await client.exists(store.key_name("caller-42")) == 0  # type: ignore[attr-defined]


async def test_instances_with_different_clocks_share_one_quota(client: object, prefix: str) -> None:
    """Time is the Redis server's: local clocks (here wildly apart) do not matter."""
    a = Quota(
        5.0,
        5,
        store=RedisQuotaStore(client, prefix=prefix),  # type: ignore[arg-type]
        clock=ManualClock(0.0),
        events=EventHub(),
    )
    b = Quota(
        5.0,
        5,
        store=RedisQuotaStore(client, prefix=prefix),  # type: ignore[arg-type]
        clock=ManualClock(1e9),
        events=EventHub(),
    )
    results = [await (a if i % 2 else b).check("tenant") for i in range(8)]
    assert [r.allowed for r in results] == [True] * 5 + [False] * 3
    assert results[-1].remaining == 0


# -- the fleet -------------------------------------------------------------------------------
WORKER = r"""
import asyncio, sys, time
import redis.asyncio as redis
from brownout import Quota, RedisQuotaStore
from brownout.events import EventHub

async def main(port, prefix, rate, burst, offered, seconds, host):
    client = redis.Redis(host=host, port=port)
    quota = Quota(rate, burst, store=RedisQuotaStore(client, prefix=prefix, timeout=0.5),
                  events=EventHub())
    await client.rpush(prefix + "ready", 1)
    await client.blpop([prefix + "go"], timeout=30)
    loop = asyncio.get_running_loop()
    start = loop.time()
    admitted = sent = failed = 0
    interval = 1.0 / offered
    next_at = start
    while loop.time() - start < seconds:
        d = await quota.check("shared-caller")
        sent += 1
        admitted += d.allowed
        failed += d.backend != "shared"
        next_at += interval
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
    await client.aclose()
    print(admitted, sent, failed)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                 float(sys.argv[5]), float(sys.argv[6]), sys.argv[7]))
"""


async def test_several_processes_share_one_quota_within_5_percent(
    client: object, prefix: str
) -> None:
    """Four processes, each offering 2x the whole quota, admit rate x 10 s + burst (+-5%)."""
    rate, burst, seconds, processes = 100.0, 10, 10.0, 4
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            str(SHARED_PORT),
            prefix,
            str(rate),
            str(burst),
            str(rate * 2),
            str(seconds),
            SHARED_HOST,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        async with asyncio.timeout(30):
            while await client.llen(prefix + "ready") < processes:  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
        await client.rpush(prefix + "go", *[1] * processes)  # type: ignore[attr-defined]
        outputs = await asyncio.wait_for(
            asyncio.gather(*(p.communicate() for p in procs)), timeout=seconds + 20
        )
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    admitted = sent = failed = 0
    for out, err in outputs:
        assert out, err.decode()
        a, s, f = map(int, out.split())
        admitted, sent, failed = admitted + a, sent + s, failed + f
    expected = rate * seconds + burst
    print(f"\nfleet: {processes} processes sent {sent}, admitted {admitted} (expected {expected})")
    assert failed == 0
    assert sent >= 2 * expected  # the quota was really under pressure
    assert abs(admitted - expected) <= 0.05 * rate * seconds


# -- failures --------------------------------------------------------------------------------
async def test_a_redis_that_never_answers_falls_back_within_the_timeout(prefix: str) -> None:
    """A slow store: a socket that accepts and never replies. Nothing hangs."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answer
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = redis_asyncio.Redis(host="127.0.0.1", port=port)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    try:
        quota = Quota(
            100.0,
            20,
            store=RedisQuotaStore(c, prefix=prefix, timeout=0.05),
            expected_instances=4,
            events=events,
        )
        loop = asyncio.get_running_loop()
        with brownout.deadline(0.01):  # the request's deadline is shorter than the timeout
            t0 = loop.time()
            d = await quota.check("a")
            assert loop.time() - t0 < 0.01 + 0.1
        assert d.backend == "fallback"
        assert not quota.fallback_active  # its own deadline ran out, not the store's fault
        t0 = loop.time()
        d = await quota.check("a")
        assert loop.time() - t0 < 0.05 + 0.2
        assert d.allowed and d.backend == "fallback"
        assert d.policy == GcraPolicy(25.0, 5)
        assert quota.fallback_active
        (event,) = sink.events
        assert isinstance(event, QuotaBackendChanged) and event.fallback
        assert "did not answer within 50 ms" in event.detail
    finally:
        await c.aclose()
        server.close()


async def test_redis_killed_mid_test_then_restarted(throwaway: ThrowawayRedis, prefix: str) -> None:
    """Killed: fail-open to rate / expected_instances within the timeout, with an event, and
    the dead Redis is probed only after a backoff. Restarted on the same port: shared again."""
    c = redis_asyncio.Redis(host="127.0.0.1", port=throwaway.port)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    store = RedisQuotaStore(c, prefix=prefix, timeout=0.05)
    quota = Quota(
        100.0,
        20,
        store=store,
        expected_instances=4,
        probe_backoff=0.1,
        max_probe_backoff=0.4,
        events=events,
    )
    loop = asyncio.get_running_loop()
    try:
        assert (await quota.check("k")).backend == "shared"
        throwaway.kill()
        t0 = loop.time()
        d = await quota.check("k")
        assert loop.time() - t0 < 0.05 + 0.2  # within the timeout (+ a noisy machine's margin)
        assert d.backend == "fallback" and d.allowed
        assert quota.fallback_active
        calls_before = store.calls
        decisions = []
        t0 = loop.time()
        while loop.time() - t0 < 1.0:
            decisions.append(await quota.check("k"))
            await asyncio.sleep(0.001)
        assert all(d.backend == "fallback" for d in decisions)
        assert len(decisions) > 200
        assert store.calls - calls_before <= 8  # probes after a doubling backoff, not 200+
        allowed = sum(d.allowed for d in decisions)
        assert allowed <= 25 * 1.0 + 5 + 2  # the local share: rate/4 plus burst/4

        throwaway.start()  # same port
        async with asyncio.timeout(5):
            while quota.fallback_active:
                await quota.check("k")
                await asyncio.sleep(0.01)
        assert (await quota.check("other")).backend == "shared"
        assert store.script_loads >= 2  # the fresh server did not know the script
        kinds = [(type(e), getattr(e, "fallback", None)) for e in sink.events]
        assert kinds == [(QuotaBackendChanged, True), (QuotaBackendChanged, False)]
    finally:
        await c.aclose()


async def test_fail_closed_refuses_with_a_503_reason_while_redis_is_down(prefix: str) -> None:
    port = _free_port()  # nothing listens there: connection refused
    c = redis_asyncio.Redis(host="127.0.0.1", port=port)
    try:
        quota = Quota(
            100.0,
            20,
            store=RedisQuotaStore(c, prefix=prefix, timeout=0.05),
            on_store_failure="closed",
            events=EventHub(),
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        d = await quota.check("a")
        assert loop.time() - t0 < 0.05 + 0.2
        assert not d.allowed
        assert d.reason is Reason.DEPENDENCY_UNAVAILABLE
        assert d.retry_after > 0
        with pytest.raises(brownout.Rejected) as caught:
            await quota.acquire("a")
        assert caught.value.reason is Reason.DEPENDENCY_UNAVAILABLE
    finally:
        await c.aclose()


# -- quota keys ------------------------------------------------------------------------------
async def test_a_caller_id_that_is_not_utf8_gets_a_shared_decision(client: object) -> None:
    """aiohttp hands ``b"\\xff"`` in a header over as ``"\\udcff"``: still just a key."""
    prefix = f"bq-review:{uuid.uuid4().hex[:12]}:"
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(100.0, 2, store=store, events=EventHub())
    hostile = b"tenant-\xff\xfe".decode("utf-8", "surrogateescape")
    first = await quota.check(hostile)  # raised UnicodeEncodeError into the request path
    assert first.backend == "shared" and first.allowed and first.remaining == 1
    assert (await quota.check(hostile)).allowed
    assert not (await quota.check(hostile)).allowed  # its own allowance, enforced
    # ... which no other key shares (not even one whose UTF-8 bytes look alike).
    for other in ("tenant-", "tenant-\xff\xfe", "tenant-\ufffd\ufffd", "tenant-\\udcff\\udcfe"):
        assert (await quota.check(other)).remaining == 1, other
    assert not quota.fallback_active and quota.store_failures == 0


# -- a key another application owns -------------------------------------------------------
async def test_one_key_of_the_wrong_type_does_not_take_the_quota_down_for_everyone(
    client: object,
) -> None:
    """Another app's list under one caller's key name (WRONGTYPE) is that key's problem: the
    failure policy decides that key, while every other caller keeps the shared quota."""
    prefix = f"bq-review:{uuid.uuid4().hex[:12]}:"
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    poisoned_name = store.key_name("tenant-7")
    await client.rpush(poisoned_name, "someone else's data")  # type: ignore[attr-defined]
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    quota = Quota(100.0, 5, store=store, on_store_failure="closed", events=events)
    try:
        for _ in range(3):
            poisoned = await quota.check("tenant-7")
            assert not poisoned.allowed and poisoned.reason is Reason.DEPENDENCY_UNAVAILABLE
            innocent = await quota.check("tenant-8")
            assert innocent.backend == "shared" and innocent.allowed  # was: 503 for everyone
        assert not quota.fallback_active and sink.events == []
        assert await client.lrange(poisoned_name, 0, -1) == [  # type: ignore[attr-defined]
            b"someone else's data"
        ]  # untouched
    finally:
        await client.delete(poisoned_name, store.key_name("tenant-8"))  # type: ignore[attr-defined]


# -- a stalled Redis and requests with short deadlines ---------------------------------------
@pytest.mark.parametrize("on_failure", ["open", "closed"])
async def test_a_stalled_redis_gives_40ms_requests_the_fallback_well_before_their_deadline(
    prefix: str, on_failure: str
) -> None:
    """Issue 24: Redis accepts connections and never answers (paused). Every request has 40 ms
    left, less than the store's 50 ms timeout. Each must get the failure policy's decision
    with at least a quarter of its time left (the check takes at most half of what is left),
    and the outage must be counted and announced as a real one: was, every request spent its
    whole deadline inside the check and the fallback was never announced."""

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answer
        writer.close()

    server = await asyncio.start_server(stall, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = redis_asyncio.Redis(host="127.0.0.1", port=port, retry=None)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    stats = events.subscribe(brownout.Stats())
    assert isinstance(stats, brownout.Stats)
    store = RedisQuotaStore(c, prefix=prefix, timeout=0.05)
    quota = Quota(
        100.0,
        20,
        store=store,
        name="api",
        on_store_failure=on_failure,  # type: ignore[arg-type]
        expected_instances=4,
        events=events,
    )
    try:
        for _ in range(8):
            with brownout.deadline(0.04):
                d = await quota.check("tenant-7")
                left = brownout.remaining()
            assert left is not None and left > 0.01, left  # well before the deadline
            if on_failure == "open":
                assert d.backend == "fallback" and d.policy == GcraPolicy(25.0, 5)
            else:
                assert d.backend == "closed" and d.reason is Reason.DEPENDENCY_UNAVAILABLE
        assert quota.fallback_active
        assert 1 <= quota.store_failures == store.calls <= 4  # then not asked until a probe
        changes = [e for e in sink.events if isinstance(e, QuotaBackendChanged)]
        assert [e.fallback for e in changes] == [True]
        assert "did not answer within" in changes[0].detail
        assert stats.quota_fallback == {"api": True}
    finally:
        await c.aclose()
        server.close()


@pytest.mark.parametrize("foreign", [b"someone else's session", b"12345", b"1e300"])
async def test_a_string_another_application_stored_under_the_key_is_left_alone(
    client: object, foreign: bytes
) -> None:
    """Issue 24: a string under the key's name (another application's value, even one that reads
    as a number) was taken for a quota's state and overwritten. Now: `QuotaKeyUnusable` for
    that key (its failure policy), every other key keeps the shared quota, and the value stays.
    """
    prefix = f"bq-review:{uuid.uuid4().hex[:12]}:"
    store = RedisQuotaStore(client, prefix=prefix, timeout=1.0)  # type: ignore[arg-type]
    quota = Quota(100.0, 5, store=store, on_store_failure="closed", events=EventHub())
    try:
        assert (await quota.check("tenant-7")).backend == "shared"
        names = [n async for n in client.scan_iter(match=prefix + "*")]  # type: ignore[attr-defined]
        assert len(names) == 1  # the one name the store uses for "tenant-7"
        (name,) = names
        await client.set(name, foreign)  # type: ignore[attr-defined]
        for _ in range(3):
            poisoned = await quota.check("tenant-7")
            assert not poisoned.allowed and poisoned.reason is Reason.DEPENDENCY_UNAVAILABLE
            assert (await quota.check("tenant-8")).backend == "shared"
        assert await client.get(name) == foreign  # type: ignore[attr-defined]
        assert await client.pttl(name) == -1  # no expiry set on it either  # type: ignore[attr-defined]
        assert not quota.fallback_active
    finally:
        async for n in client.scan_iter(match=prefix + "*"):  # type: ignore[attr-defined]
            await client.delete(n)  # type: ignore[attr-defined]


async def test_nested_prefixes_do_not_share_buckets(client: object) -> None:
    """Issue 24: ``api:`` with key ``admin:x`` and ``api:admin:`` with key ``x`` were one Redis
    key, so two quotas shared a bucket."""
    run = f"bq-review:{uuid.uuid4().hex[:12]}:"
    outer = Quota(
        100.0,
        1,
        store=RedisQuotaStore(client, prefix=run + "api:", timeout=1.0),  # type: ignore[arg-type]
        events=EventHub(),
    )
    inner = Quota(
        100.0,
        1,
        store=RedisQuotaStore(client, prefix=run + "api:admin:", timeout=1.0),  # type: ignore[arg-type]
        events=EventHub(),
    )
    try:
        assert (await outer.check("admin:x")).allowed
        d = await inner.check("x")
        assert d.backend == "shared" and d.allowed  # its own bucket: was refused
        assert not (await outer.check("admin:x")).allowed
        with pytest.raises(ValueError, match="prefix"):
            RedisQuotaStore(client, prefix="api:\x00")  # type: ignore[arg-type]
    finally:
        async for n in client.scan_iter(match=run + "*"):  # type: ignore[attr-defined]
            await client.delete(n)  # type: ignore[attr-defined]


async def test_the_store_decides_on_a_redis_cluster(
    redis_cluster: list[tuple[str, int]], prefix: str
) -> None:
    """Each decision is one script on one key, so it needs no hash tag: callers' keys spread
    over every node of the session's three-node cluster, and each node loads the script
    once (NOSCRIPT, then EVAL) before answering EVALSHA."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    c = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in redis_cluster])
    store = RedisQuotaStore(c, prefix=prefix, timeout=1.0)
    names = [store.key_name(f"caller-{i}") for i in range(12)]
    try:
        await c.initialize()  # (learns the slot map)
        assert len({c.get_node_from_key(name).name for name in names}) == 3
        policy = GcraPolicy(rate=7.0, burst=4)
        now = 1_700_000_000.0
        tats: dict[str, float] = {}
        for step in range(120):
            key = f"caller-{step % 12}"
            now += 0.02
            expected = decide(policy, tats.get(key), now, 1)
            got = await store.decide_at(key, policy, 1, now)
            assert (got.allowed, got.remaining) == (expected.allowed, expected.remaining)
            if expected.allowed:
                tats[key] = expected.tat
        assert 1 <= store.script_loads <= 3
    finally:
        await c.delete(*names)
        await c.aclose()
