"""`FleetLimit`: one concurrency budget for a whole fleet, on a shared lease store (B3).

Every instance asks the same store for a lease before it sends work to the guarded resource
(a database that does not grow with the fleet). Admission answers at once: a lease, or
`Rejected` (``overloaded`` at the limit; ``deadline_expired`` when no time is left). A lease
expires by itself, so a crashed instance gives its slots back; while it is held, `FleetLease.check`
refuses after its local deadline (measured from before the acquire was sent, so it is never
later than the store's), and its fencing token, which only grows, lets the resource itself
refuse a holder whose lease has expired.

The store's calls take at most `DEADLINE_SHARE` of the request's remaining time (and at most
the store's timeout). When the store fails or times out, ``on_store_failure`` decides, as the
quota's does: ``"open"`` admits while this instance holds fewer than
``limit // expected_instances`` leases of its own (fencing tokens are then ``None``), and
``"closed"`` refuses with `Reason.DEPENDENCY_UNAVAILABLE`. Entering and leaving the fallback
emits `QuotaBackendChanged`; while down, one request at a time probes the store again after a
jittered, doubling backoff.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Literal, NoReturn

from .._clock import Clock, default_clock
from .._context import current
from .._errors import Reason, Rejected
from .._priority import Priority
from ..events import (
    EventHub,
    QuotaBackendChanged,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestShed,
    hub,
)
from .redis import RedisLeaseStore
from .store import LeaseExpired, LeaseStore, LeaseStoreUnavailable

__all__ = ["DEADLINE_SHARE", "FleetLease", "FleetLimit", "StoreFailurePolicy"]

DEADLINE_SHARE = 0.5
"""The largest share of a request's remaining time a store call may take: the rest is the
request's own (and the failure policy's, when the store does not answer)."""

StoreFailurePolicy = Literal["open", "closed"]

# A lease's state.
_NEW, _HELD, _SETTLED, _RELEASED = 0, 1, 2, 3


class FleetLimit:
    """At most ``limit`` leases held at once by every instance sharing ``store`` and ``name``.

    ``redis`` (a ``redis.asyncio`` client) builds a `RedisLeaseStore`, or pass ``store``
    (`InMemoryLeaseStore` for one process and tests). ``lease`` is each lease's lifetime in
    seconds: longer than the work it guards (or renew it), short enough that a crashed
    instance's slots come back soon. ``reserved`` leases are kept for work of priority
    ``reserve_from`` or above. Usable wherever a bulkhead is (`AdmitsWork`): ``admit()`` is
    ``acquire()``; ``try_admit()`` refuses, since a fleet slot needs a round trip.
    """

    __slots__ = (
        "_backoff",
        "_clock",
        "_down",
        "_events",
        "_last_seen_fleet",
        "_local_limit",
        "_probe_at",
        "_probing",
        "_random",
        "_waited",
        "closed_refusals",
        "expected_instances",
        "fallback_grants",
        "holders",
        "lease",
        "limit",
        "max_probe_backoff",
        "name",
        "on_store_failure",
        "probe_backoff",
        "reserve_from",
        "reserved",
        "store",
        "store_failures",
    )

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        redis: object | None = None,
        store: LeaseStore | None = None,
        lease: float = 5.0,
        reserved: int = 0,
        reserve_from: Priority = Priority.CRITICAL,
        on_store_failure: StoreFailurePolicy = "open",
        expected_instances: int = 1,
        timeout: float = 0.05,
        prefix: str = "bfl:",
        probe_backoff: float = 0.5,
        max_probe_backoff: float = 10.0,
        clock: Clock | None = None,
        events: EventHub = hub,
        rng: random.Random | None = None,
    ) -> None:
        if not name or not name.isprintable():
            raise ValueError(f"name must be printable and non-empty: {name!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1: {limit!r}")
        if not 0 <= reserved < limit:
            raise ValueError(f"reserved must be in 0..limit-1: {reserved!r}")
        if not (isinstance(lease, int | float) and 0 < lease < math.inf):
            raise ValueError(f"lease must be a positive number of seconds: {lease!r}")
        if on_store_failure not in ("open", "closed"):
            raise ValueError('on_store_failure must be "open" or "closed"')
        if isinstance(expected_instances, bool) or expected_instances < 1:
            raise ValueError("expected_instances must be >= 1")
        if not 0 < probe_backoff <= max_probe_backoff:
            raise ValueError("need 0 < probe_backoff <= max_probe_backoff")
        if (redis is None) == (store is None):
            raise TypeError("pass exactly one of redis= (a redis.asyncio client) or store=")
        if store is None:
            store = RedisLeaseStore(redis, prefix=prefix, timeout=timeout)  # type: ignore[arg-type]
        self.name = name
        self.limit = limit
        self.store: LeaseStore = store
        self.lease = float(lease)
        self.reserved = reserved
        self.reserve_from = Priority(reserve_from)
        self.on_store_failure: StoreFailurePolicy = on_store_failure
        self.expected_instances = expected_instances
        self._local_limit = max(1, limit // expected_instances)
        self.probe_backoff = probe_backoff
        self.max_probe_backoff = max_probe_backoff
        self._clock = clock if clock is not None else default_clock()
        self._events = events
        self._random = rng if rng is not None else random.Random()
        self._down = False
        self._probing = False
        self._probe_at = 0.0
        self._backoff = probe_backoff
        self._waited = 0.0
        """Seconds that deadline-cut timeouts waited since the store last answered."""
        self.holders = 0
        """Leases this instance holds now (the fleet's count is `fleet_holders` in gauges)."""
        self.fallback_grants = 0
        """Leases granted locally because the store was unavailable (fail-open)."""
        self.closed_refusals = 0
        """Work refused because the store was unavailable (fail-closed)."""
        self.store_failures = 0
        """Store calls that timed out or failed (acquire, renew and release)."""
        self._last_seen_fleet = 0

    @property
    def fallback_active(self) -> bool:
        """True while the store is considered down and the failure policy decides."""
        return self._down

    @property
    def local_limit(self) -> int:
        """Leases this instance may hold while failing open: ``limit // expected_instances``."""
        return self._local_limit

    def ceiling(self, priority: Priority) -> int:
        """How many leases may be held when work of ``priority`` asks for one."""
        return self.limit if priority >= self.reserve_from else self.limit - self.reserved

    # -- admission --------------------------------------------------------------------------
    def acquire(self) -> FleetLease:
        """``async with fleet.acquire() as lease:`` takes a lease (one round trip) or raises
        `Rejected`; leaving the block releases it (one round trip)."""
        return FleetLease(self)

    def admit(self) -> FleetLease:
        """`acquire`, under the name the edge and `Dependency` call (`AdmitsWork`)."""
        return FleetLease(self)

    def try_admit(self) -> FleetLease:
        """Always `Rejected` (``overloaded``): a fleet lease needs a round trip, and this call
        may not wait. The edge calls it only to let over-quota work use idle capacity."""
        raise Rejected(Reason.OVERLOADED, f"fleet limit {self.name!r} cannot admit without asking")

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Live state for exporters (`brownout.Stats.watch`), labelled with the limit's name:
        this instance's leases, the limit, the fleet's holders as last seen, store failures."""
        labels = {"source": self.name}
        yield ("in_flight", labels, float(self.holders))
        yield ("limit", labels, float(self.limit))
        yield ("fleet_holders", labels, float(self._last_seen_fleet))
        yield ("fleet_store_failures", labels, float(self.store_failures))

    async def _take(self, lease: FleetLease) -> None:
        ctx = current()
        lease.priority = ctx.priority
        lease.caller = ctx.caller
        lease.operation = ctx.operation
        deadline = ctx.deadline
        left = None if deadline is None else deadline.remaining()
        lease.deadline_at = math.inf if deadline is None else self._clock.now() + (left or 0.0)
        if self._events.enabled:
            self._emit(RequestOffered, lease, remaining=left)
        if left is not None and left <= 0:
            self._refuse(lease, Reason.DEADLINE_EXPIRED, "the deadline expired before asking", left)
        now = self._clock.now()
        probe = False
        if self._down:
            if self._probing or now < self._probe_at:
                return self._on_failure(lease, left)
            probe = self._probing = True
        timeout = float(getattr(self.store, "timeout", math.inf))
        budget = timeout
        if left is not None and left * DEADLINE_SHARE < budget:
            budget = left * DEADLINE_SHARE
        started = self._clock.now()
        try:
            async with asyncio.timeout(None if budget == math.inf else budget):
                grant = await self.store.acquire(
                    self.name, self.ceiling(lease.priority), self.lease, budget
                )
        except (LeaseStoreUnavailable, TimeoutError) as e:
            self.store_failures += 1
            detail = e.detail if isinstance(e, LeaseStoreUnavailable) else "store timed out"
            timed_out = not isinstance(e, LeaseStoreUnavailable) or e.timed_out
            if probe or not timed_out or budget >= timeout:
                self._trip(detail, probe)
            else:
                # Cut short by the request's deadline: weaker evidence than a full timeout;
                # together they count as one once they add up to the timeout.
                self._waited += budget
                if self._waited >= timeout:
                    self._trip(f"{detail} (deadline-cut timeouts add up to the timeout)", probe)
            return self._on_failure(lease, left)
        finally:
            if probe:
                self._probing = False
        self._waited = 0.0
        if self._down:
            self._recover()
        self._last_seen_fleet = grant.holders
        if not grant.granted:
            self._refuse(
                lease,
                Reason.OVERLOADED,
                f"fleet limit {self.name!r} is full: {grant.holders} of {self.limit} held",
                left,
            )
        lease.token = grant.token
        lease.expires_at = started + self.lease  # never later than the store's own expiry
        self._granted(lease, started)

    def _granted(self, lease: FleetLease, started: float) -> None:
        lease._state = _HELD
        lease.admitted_at = self._clock.now()
        self.holders += 1
        if self._events.enabled:
            self._emit(RequestAdmitted, lease, queue_wait=lease.admitted_at - started)

    def _on_failure(self, lease: FleetLease, left: float | None) -> None:
        if self.on_store_failure == "closed":
            self.closed_refusals += 1
            self._refuse(
                lease,
                Reason.DEPENDENCY_UNAVAILABLE,
                f"fleet limit {self.name!r} cannot be checked: its store is unavailable",
                left,
                retry_after=max(self._probe_at - self._clock.now(), 0.001),
            )
        if self.holders >= self._local_limit:
            self._refuse(
                lease,
                Reason.OVERLOADED,
                f"fleet limit {self.name!r} (store down): this instance's share of "
                f"{self._local_limit} is held",
                left,
            )
        self.fallback_grants += 1
        lease.token = None
        lease.expires_at = math.inf  # a local lease ends only when it is released
        self._granted(lease, self._clock.now())

    def _refuse(
        self,
        lease: FleetLease,
        reason: Reason,
        detail: str,
        left: float | None,
        retry_after: float | None = None,
    ) -> NoReturn:
        lease._state = _RELEASED
        if self._events.enabled:
            self._emit(RequestShed, lease, reason=reason, remaining=left, queue_wait=0.0)
        raise Rejected(reason, detail, retry_after=retry_after)

    def _emit(self, kind: type, lease: FleetLease, **fields: object) -> None:
        self._events.emit(
            kind(
                at=self._clock.now(),
                source=self.name,
                operation=lease.operation,
                priority=lease.priority,
                caller=lease.caller,
                **fields,
            )
        )

    async def _release(self, lease: FleetLease) -> None:
        if lease._state == _RELEASED or lease._state == _NEW:
            return
        if lease._state == _HELD:
            lease.success()
        lease._state = _RELEASED
        self.holders -= 1
        token = lease.token
        if token is None:
            return  # a local (fail-open) lease: nothing was stored
        try:
            await self.store.release(self.name, token)
        except (LeaseStoreUnavailable, TimeoutError):
            self.store_failures += 1  # the lease expires by itself

    async def _renew(self, lease: FleetLease) -> None:
        lease.check()
        token = lease.token
        if token is None:
            return  # a local lease has no expiry
        started = self._clock.now()
        try:
            extended = await self.store.renew(self.name, token, self.lease)
        except LeaseStoreUnavailable:
            self.store_failures += 1
            raise
        if not extended:
            lease.expires_at = -math.inf
            raise LeaseExpired(f"fleet lease {token} of {self.name!r} had expired: not renewed")
        lease.expires_at = started + self.lease

    def _settle(self, lease: FleetLease, outcome: str, error: str) -> None:
        if lease._state != _HELD:
            return
        lease._state = _SETTLED
        if not self._events.enabled:
            return
        now = self._clock.now()
        latency = now - lease.admitted_at
        if outcome == "success":
            self._emit(RequestCompleted, lease, latency=latency, useful=now <= lease.deadline_at)
        elif outcome == "failed":
            self._emit(RequestFailed, lease, latency=latency, error=error)
        elif outcome == "dropped":
            self._emit(RequestExpired, lease, stage="running", queue_wait=0.0)

    # -- failure policy ---------------------------------------------------------------------
    def _trip(self, detail: str, probe: bool) -> None:
        now = self._clock.now()
        if self._down:
            if not probe:
                return
            self._backoff = min(self._backoff * 2, self.max_probe_backoff)
        else:
            self._down = True
            self._waited = 0.0
            self._backoff = self.probe_backoff
            if self._events.enabled:
                how = (
                    f"fail-open: at most {self._local_limit} leases here"
                    if self.on_store_failure == "open"
                    else "fail-closed: refusing"
                )
                self._events.emit(
                    QuotaBackendChanged(
                        at=now, source=self.name, fallback=True, detail=f"{detail}; {how}"
                    )
                )
        # Jitter keeps a fleet from probing a recovering store in one synchronized wave.
        self._probe_at = now + self._backoff * self._random.uniform(0.5, 1.0)

    def _recover(self) -> None:
        self._down = False
        self._backoff = self.probe_backoff
        if self._events.enabled:
            self._events.emit(
                QuotaBackendChanged(
                    at=self._clock.now(),
                    source=self.name,
                    fallback=False,
                    detail="fleet lease store answers again",
                )
            )

    def __repr__(self) -> str:
        return (
            f"FleetLimit(name={self.name!r}, limit={self.limit!r}, lease={self.lease!r}, "
            f"store={self.store!r}, on_store_failure={self.on_store_failure!r})"
        )


class FleetLease:
    """One lease of a `FleetLimit`, and the permit of the work it admits.

    ``token`` is its fencing token (``None`` for a lease granted locally while the store was
    down); ``expires_at`` is when it stops being valid on the limit's clock. Settle it like
    a bulkhead's permit (`success`, `failed`, `dropped`, `ignore`): that reports how the work
    ended; leaving the ``async with`` block (or `release`) gives the slot back.
    """

    __slots__ = (
        "_limit",
        "_state",
        "admitted_at",
        "caller",
        "deadline_at",
        "expires_at",
        "operation",
        "priority",
        "token",
    )

    def __init__(self, limit: FleetLimit) -> None:
        self._limit = limit
        self._state = _NEW
        self.token: int | None = None
        self.expires_at = -math.inf
        self.admitted_at = -math.inf
        self.deadline_at = math.inf
        self.priority = Priority.CRITICAL
        self.caller = "unknown"
        self.operation = "unknown"

    @property
    def valid(self) -> bool:
        """True while the lease is held and unexpired (by the conservative local clock)."""
        return self._state in (_HELD, _SETTLED) and self._limit._clock.now() < self.expires_at

    @property
    def remaining(self) -> float:
        """Seconds the lease stays valid (0.0 once it is not)."""
        if self._state not in (_HELD, _SETTLED):
            return 0.0
        return max(0.0, self.expires_at - self._limit._clock.now())

    def check(self) -> None:
        """Raise `LeaseExpired` unless the lease may still act: call it before each action."""
        if self._state not in (_HELD, _SETTLED):
            raise LeaseExpired(f"fleet lease of {self._limit.name!r} is not held")
        if self._limit._clock.now() >= self.expires_at:
            raise LeaseExpired(
                f"fleet lease {self.token} of {self._limit.name!r} expired: its slot may be "
                "another holder's now"
            )

    async def renew(self) -> None:
        """Extend the lease by the limit's lease time (one round trip); `LeaseExpired` if it
        already expired, `LeaseStoreUnavailable` if the store does not answer."""
        await self._limit._renew(self)

    async def release(self) -> None:
        """Give the slot back now (one round trip; a failure leaves it to expire)."""
        await self._limit._release(self)

    # -- settling, as a bulkhead's permit ---------------------------------------------------
    def success(self) -> None:
        self._limit._settle(self, "success", "")

    def failed(self, error: str = "error") -> None:
        self._limit._settle(self, "failed", error)

    def dropped(self) -> None:
        self._limit._settle(self, "dropped", "")

    def ignore(self) -> None:
        self._limit._settle(self, "ignored", "")

    def settle_raised(self, exc_type: type[BaseException]) -> None:
        """Settle by the exception the work raised, as ``async with`` does."""
        if issubclass(exc_type, (TimeoutError, asyncio.CancelledError)):
            self.dropped()
        elif issubclass(exc_type, Rejected):
            self.ignore()
        else:
            self.failed(exc_type.__name__)

    @property
    def settled(self) -> bool:
        return self._state in (_SETTLED, _RELEASED)

    async def __aenter__(self) -> FleetLease:
        if self._state != _NEW:
            raise RuntimeError("a FleetLease is entered once; call acquire() again")
        await self._limit._take(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.settle_raised(exc_type)
        await self._limit._release(self)

    def __repr__(self) -> str:
        state = ("new", "held", "settled", "released")[self._state]
        return f"<FleetLease {self._limit.name} token={self.token} {state}>"
