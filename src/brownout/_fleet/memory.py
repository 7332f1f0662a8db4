"""`InMemoryLeaseStore` and `BlockingInMemoryLeaseStore`: a fleet limit's leases in this
process (one instance, or tests), decided like the Redis script decides them."""

from __future__ import annotations

import threading

from .._clock import Clock, default_clock
from .store import LeaseGrant

__all__ = ["BlockingInMemoryLeaseStore", "InMemoryLeaseStore"]


class _Leases:
    """Leases with expiry on an injected clock, under a lock (threads may share them).

    Not shared (``shared = False``): each process has its own. Memory is bounded by the
    largest ``ceiling`` asked for, per name.
    """

    __slots__ = ("_clock", "_fences", "_leases", "_lock")

    shared = False

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock = clock if clock is not None else default_clock()
        self._leases: dict[str, dict[int, float]] = {}
        self._fences: dict[str, int] = {}
        self._lock = threading.Lock()

    def _live(self, name: str, now: float) -> dict[int, float]:
        leases = self._leases.setdefault(name, {})
        for token in [t for t, expiry in leases.items() if expiry <= now]:
            del leases[token]
        return leases

    def _acquire(self, name: str, ceiling: int, lease: float) -> LeaseGrant:
        with self._lock:
            now = self._clock.now()
            leases = self._live(name, now)
            if len(leases) >= ceiling:
                return LeaseGrant(False, None, len(leases))
            token = self._fences.get(name, 0) + 1
            self._fences[name] = token
            leases[token] = now + lease
            return LeaseGrant(True, token, len(leases))

    def _release(self, name: str, token: int) -> None:
        with self._lock:
            self._leases.get(name, {}).pop(token, None)

    def _renew(self, name: str, token: int, lease: float) -> bool:
        with self._lock:
            now = self._clock.now()
            leases = self._live(name, now)
            if token not in leases:
                return False
            leases[token] = now + lease
            return True

    def holders(self, name: str) -> int:
        """Unexpired leases of ``name`` now."""
        with self._lock:
            return len(self._live(name, self._clock.now()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class InMemoryLeaseStore(_Leases):
    """A `LeaseStore` in this process, for `FleetLimit` (one instance, or tests)."""

    __slots__ = ()

    async def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        return self._acquire(name, ceiling, lease)

    async def release(self, name: str, token: int, budget: float | None = None) -> None:
        self._release(name, token)

    async def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        return self._renew(name, token, lease)


class BlockingInMemoryLeaseStore(_Leases):
    """A `BlockingLeaseStore` in this process, for `ThreadFleetLimit` (one instance, or tests)."""

    __slots__ = ()

    def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        return self._acquire(name, ceiling, lease)

    def release(self, name: str, token: int, budget: float | None = None) -> None:
        self._release(name, token)

    def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        return self._renew(name, token, lease)
