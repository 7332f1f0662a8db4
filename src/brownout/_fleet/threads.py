"""`ThreadFleetLimit`: the fleet limit for threads (WSGI, sync Django, Celery), B3 and W1.

The same decisions as `FleetLimit` (`FleetDecisions`, under the limit's lock), with the store
calls sent from the calling thread by a `BlockingLeaseStore` (`BlockingRedisLeaseStore`: the
same scripts, one round trip each way). ``with fleet.admit():`` blocks for that round trip
only: like the asyncio limit, it never queues.
"""

from __future__ import annotations

import inspect
from types import TracebackType

from .decisions import NEW, FleetDecisions, LeaseHandle
from .redis import BlockingRedisLeaseStore
from .store import BlockingLeaseStore, LeaseStoreUnavailable

__all__ = ["ThreadFleetLease", "ThreadFleetLimit"]


class ThreadFleetLimit(FleetDecisions):
    """`FleetLimit` for threads: ``with fleet.admit() as lease:`` (or ``acquire()``).

    ``redis`` is a blocking ``redis.Redis`` client built with ``socket_timeout`` (it bounds
    each call; see `BlockingRedisLeaseStore`), or pass ``store`` (`BlockingInMemoryLeaseStore`
    for one process and tests). Every other setting, the failure policy and the events are
    `FleetLimit`'s. An `AdmitsWorkBlocking`: `Dependency.call_blocking` and the WSGI and
    Django edges take it as a route's bulkhead.
    """

    __slots__ = ()

    store: BlockingLeaseStore
    _client_kind = "a blocking redis.Redis client"

    def _redis_store(self, client: object, prefix: str, timeout: float) -> object:
        return BlockingRedisLeaseStore(client, prefix=prefix, timeout=timeout)  # type: ignore[arg-type]

    def _checked(self, store: object) -> object:
        acquire = getattr(store, "acquire", None)
        if acquire is None or inspect.iscoroutinefunction(acquire):
            raise TypeError(
                f"ThreadFleetLimit needs a blocking store (a BlockingLeaseStore), not {store!r}: "
                "use FleetLimit for an async one"
            )
        return store

    def acquire(self) -> ThreadFleetLease:
        """``with fleet.acquire() as lease:`` takes a lease (one round trip) or raises
        `Rejected`; leaving the block releases it (one round trip)."""
        return ThreadFleetLease(self)

    def admit(self) -> ThreadFleetLease:
        """`acquire`, under the name the blocking edge and `Dependency` call."""
        return ThreadFleetLease(self)

    def _take(self, lease: ThreadFleetLease) -> None:
        ask = self._ask(lease)
        if ask is None:
            return
        try:
            grant = self.store.acquire(
                self.name, self.ceiling(lease.priority), self.lease, ask.budget
            )
        except LeaseStoreUnavailable as e:
            self._failed(lease, ask, e)
            return
        except BaseException:
            self._abandoned(ask)
            raise
        self._answered(lease, ask, grant)

    def _release(self, lease: ThreadFleetLease) -> None:
        token = self._leave(lease)
        if token is None:
            return  # not held, or a local (fail-open) lease: nothing was stored
        try:
            self.store.release(self.name, token)
        except LeaseStoreUnavailable:
            self._store_failed()  # the lease expires by itself

    def _renew(self, lease: ThreadFleetLease) -> None:
        token = self._renewing(lease)
        if token is None:
            return  # a local lease has no expiry
        started = self._clock.now()
        try:
            extended = self.store.renew(self.name, token, self.lease)
        except LeaseStoreUnavailable:
            self._store_failed()
            raise
        self._renewed(lease, token, extended, started)


class ThreadFleetLease(LeaseHandle):
    """One lease of a `ThreadFleetLimit`: `FleetLease` with blocking `renew` and `release`."""

    __slots__ = ()

    _limit: ThreadFleetLimit

    def renew(self) -> None:
        """Extend the lease by the limit's lease time (one round trip); `LeaseExpired` if it
        already expired, `LeaseStoreUnavailable` if the store does not answer."""
        self._limit._renew(self)

    def release(self) -> None:
        """Give the slot back now (one round trip; a failure leaves it to expire)."""
        self._limit._release(self)

    def __enter__(self) -> ThreadFleetLease:
        if self._state != NEW:
            raise RuntimeError("a ThreadFleetLease is entered once; call acquire() again")
        self._limit._take(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.settle_raised(exc_type)
        self._limit._release(self)
