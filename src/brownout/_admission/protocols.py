"""What the rest of brownout needs from an admission: something that admits work.

`brownout.Bulkhead` satisfies both protocols; the edge (`brownout._edge`) and `Dependency`
type against them, so a bulkhead of one's own can stand in for it.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["AdmitsWork", "AdmitsWorkBlocking", "SettlesWork"]


class SettlesWork(Protocol):
    """A permit: the right to run one unit of work, settled exactly once by its outcome."""

    def success(self) -> None: ...

    def failed(self, error: str = ...) -> None: ...

    def ignore(self) -> None: ...

    def settle_raised(self, exc_type: type[BaseException]) -> None: ...


@runtime_checkable
class AdmitsWork(Protocol):
    """Something that admits work (`brownout.Bulkhead` is one).

    ``async with admission.admit() as permit:`` waits for a permit if it must and refuses by
    raising `brownout.Rejected`; it reads priority, caller, operation and deadline from the
    request context. Leaving the block settles the permit by the outcome; inside it, the
    holder may settle it first (a 5xx answer is ``permit.failed(...)``). ``try_admit()``
    never waits: a `SettlesWork` permit, or `Rejected` (the edge lets over-quota callers use
    idle capacity with it, S5). An admission reports the lifecycle events of what it admits.
    """

    def admit(self) -> AbstractAsyncContextManager[Any]: ...

    def try_admit(self) -> SettlesWork: ...


@runtime_checkable
class AdmitsWorkBlocking(Protocol):
    """Something that admits work from threads (`brownout.ThreadBulkhead` is one).

    ``with admission.admit() as permit:`` blocks the calling thread while it waits for a
    permit and refuses by raising `brownout.Rejected`; otherwise as `AdmitsWork`.
    """

    def admit(self) -> AbstractContextManager[Any]: ...

    def try_admit(self) -> SettlesWork: ...
