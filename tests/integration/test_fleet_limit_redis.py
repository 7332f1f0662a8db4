"""`FleetLimit` on a real Redis (B3): round trips, expiry, fencing, outages, Cluster.

- one ``EVALSHA`` per acquire and one ``ZREM`` per release, counted by the server itself
  (``INFO commandstats`` of a private redis-server);
- a lease nobody releases gives its slot back when it expires, and the next holder's fencing
  token is above the expired one's;
- Redis unreachable (a closed port): fail-closed refuses with ``dependency_unavailable``,
  fail-open admits at most ``limit // expected_instances`` here, each reported once;
- a Redis Cluster: both keys of a limit share a slot, so the script runs there.

The shared server is 127.0.0.1:6379 (``BROWNOUT_TEST_REDIS``); every test uses its own prefix.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from tests import services

from brownout import (
    FleetLimit,
    LeaseExpired,
    LeaseStoreUnavailable,
    LeaseUnfenced,
    Reason,
    RedisLeaseStore,
    Rejected,
)
from brownout.events import Event, EventHub, FleetStoreChanged, RequestShed

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = pytest.mark.integration

REDIS_SERVER = shutil.which("redis-server")
HOST, PORT = services.REDIS.host, services.REDIS.port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


@pytest.fixture(scope="module", autouse=True)
def shared_redis(redis_server: services.Service) -> None:
    """The shared Redis: the tests fail with how to start it when it does not answer."""


@pytest.fixture
def prefix() -> str:
    return f"bfl-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def client() -> AsyncIterator[object]:
    c = redis_asyncio.Redis(host=HOST, port=PORT)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture
def private_port() -> Iterator[int]:
    """A redis-server of this test's own, so the server's command counts are this test's."""
    if REDIS_SERVER is None:
        pytest.fail("no redis-server on PATH: apt-get install redis-server", pytrace=False)
    port = _free_port()
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        stop = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > stop:
                    raise
                time.sleep(0.02)
        yield port
    finally:
        proc.kill()
        proc.wait(5)


def _calls(stats: dict[str, dict[str, int]], command: str) -> int:
    return int(stats.get(command, {}).get("calls", 0))


async def test_one_round_trip_to_acquire_and_one_to_release(private_port: int) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    try:
        fleet = FleetLimit("orders-db", 3, redis=c, lease=5.0, timeout=1.0)
        async with fleet.acquire():  # loads the script (NOSCRIPT, then EVAL) once
            pass
        await c.config_resetstat()
        for _ in range(20):
            async with fleet.acquire() as lease:
                lease.check()
        stats = await c.info("commandstats")
        by_command = {k.removeprefix("cmdstat_"): v for k, v in stats.items()}
        assert _calls(by_command, "evalsha") == 20
        assert _calls(by_command, "zrem") == 20
        assert _calls(by_command, "eval") == 0
        # Nothing else reached the server: the rest ran inside the script (counted too).
        inside = {"time", "zremrangebyscore", "zcard", "incr", "zadd"}
        assert {_calls(by_command, name) for name in inside} == {20}
        others = set(by_command) - {"evalsha", "zrem", "config|resetstat", "info"} - inside
        assert not others, others
    finally:
        await c.aclose()


async def test_expired_leases_return_their_slots_and_are_fenced(
    client: object, prefix: str
) -> None:
    fleet = FleetLimit("db", 2, redis=client, prefix=prefix, lease=0.3, timeout=1.0)
    crashed = [await fleet.acquire().__aenter__() for _ in range(2)]  # never released
    with pytest.raises(Rejected) as refused:
        await fleet.acquire().__aenter__()
    assert refused.value.reason is Reason.OVERLOADED
    await asyncio.sleep(0.35)
    for lease in crashed:
        with pytest.raises(LeaseExpired):
            lease.check()
    async with fleet.acquire() as a, fleet.acquire() as b:
        a.check()
        b.check()
        old = max(x.token for x in crashed if x.token is not None)
        assert a.token is not None and b.token is not None
        assert min(a.token, b.token) > old
    leases, fence = fleet.store.key_names("db")  # type: ignore[attr-defined]
    assert await client.zcard(leases) == 0  # type: ignore[attr-defined]
    await client.delete(leases, fence)  # type: ignore[attr-defined]


async def test_renew_extends_on_the_server_and_refuses_an_expired_lease(
    client: object, prefix: str
) -> None:
    fleet = FleetLimit("db", 1, redis=client, prefix=prefix, lease=0.3, timeout=1.0)
    async with fleet.acquire() as lease:
        for _ in range(3):
            await asyncio.sleep(0.15)
            await lease.renew()
        lease.check()  # 0.45 s after the acquire: alive only because it was renewed
        with pytest.raises(Rejected):
            await fleet.acquire().__aenter__()
        await asyncio.sleep(0.35)
        with pytest.raises(LeaseExpired):
            lease.check()
        lease.expires_at = float("inf")  # pretend the local clock missed it: the server refuses
        with pytest.raises(LeaseExpired, match="not renewed"):
            await lease.renew()
    await client.delete(*fleet.store.key_names("db"))  # type: ignore[attr-defined]


async def test_concurrent_tasks_never_hold_more_than_the_limit(client: object, prefix: str) -> None:
    fleet = FleetLimit("db", 5, redis=client, prefix=prefix, lease=5.0, timeout=1.0)
    holding = 0
    peak = 0
    refused = 0

    async def one() -> None:
        nonlocal holding, peak, refused
        for _ in range(10):
            try:
                async with fleet.acquire():
                    holding += 1
                    peak = max(peak, holding)
                    await asyncio.sleep(0.002)
                    holding -= 1
            except Rejected:
                refused += 1
                await asyncio.sleep(0.001)

    await asyncio.gather(*(one() for _ in range(40)))
    assert peak == 5 and refused > 0
    await client.delete(*fleet.store.key_names("db"))  # type: ignore[attr-defined]


