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
emits `FleetStoreChanged`; while down, one request at a time probes the store again after a
jittered, doubling backoff. The decisions are `FleetDecisions`' (shared with `ThreadFleetLimit`);
this module sends the store calls on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from types import TracebackType

from .decisions import DEADLINE_SHARE, NEW, FleetDecisions, LeaseHandle, StoreFailurePolicy
from .redis import RedisLeaseStore
from .store import LeaseStore, LeaseStoreUnavailable

__all__ = ["DEADLINE_SHARE", "FleetLease", "FleetLimit", "StoreFailurePolicy"]


class FleetLimit(FleetDecisions):
    """At most ``limit`` leases held at once by every instance sharing ``store`` and ``name``.

    ``redis`` (a ``redis.asyncio`` client) builds a `RedisLeaseStore`, or pass ``store``
    (`InMemoryLeaseStore` for one process and tests). ``lease`` is each lease's lifetime in
    seconds: longer than the work it guards (or renew it), short enough that a crashed
    instance's slots come back soon. ``reserved`` leases are kept for work of priority
    ``reserve_from`` or above. Usable wherever a bulkhead is (`AdmitsWork`): ``admit()`` is
    ``acquire()``; ``try_admit()`` refuses, since a fleet slot needs a round trip. For
    threads (WSGI, Django, Celery), `ThreadFleetLimit` makes the same decisions.
    """

    __slots__ = ()

    store: LeaseStore
    _client_kind = "a redis.asyncio client"

    def _redis_store(self, client: object, prefix: str, timeout: float) -> object:
        return RedisLeaseStore(client, prefix=prefix, timeout=timeout)  # type: ignore[arg-type]

    def _checked(self, store: object) -> object:
        if not inspect.iscoroutinefunction(getattr(store, "acquire", None)):
            raise TypeError(
                f"FleetLimit needs a store with async methods (a LeaseStore), not {store!r}: "
                "use ThreadFleetLimit for a blocking store"
            )
        return store

    def acquire(self) -> FleetLease:
        """``async with fleet.acquire() as lease:`` takes a lease (one round trip) or raises
        `Rejected`; leaving the block releases it (one round trip)."""
        return FleetLease(self)

    def admit(self) -> FleetLease:
        """`acquire`, under the name the edge and `Dependency` call (`AdmitsWork`)."""
        return FleetLease(self)

    async def _take(self, lease: FleetLease) -> None:
        ask = self._ask(lease)
        if ask is None:
            return
        try:
            async with asyncio.timeout(None if ask.budget == math.inf else ask.budget):
                grant = await self.store.acquire(
                    self.name, self.ceiling(lease.priority), self.lease, ask.budget
                )
        except (LeaseStoreUnavailable, TimeoutError) as e:
            self._failed(lease, ask, e)
            return
        except BaseException:
            self._abandoned(ask)
            raise
        self._answered(lease, ask, grant)

    async def _release(self, lease: FleetLease) -> None:
        token = self._leave(lease)
        if token is None:
            return  # not held, or a local (fail-open) lease: nothing was stored
        try:
            await self.store.release(self.name, token)
        except (LeaseStoreUnavailable, TimeoutError):
            self._store_failed()  # the lease expires by itself

    async def _renew(self, lease: FleetLease) -> None:
        token = self._renewing(lease)
        if token is None:
            return  # a local lease has no expiry
        started = self._clock.now()
        try:
            extended = await self.store.renew(self.name, token, self.lease)
        except LeaseStoreUnavailable:
            self._store_failed()
            raise
        self._renewed(lease, token, extended, started)


class FleetLease(LeaseHandle):
    """One lease of a `FleetLimit`, and the permit of the work it admits.

    ``token`` is its fencing token (``None`` for a lease granted locally while the store was
    down: see `check`); ``expires_at`` is when it stops being valid on the limit's clock.
    Settle it like a bulkhead's permit (`success`, `failed`, `dropped`, `ignore`): that
    reports how the work ended; leaving the ``async with`` block (or `release`) gives the
    slot back.
    """

    __slots__ = ()

    _limit: FleetLimit

    async def renew(self) -> None:
        """Extend the lease by the limit's lease time (one round trip); `LeaseExpired` if it
        already expired, `LeaseStoreUnavailable` if the store does not answer. A local
        lease (``token is None``) has nothing to renew."""
        await self._limit._renew(self)

    async def release(self) -> None:
        """Give the slot back now (one round trip; a failure leaves it to expire)."""
        await self._limit._release(self)

    async def __aenter__(self) -> FleetLease:
        if self._state != NEW:
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
