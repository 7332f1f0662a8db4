"""What a lease store is: where a fleet limit's leases live (this process, or Redis)."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from .._errors import BrownoutError

__all__ = [
    "BlockingLeaseStore",
    "LeaseExpired",
    "LeaseGrant",
    "LeaseStore",
    "LeaseStoreUnavailable",
    "LeaseUnfenced",
]


class LeaseGrant(NamedTuple):
    """One acquire's answer: ``granted``; ``token``, the lease's fencing token (``None`` when
    refused); ``holders``, the unexpired leases after the decision (this one included)."""

    granted: bool
    token: int | None
    holders: int


@runtime_checkable
class LeaseStore(Protocol):
    """Holds the leases of named limits, deciding each acquire atomically.

    ``budget`` bounds each call in seconds (at most the store's own timeout; ``None``: that
    timeout); a store that cannot answer in time, or at all, raises `LeaseStoreUnavailable`.
    """

    shared: bool
    """True when several processes see the same leases (so the limit is fleet-wide)."""

    async def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant:
        """Drop expired leases; grant one of ``lease`` seconds if fewer than ``ceiling`` are
        held, with a fencing token above every token granted before under ``name``."""
        ...

    async def release(self, name: str, token: int, budget: float | None = None) -> None: ...

    async def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool:
        """Extend an unexpired lease to ``lease`` seconds from now; False if it had expired."""
        ...


@runtime_checkable
class BlockingLeaseStore(Protocol):
    """A `LeaseStore` whose calls block the calling thread (`ThreadFleetLimit` uses it): the
    same decisions, each call bounded by the store's own ``timeout``."""

    shared: bool

    def acquire(
        self, name: str, ceiling: int, lease: float, budget: float | None = None
    ) -> LeaseGrant: ...

    def release(self, name: str, token: int, budget: float | None = None) -> None: ...

    def renew(self, name: str, token: int, lease: float, budget: float | None = None) -> bool: ...


class LeaseStoreUnavailable(BrownoutError):
    """A shared lease store did not answer: timed out, unreachable, or answered with an error.

    ``timed_out`` tells a slow store from a broken one; `FleetLimit` applies its failure
    policy either way.
    """

    def __init__(self, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.timed_out = timed_out


class LeaseExpired(BrownoutError):
    """A fleet lease may no longer act: it expired (its slot may be someone else's now), was
    released, or a renewal was refused. Stop before touching the guarded resource."""


class LeaseUnfenced(LeaseExpired):
    """``lease.check(fenced=True)`` on a lease granted while the store was down (fail-open):
    it has no fencing token, so an action that needs one must not run."""
