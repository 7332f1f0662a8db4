"""What a quota store is: where GCRA state lives (this process, or a store shared by a fleet)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .._errors import BrownoutError
from .gcra import GcraOutcome, GcraPolicy

__all__ = ["QuotaKeyUnusable", "QuotaStore", "QuotaStoreUnavailable"]


@runtime_checkable
class QuotaStore(Protocol):
    """Decides one request for a key, atomically, wherever the state lives.

    ``budget`` bounds the whole decision in seconds (at most the store's own timeout;
    ``None``: that timeout);
    a store that cannot answer in time, or at all, raises `QuotaStoreUnavailable`.
    """

    shared: bool
    """True when several processes see the same state (so the limit is fleet-wide)."""

    async def decide(
        self, key: str, policy: GcraPolicy, cost: int = 1, budget: float | None = None
    ) -> GcraOutcome: ...


class QuotaStoreUnavailable(BrownoutError):
    """A shared quota store did not answer: timed out, unreachable, or answered with an error.

    ``timed_out`` tells a slow store from a broken one; `Quota` applies its failure policy
    either way.
    """

    key_only = False
    """True when the failure is one key's, not the store's (`QuotaKeyUnusable`)."""

    def __init__(self, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.timed_out = timed_out


class QuotaKeyUnusable(QuotaStoreUnavailable):
    """The store answered, but this key holds something that is not a quota (Redis's
    ``WRONGTYPE``: another application's key under the same name). A problem of this key, not
    an outage: `Quota` applies its failure policy to this request without switching every key
    to the fallback, and leaves the value alone.
    """

    key_only = True
