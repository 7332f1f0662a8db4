"""Stale-while-revalidate for content (G1), with a hard maximum staleness.

`StaleCache.get(key, loader)` returns ``(value, age)``:

- fresh (age <= ``fresh_for``): served from memory;
- stale but within ``max_staleness``: served at once, and one background refresh starts
  (single flight per key); if that refresh fails, the stale value keeps being served until it
  is ``max_staleness`` old, and the next refresh waits ``failure_backoff`` seconds;
- missing or older than ``max_staleness``: the caller waits for a load (one per key, shared
  by every concurrent caller); if it fails, the error propagates: nothing too old is served.

The age is reported so the response can say how old it is (`stale_headers`). Memory is
bounded: at most ``max_entries`` values (least recently used entries are evicted), at most
``max_entries`` background refreshes in flight (a refresh of a key the LRU evicts is
cancelled: nobody could read its result; past the cap a stale value is served without
starting one), and one foreground load per key that callers still wait for. Stale content is
for *content only*: a loader that fails closed (`FailClosed`) is never answered from the
cache, and a `FailClosedGuard` refuses to run inside a cache load (G4).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

from .._checks import name_arg
from .._clock import Clock, default_clock
from .._context import request
from .._errors import FailClosed
from .._priority import Priority
from ..events import EventHub, StaleServed, hub
from .markers import cache_loading, guarding

__all__ = ["STALE_AGE_HEADER", "Served", "StaleCache", "stale_headers"]

_CLOCK = default_clock()

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

STALE_AGE_HEADER = "brownout-stale-age"
"""Response header with the age in seconds of the content served (millisecond precision)."""


class Served(NamedTuple, Generic[V]):
    """What `StaleCache.get` returns: the value and how old it is, in seconds."""

    value: V
    age: float


def stale_headers(age: float) -> dict[str, str]:
    """Headers that tell the caller how old the served content is.

    ``age`` (RFC 9111, whole seconds, so shared caches count it against freshness) and
    ``brownout-stale-age`` (seconds with millisecond precision).
    """
    age = max(0.0, age)
    return {"age": str(int(age)), STALE_AGE_HEADER: f"{age:.3f}"}


class _Entry(Generic[V]):
    __slots__ = ("loaded_at", "retry_at", "value")

    def __init__(self, value: V, loaded_at: float) -> None:
        self.value = value
        self.loaded_at = loaded_at
        self.retry_at = -math.inf


class _Flight(Generic[V]):
    __slots__ = ("background", "task", "waiters")

    def __init__(self, task: asyncio.Task[tuple[V, float]], background: bool) -> None:
        self.task = task
        self.background = background
        self.waiters = 0


class StaleCache(Generic[K, V]):
    """A bounded stale-while-revalidate cache for content (never for authoritative data).

    ``fresh_for``: age up to which a value is served without refreshing it.
    ``max_staleness``: age past which a value is never served (the caller waits for a load).
    ``max_entries``: the LRU bound. ``load_timeout``: the longest one load may take.
    ``failure_backoff``: after a failed load of a key still in memory, wait this long before
    refreshing it in the background (a caller with nothing servable still loads at once).
    Background refreshes run as low-priority work (``Priority.SHEDDABLE``, S3), detached from
    the request that noticed the staleness.
    """

    def __init__(
        self,
        name: str = "stale-cache",
        *,
        max_entries: int,
        fresh_for: float,
        max_staleness: float,
        load_timeout: float | None = None,
        failure_backoff: float = 1.0,
        clock: Clock = _CLOCK,
        events: EventHub = hub,
    ) -> None:
        name_arg("StaleCache", name)
        if not 1 <= max_entries < math.inf:  # (NaN too: memory stays bounded)
            raise ValueError("max_entries must be >= 1")
        # G2: how stale a value may be is declared, and bounded (NaN and inf refused).
        if not 0 <= fresh_for <= max_staleness < math.inf:
            raise ValueError("need 0 <= fresh_for <= max_staleness < inf")
        if load_timeout is not None and not load_timeout > 0:
            raise ValueError("load_timeout must be > 0")
        # (written so NaN fails too: with a NaN backoff ``now >= retry_at`` is never true, and
        # one failed refresh would stop the key being refreshed again)
        if not failure_backoff >= 0:
            raise ValueError("failure_backoff must be >= 0")
        self.max_entries = max_entries
        self.fresh_for = fresh_for
        self.max_staleness = max_staleness
        self.load_timeout = load_timeout
        self.failure_backoff = failure_backoff
        self.name = name
        self._clock = clock
        self._events = events
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()
        self._flights: dict[K, _Flight[V]] = {}
        self._refreshing = 0  # background refreshes not yet landed (at most max_entries)
        self.loads = 0
        """Loader calls started (foreground and background)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def peek(self, key: K, *, max_staleness: float | None = None) -> Served[V] | None:
        """The cached value and its age if it is servable, without loading or refreshing."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        age = self._clock.now() - entry.loaded_at
        limit = self.max_staleness if max_staleness is None else max_staleness
        return Served(entry.value, age) if age <= limit else None

    def invalidate(self, key: K) -> None:
        """Forget ``key`` (a load in flight still completes and stores its result)."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    async def get(
        self,
        key: K,
        loader: Callable[[], Awaitable[V]],
        *,
        fresh_for: float | None = None,
        max_staleness: float | None = None,
    ) -> Served[V]:
        """Return ``(value, age)`` for ``key``, loading with ``loader`` when needed.

        ``fresh_for`` / ``max_staleness`` override the cache's bounds for this call (e.g. a
        degraded mode may accept older content and skip refreshes).
        """
        what = guarding.get()
        if what is not None:
            raise FailClosed(what, f"{what} must not be served from a cache (G4)")
        fresh = self.fresh_for if fresh_for is None else fresh_for
        limit = self.max_staleness if max_staleness is None else max_staleness
        now = self._clock.now()
        entry = self._entries.get(key)
        if entry is not None:
            age = now - entry.loaded_at
            if age <= limit:
                self._entries.move_to_end(key)
                if age > fresh:
                    revalidating = key in self._flights
                    if (
                        not revalidating
                        and now >= entry.retry_at
                        # Refreshes that hang (no load_timeout) must not pile up past the
                        # entries they could refresh.
                        and self._refreshing < self.max_entries
                    ):
                        self._start(key, loader, background=True)
                        revalidating = True
                    if self._events.enabled:
                        self._events.emit(
                            StaleServed(at=now, source=self.name, age=age, refreshing=revalidating)
                        )
                return Served(entry.value, age)
        flight = self._flights.get(key)
        if flight is None:
            flight = self._start(key, loader, background=False)
        # The age counts from when this load began, whatever happened to the entry since it
        # landed (evicted or invalidated before this caller resumed).
        value, loaded_at = await self._join(key, flight)
        age = max(0.0, self._clock.now() - loaded_at)
        if age > fresh and self._events.enabled:
            # A load slower than the freshness bound answers with content already that old:
            # the caller is told so (`stale_headers`), and it is counted like any stale answer.
            self._events.emit(
                StaleServed(at=self._clock.now(), source=self.name, age=age, refreshing=False)
            )
        return Served(value, age)

    async def _join(self, key: K, flight: _Flight[V]) -> tuple[V, float]:
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            # The last caller gave up: stop the load and free what it holds (D5). That holds
            # for a background refresh callers joined too: it may hang (no load_timeout), and
            # left running it would pin the key, every later caller joining it in vain.
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()
                if self._flights.get(key) is flight:
                    del self._flights[key]  # a caller arriving now starts a new load

    def _start(self, key: K, loader: Callable[[], Awaitable[V]], *, background: bool) -> _Flight[V]:
        self.loads += 1
        loop = asyncio.get_running_loop()
        # A foreground load runs in the caller's context (its deadline bounds the budget); a
        # background refresh is detached from the request that noticed the staleness.
        context = contextvars.Context() if background else contextvars.copy_context()
        task = loop.create_task(self._load(key, loader, background), context=context)
        flight = _Flight(task, background)
        self._flights[key] = flight
        if background:
            self._refreshing += 1
        task.add_done_callback(lambda t: self._landed(key, flight, t))
        return flight

    async def _load(
        self, key: K, loader: Callable[[], Awaitable[V]], background: bool
    ) -> tuple[V, float]:
        cache_loading.set(self.name)  # the task has its own context copy: nothing leaks
        started = self._clock.now()
        if background:
            async with request(
                deadline=self.load_timeout,
                priority=Priority.SHEDDABLE,
                operation=f"refresh:{self.name}",
            ):
                value = await loader()
        elif self.load_timeout is not None:
            async with asyncio.timeout(self.load_timeout):
                value = await loader()
        else:
            value = await loader()
        self._store(key, value, started)
        return value, started

    def _store(self, key: K, value: V, loaded_at: float) -> None:
        entries = self._entries
        entries[key] = _Entry(value, loaded_at)
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            evicted, _ = entries.popitem(last=False)
            flight = self._flights.get(evicted)
            if flight is not None and flight.background and not flight.waiters:
                # Its result would go to a key nobody can read now: stop it (D5).
                flight.task.cancel()

    def _landed(self, key: K, flight: _Flight[V], task: asyncio.Task[tuple[V, float]]) -> None:
        if flight.background:
            self._refreshing -= 1
        if self._flights.get(key) is flight:
            del self._flights[key]
        if task.cancelled():
            return
        error = task.exception()  # retrieved, so a failed refresh is never "unretrieved"
        if error is None:
            return
        if isinstance(error, FailClosed):
            # Authoritative data fails closed: never answer this key from memory again.
            self._entries.pop(key, None)
            return
        entry = self._entries.get(key)
        if entry is not None:
            entry.retry_at = self._clock.now() + self.failure_backoff

    def __repr__(self) -> str:
        return (
            f"StaleCache(name={self.name!r}, entries={len(self._entries)}/{self.max_entries}, "
            f"fresh_for={self.fresh_for}, max_staleness={self.max_staleness})"
        )