async def test_fail_closed_refuses_while_redis_is_unreachable() -> None:
    dead = redis_asyncio.Redis(host="127.0.0.1", port=_free_port())
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    fleet = FleetLimit("db", 4, redis=dead, on_store_failure="closed", timeout=0.5, events=events)
    started = time.monotonic()
    for _ in range(5):
        with pytest.raises(Rejected) as refused:
            await fleet.acquire().__aenter__()
        assert refused.value.reason is Reason.DEPENDENCY_UNAVAILABLE
    assert time.monotonic() - started < 2.0
    assert fleet.fallback_active and fleet.closed_refusals == 5
    assert fleet.store.calls == 1  # type: ignore[attr-defined]  # the rest wait for the probe
    changes = [e for e in sink.events if isinstance(e, FleetStoreChanged)]
    assert [e.fallback for e in changes] == [True]
    shed = [e.reason for e in sink.events if isinstance(e, RequestShed)]
    assert shed == [Reason.DEPENDENCY_UNAVAILABLE] * 5
    await dead.aclose()


async def test_fail_open_admits_this_instances_share_while_redis_is_unreachable() -> None:
    dead = redis_asyncio.Redis(host="127.0.0.1", port=_free_port())
    fleet = FleetLimit("db", 10, redis=dead, expected_instances=4, timeout=0.5)
    assert fleet.local_limit == 2
    held = [await fleet.acquire().__aenter__() for _ in range(2)]
    assert all(lease.token is None for lease in held)  # nothing to fence with
    for lease in held:
        lease.check()  # a local lease has no expiry: it may act while held
        assert lease.valid and lease.remaining == float("inf")
        await lease.renew()  # nothing to renew
        with pytest.raises(LeaseUnfenced, match="no fencing token"):
            lease.check(fenced=True)  # an action that needs a token must not run
    with pytest.raises(Rejected) as refused:
        await fleet.acquire().__aenter__()
    assert refused.value.reason is Reason.OVERLOADED
    await held[0].release()
    async with fleet.acquire() as again:
        again.check()
    await held[1].release()
    assert fleet.holders == 0 and fleet.fallback_grants == 3
    await dead.aclose()


async def test_the_store_comes_back_after_an_outage(private_port: int) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    fleet = FleetLimit("db", 2, redis=c, on_store_failure="closed", timeout=0.5, probe_backoff=0.05)
    await c.execute_command("CLIENT", "PAUSE", "700", "ALL")  # a stalled Redis
    with pytest.raises(Rejected) as refused:
        await fleet.acquire().__aenter__()
    assert refused.value.reason is Reason.DEPENDENCY_UNAVAILABLE
    await asyncio.sleep(0.3)
    stop = time.monotonic() + 5
    while True:
        try:
            async with fleet.acquire() as lease:
                assert lease.token is not None
            break
        except Rejected:
            assert time.monotonic() < stop, "the store never came back"
            await asyncio.sleep(0.05)
    assert not fleet.fallback_active
    await c.aclose()


async def test_the_limit_runs_on_a_redis_cluster(
    redis_cluster: list[tuple[str, int]], prefix: str
) -> None:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    c = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in redis_cluster])
    try:
        await c.initialize()
        store = RedisLeaseStore(c, prefix=prefix, timeout=1.0)
        names = [f"db-{i}" for i in range(9)]
        nodes = set()
        for name in names:
            leases, fence = store.key_names(name)
            assert c.keyslot(leases) == c.keyslot(fence)
            nodes.add(c.get_node_from_key(leases).name)
            fleet = FleetLimit(name, 1, store=store)
            async with fleet.acquire() as lease:
                assert lease.token == 1
                with pytest.raises(Rejected):
                    await fleet.acquire().__aenter__()
        assert len(nodes) >= 2  # the limits spread over the nodes
    finally:
        for name in names:
            await c.delete(*store.key_names(name))
        await c.aclose()


async def test_a_lease_outlives_its_connection_killed_and_is_released_once(
    private_port: int,
) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    admin = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    fleet = FleetLimit("db", 1, redis=c, lease=5.0, on_store_failure="closed", timeout=0.5)
    try:
        async with fleet.acquire() as lease:
            await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            await lease.renew()  # the client reconnects: the lease is still the store's
            await lease.release()
            await lease.release()  # twice, and again on leaving the block: no-ops
            assert fleet.holders == 0
        assert lease.token is not None
        async with fleet.acquire() as again:  # the one slot came back now, not at expiry
            assert again.token is not None and again.token > lease.token
        assert fleet.store_failures == 0 and not fleet.fallback_active
    finally:
        await admin.aclose()
        await c.aclose()


async def test_a_stalled_redis_bounds_renew_and_release_by_the_store_timeout(
    private_port: int,
) -> None:
    c = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    admin = redis_asyncio.Redis(host="127.0.0.1", port=private_port)
    fleet = FleetLimit("db", 2, redis=c, lease=5.0, on_store_failure="closed", timeout=0.3)
    try:
        lease = await fleet.acquire().__aenter__()
        await admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
        started = time.monotonic()
        with pytest.raises(LeaseStoreUnavailable):
            await lease.renew()
        await lease.release()  # the store does not answer: the lease is left to expire
        assert time.monotonic() - started < 2.0  # two calls, each cut at 0.3 s
        assert fleet.holders == 0 and fleet.store_failures == 2
    finally:
        await admin.aclose()
        await c.aclose()
