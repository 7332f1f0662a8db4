"""`ThreadFleetLimit` on a real Redis from real threads (B3, W1): the asyncio limit's decisions.

- one ``EVALSHA`` per acquire and one ``ZREM`` per release (a private redis-server's
  ``INFO commandstats``), with the asyncio limit's Lua scripts;
- 16 threads never hold more than the limit, and do reach it;
- an unreleased lease's slot returns at expiry, and the next token is above it;
- Redis unreachable: fail-closed refuses, fail-open admits this instance's share with
  ``token=None`` leases that ``check(fenced=True)`` refuses; each reported once as
  `FleetStoreChanged` and kept by `Stats` as ``fleet_fallback_active``;
- a client that could block without bound is refused when the limit is built.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from tests import services
from tests.integration.test_fleet_limit_redis import _calls, _free_port, private_port  # noqa: F401

import brownout
from brownout import (
    BlockingRedisLeaseStore,
    LeaseExpired,
    LeaseUnfenced,
    Reason,
    Rejected,
    Stats,
    ThreadFleetLimit,
)
from brownout._admission.protocols import AdmitsWorkBlocking
from brownout.events import Event, EventHub, FleetStoreChanged, RequestShed

redis = pytest.importorskip("redis")
from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402

pytestmark = pytest.mark.integration

HOST, PORT = services.REDIS.host, services.REDIS.port


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)


def sync_client(port: int = PORT, timeout: float = 0.5) -> redis.Redis:
    return redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


@pytest.fixture(scope="module", autouse=True)
def shared_redis(redis_server: services.Service) -> None:
    """The shared Redis: the tests fail with how to start it when it does not answer."""


@pytest.fixture
def prefix() -> str:
    return f"bfl-thread:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = sync_client()
    try:
        yield c
    finally:
        c.close()


def test_one_round_trip_each_way_with_the_same_scripts(private_port: int) -> None:  # noqa: F811
    c = sync_client(private_port)
    try:
        fleet = ThreadFleetLimit("orders-db", 3, redis=c, lease=5.0, timeout=0.5)
        assert isinstance(fleet, AdmitsWorkBlocking)
        with fleet.admit():  # loads the script (NOSCRIPT, then EVAL) once
            pass
        c.config_resetstat()
        for _ in range(20):
            with fleet.acquire() as lease:
                lease.check(fenced=True)
        by_command = {k.removeprefix("cmdstat_"): v for k, v in c.info("commandstats").items()}
        assert _calls(by_command, "evalsha") == 20
        assert _calls(by_command, "zrem") == 20
        assert _calls(by_command, "eval") == 0
        assert fleet.holders == 0
    finally:
        c.close()


def test_threads_never_hold_more_than_the_limit(client: redis.Redis, prefix: str) -> None:
    fleet = ThreadFleetLimit("db", 4, redis=client, prefix=prefix, lease=5.0, timeout=0.5)
    lock = threading.Lock()
    holding = peak = refused = 0
    reasons: set[Reason] = set()
    start = threading.Barrier(16)

    def one() -> None:
        nonlocal holding, peak, refused
        start.wait()
        for _ in range(15):
            try:
                with fleet.admit():
                    with lock:
                        holding += 1
                        peak = max(peak, holding)
                    time.sleep(0.003)
                    with lock:
                        holding -= 1
            except Rejected as e:
                with lock:
                    refused += 1
                    reasons.add(e.reason)
                time.sleep(0.001)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak == 4 and refused > 0
    assert reasons == {Reason.OVERLOADED}
    assert fleet.holders == 0
    leases, fence = fleet.store.key_names("db")  # type: ignore[attr-defined]
    assert client.zcard(leases) == 0
    client.delete(leases, fence)


def test_an_unreleased_lease_expires_and_is_fenced(client: redis.Redis, prefix: str) -> None:
    fleet = ThreadFleetLimit("db", 1, redis=client, prefix=prefix, lease=0.3, timeout=0.5)
    crashed = fleet.acquire().__enter__()  # never released: its holder "crashed"
    with pytest.raises(Rejected):
        fleet.acquire().__enter__()
    time.sleep(0.35)
    with pytest.raises(LeaseExpired):
        crashed.check()
    with fleet.acquire() as lease:
        assert lease.token is not None and crashed.token is not None
        assert lease.token > crashed.token
        lease.renew()  # extends an unexpired lease on the server
    crashed.expires_at = float("inf")  # pretend the local clock missed it: the server refuses
    with pytest.raises(LeaseExpired, match="not renewed"):
        crashed.renew()
    client.delete(*fleet.store.key_names("db"))  # type: ignore[attr-defined]


def test_fail_closed_refuses_while_redis_is_unreachable() -> None:
    dead = sync_client(_free_port())
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    stats = Stats()
    events.subscribe(stats)
    fleet = ThreadFleetLimit(
        "db", 4, redis=dead, on_store_failure="closed", timeout=0.5, events=events
    )
    for _ in range(5):
        with pytest.raises(Rejected) as refused:
            fleet.acquire().__enter__()
        assert refused.value.reason is Reason.DEPENDENCY_UNAVAILABLE
    assert fleet.fallback_active and fleet.closed_refusals == 5
    assert fleet.store.calls == 1  # type: ignore[attr-defined]  # the rest wait for the probe
    changes = [e for e in sink.events if isinstance(e, FleetStoreChanged)]
    assert [(e.source, e.fallback) for e in changes] == [("db", True)]
    shed = [e.reason for e in sink.events if isinstance(e, RequestShed)]
    assert shed == [Reason.DEPENDENCY_UNAVAILABLE] * 5
    gauges = {(name, labels.get("source")): v for name, labels, v in stats.gauges()}
    assert gauges[("fleet_fallback_active", "db")] == 1.0
    assert ("quota_fallback_active", "db") not in gauges  # a fleet limit is not a quota
    dead.close()


def test_fail_open_admits_this_instances_share_without_fencing() -> None:
    dead = sync_client(_free_port())
    fleet = ThreadFleetLimit("db", 10, redis=dead, expected_instances=4, timeout=0.5)
    held = [fleet.acquire().__enter__() for _ in range(2)]
    assert all(lease.token is None for lease in held)
    for lease in held:
        lease.check()  # a local lease has no expiry: it may act while held
        lease.renew()  # nothing to renew
        with pytest.raises(LeaseUnfenced):
            lease.check(fenced=True)  # ...but not where a fencing token is required
    with pytest.raises(Rejected) as refused:
        fleet.acquire().__enter__()
    assert refused.value.reason is Reason.OVERLOADED
    for lease in held:
        lease.release()
    assert fleet.holders == 0 and fleet.fallback_grants == 2
    dead.close()


def test_the_store_comes_back_after_an_outage(private_port: int) -> None:  # noqa: F811
    c = sync_client(private_port, timeout=0.2)
    sink = ListSink()
    events = EventHub()
    events.subscribe(sink)
    fleet = ThreadFleetLimit(
        "db", 2, redis=c, on_store_failure="closed", timeout=0.2, probe_backoff=0.05, events=events
    )
    c.execute_command("CLIENT", "PAUSE", "700", "ALL")  # a stalled Redis
    with pytest.raises(Rejected) as refused:
        fleet.acquire().__enter__()
    assert refused.value.reason is Reason.DEPENDENCY_UNAVAILABLE
    stop = time.monotonic() + 10
    while True:
        try:
            with fleet.acquire() as lease:
                assert lease.token is not None
            break
        except Rejected:
            assert time.monotonic() < stop, "the store never came back"
            time.sleep(0.05)
    assert not fleet.fallback_active
    changes = [e.fallback for e in sink.events if isinstance(e, FleetStoreChanged)]
    assert changes == [True, False]
    c.close()


def test_a_dependency_admits_blocking_calls_through_it(client: redis.Redis, prefix: str) -> None:
    fleet = ThreadFleetLimit("db", 1, redis=client, prefix=prefix, timeout=0.5)
    dep = brownout.Dependency("db", bulkhead=fleet)

    def query() -> str:
        assert fleet.holders == 1
        return "row"

    assert dep.call_blocking(query) == "row"
    assert fleet.holders == 0
    client.delete(*fleet.store.key_names("db"))  # type: ignore[attr-defined]


def test_a_client_that_could_block_without_bound_is_refused() -> None:
    unbounded = redis.Redis(host=HOST, port=PORT, socket_timeout=None)
    with pytest.raises(ValueError, match="socket_timeout"):
        ThreadFleetLimit("db", 2, redis=unbounded)
    retrying = redis.Redis(  # redis-py retries by default
        host=HOST, port=PORT, socket_timeout=0.05, socket_connect_timeout=0.05
    )
    with pytest.raises(ValueError, match=r"may wait \d+ x 0.05 s.*retry="):
        BlockingRedisLeaseStore(retrying, timeout=0.05)
    import redis.asyncio as redis_asyncio

    with pytest.raises(TypeError, match="FleetLimit"):
        ThreadFleetLimit("db", 2, store=brownout.RedisLeaseStore(redis_asyncio.Redis()))
    unbounded.close()
    retrying.close()
