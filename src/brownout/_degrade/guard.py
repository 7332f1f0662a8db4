"""Fail-closed guards for authoritative data (G4).

Authorization, payment state, tenant isolation, inventory ownership and audit are never
degraded: when their source fails, the answer is "unavailable", not a cached or default
value. `FailClosedGuard` wraps the read of such a source: any failure (an exception, a
timeout, a deadline, an open breaker, a refusal) becomes `FailClosed`, which the edge maps to
503 with a problem body. The guard keeps no copy of any value, and it refuses to run inside
a `StaleCache` load (a cached authorization decision is exactly the mistake G4 forbids).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from .._clock import Clock, default_clock
from .._errors import FailClosed
from ..events import EventHub, GuardFailedClosed, hub
from .markers import cache_loading, guarding

__all__ = ["FailClosedGuard"]

_CLOCK = default_clock()

P = ParamSpec("P")
T = TypeVar("T")


class FailClosedGuard:
    """Read an authoritative source; on any failure raise `FailClosed(what)`, never a guess.

    ``timeout`` bounds one read (the request's own deadline, when shorter, still applies).
    Cancellation from outside (the caller's deadline, a client that left) propagates as-is.

    ``await guard.call(fetch, *args)`` or decorate: ``@guard`` on an async function.
    """

    __slots__ = ("_clock", "_events", "timeout", "what")

    def __init__(
        self,
        what: str,
        *,
        timeout: float | None = None,
        clock: Clock = _CLOCK,
        events: EventHub = hub,
    ) -> None:
        if not what:
            raise ValueError("say what the guard protects, e.g. 'authorization'")
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.what = what
        self.timeout = timeout
        self._clock = clock
        self._events = events

    async def call(
        self, source: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Return what ``source(*args, **kwargs)`` returns, or raise `FailClosed`."""
        if cache_loading.get() is not None:
            raise self._closed(
                "a StaleCache loader",
                f"{self.what} must not be loaded through a cache (G4)",
                None,
            )
        token = guarding.set(self.what)
        try:
            if self.timeout is None:
                return await source(*args, **kwargs)
            async with asyncio.timeout(self.timeout):
                return await source(*args, **kwargs)
        except FailClosed:
            # A refusal from inside (another guard whose source is down, or a StaleCache
            # read that refuses to serve guarded data) refuses this answer too: counted here
            # as well, so every FailClosed a guard ends with shows in GuardFailedClosed.
            self._count("FailClosed")
            raise
        except Exception as error:  # every failure mode of the source, including timeouts
            raise self._closed(type(error).__name__, "", error) from error
        finally:
            guarding.reset(token)

    def __call__(self, fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        """Decorate an async reader of authoritative data."""

        @functools.wraps(fn)
        async def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
            return await self.call(fn, *args, **kwargs)

        return guarded

    def _closed(self, cause: str, detail: str, error: BaseException | None) -> FailClosed:
        self._count(cause)
        return FailClosed(self.what, detail or f"{self.what} is unavailable ({cause})")

    def _count(self, cause: str) -> None:
        if self._events.enabled:
            self._events.emit(
                GuardFailedClosed(
                    at=self._clock.now(), source=self.what, what=self.what, cause=cause
                )
            )

    def __repr__(self) -> str:
        return f"FailClosedGuard({self.what!r}, timeout={self.timeout!r})"
