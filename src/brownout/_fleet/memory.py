"""`InMemoryLeaseStore`: a fleet limit's leases in this process (one instance, or tests)."""

from __future__ import annotations

from .._clock import Clock, default_clock
from .store import LeaseGrant

__all__ = ["InMemoryLeaseStore"]


class InMemoryLeaseStore:
    """Leases with expiry on an injected clock, decided like the Redis script decides them.

    Not shared (``shared = False``): each process has its own. Memory is bounded by the
    largest ``ceiling`` asked for, per name.
    """

    __slots__ = ("_clock", "_fences", "_leases")

    shared = False

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock = clock if clock is not None else default_clock()
        self._leases: dict[str, dict[int, float]] = {}
        self._fences: dict[str, int] = {}

    def _live(self, name: str, now: float) -> dict[int, float]:
        leases = self._leases.setdefault(name, {})
        for token in [t for t, expiry in leases.items() if expiry <= now]:
            del leases[token]
        return leases

    async def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        now = self._clock.now()
        leases = self._live(name, now)
        if len(leases) >= ceiling:
            return LeaseGrant(False, None, len(leases))
        token = self._fences.get(name, 0) + 1
        self._fences[name] = token
        leases[token] = now + lease
        return LeaseGrant(True, token, len(leases))

    async def release(self, name: str, token: int, budget: float | None = None) -> None:
        self._leases.get(name, {}).pop(token, None)

    async def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        now = self._clock.now()
        leases = self._live(name, now)
        if token not in leases:
            return False
        leases[token] = now + lease
        return True

    def holders(self, name: str) -> int:
        """Unexpired leases of ``name`` now."""
        return len(self._live(name, self._clock.now()))

    def __repr__(self) -> str:
        return "InMemoryLeaseStore()"
