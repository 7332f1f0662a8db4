"""What a fleet limit decides, with no I/O: shared by `FleetLimit` (asyncio) and
`ThreadFleetLimit` (threads), which only send the store calls these methods ask for (B3).

Per acquire: `FleetDecisions._ask` reads the request context and refuses, falls back or says
how long the store may take; the driver calls the store; `_answered` (a grant or a refusal) or
`_failed` (the failure policy) decides the rest. Every state change happens under the limit's
lock, and the store call outside it, so threads share one limit safely.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Iterator, Mapping
from typing import Literal, NamedTuple, NoReturn

from .._clock import Clock, default_clock
from .._context import current
from .._errors import Reason, Rejected
from .._priority import Priority
from ..events import (
    EventHub,
    FleetStoreChanged,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestShed,
    hub,
)
from .store import LeaseExpired, LeaseGrant, LeaseStoreUnavailable, LeaseUnfenced

__all__ = [
    "DEADLINE_SHARE",
    "Ask",
    "FleetDecisions",
    "LeaseHandle",
    "StoreFailurePolicy",
]

DEADLINE_SHARE = 0.5
"""The largest share of a request's remaining time a store call may take: the rest is the
request's own (and the failure policy's, when the store does not answer)."""

StoreFailurePolicy = Literal["open", "closed"]

# A lease's state.
NEW, HELD, SETTLED, RELEASED = 0, 1, 2, 3


class Ask(NamedTuple):
    """One store call to make: how long it may take, and what the answer is weighed against."""

    budget: float
    timeout: float
    probe: bool
    started: float
    left: float | None


class FleetDecisions:
    """The state and decisions of a fleet limit; see `FleetLimit` for the settings."""

    __slots__ = (
        "_backoff",
        "_clock",
        "_down",
        "_events",
        "_last_seen_fleet",
        "_local_limit",
        "_lock",
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
        store: object | None = None,
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
            raise TypeError(f"pass exactly one of redis= ({self._client_kind}) or store=")
        self.store: object = (
            self._redis_store(redis, prefix, timeout) if store is None else self._checked(store)
        )
        self.name = name
        self.limit = limit
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
        self._lock = threading.Lock()
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

    # What the driver builds from ``redis=`` and accepts as ``store=``.
    _client_kind = "a redis client"

    def _redis_store(self, client: object, prefix: str, timeout: float) -> object:
        raise NotImplementedError

    def _checked(self, store: object) -> object:
        return store

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

    def try_admit(self) -> NoReturn:
        """Always `Rejected` (``overloaded``): a fleet lease needs a round trip, and this call
        may not wait. The edge calls it only to let over-quota work use idle capacity."""
        raise Rejected(Reason.OVERLOADED, f"fleet limit {self.name!r} cannot admit without asking")

    def gauges(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Live state for exporters (`brownout.Stats.watch`), labelled with the limit's name:
        this instance's leases, the limit, the fleet's holders as last seen, store failures.
        (``fleet_fallback_active`` comes from `FleetStoreChanged`, as the quota's does.)"""
        labels = {"source": self.name}
        yield ("in_flight", labels, float(self.holders))
        yield ("limit", labels, float(self.limit))
        yield ("fleet_holders", labels, float(self._last_seen_fleet))
        yield ("fleet_store_failures", labels, float(self.store_failures))

    # -- acquire: before, and after, the store call ------------------------------------------
    def _ask(self, lease: LeaseHandle) -> Ask | None:
        """Refuse now, grant locally (None), or the store call to make."""
        ctx = current()
        lease.priority = ctx.priority
        lease.caller = ctx.caller
        lease.operation = ctx.operation
        deadline = ctx.deadline
        left = None if deadline is None else deadline.remaining()
        with self._lock:
            lease.deadline_at = math.inf if deadline is None else self._clock.now() + (left or 0.0)
            if self._events.enabled:
                self._emit(RequestOffered, lease, remaining=left)
            if left is not None and left <= 0:
                self._refuse(
                    lease, Reason.DEADLINE_EXPIRED, "the deadline expired before asking", left
                )
            probe = False
            if self._down:
                if self._probing or self._clock.now() < self._probe_at:
                    self._on_failure(lease, left)
                    return None
                probe = self._probing = True
            timeout = float(getattr(self.store, "timeout", math.inf))
            budget = timeout
            if left is not None and left * DEADLINE_SHARE < budget:
                budget = left * DEADLINE_SHARE
            return Ask(budget, timeout, probe, self._clock.now(), left)

    def _answered(self, lease: LeaseHandle, ask: Ask, grant: LeaseGrant) -> None:
        with self._lock:
            self._asked(ask)
            self._waited = 0.0
            if self._down:
                self._recover()
            self._last_seen_fleet = grant.holders
            if not grant.granted:
                self._refuse(
                    lease,
                    Reason.OVERLOADED,
                    f"fleet limit {self.name!r} is full: {grant.holders} of {self.limit} held",
                    ask.left,
                )
            lease.token = grant.token
            lease.expires_at = ask.started + self.lease  # never later than the store's own
            self._granted(lease, ask.started)

    def _failed(self, lease: LeaseHandle, ask: Ask, error: BaseException) -> None:
        """The store failed or timed out: the failure policy grants locally or refuses."""
        with self._lock:
            self._asked(ask)
            self.store_failures += 1
            detail = error.detail if isinstance(error, LeaseStoreUnavailable) else "store timed out"
            timed_out = not isinstance(error, LeaseStoreUnavailable) or error.timed_out
            if ask.probe or not timed_out or ask.budget >= ask.timeout:
                self._trip(detail, ask.probe)
            else:
                # Cut short by the request's deadline: weaker evidence than a full timeout;
                # together they count as one once they add up to the timeout.
                self._waited += ask.budget
                if self._waited >= ask.timeout:
                    self._trip(f"{detail} (deadline-cut timeouts add up to the timeout)", ask.probe)
            self._on_failure(lease, ask.left)

    def _abandoned(self, ask: Ask) -> None:
        """The store call was interrupted (cancelled): no answer to weigh."""
        with self._lock:
            self._asked(ask)

    def _asked(self, ask: Ask) -> None:
        if ask.probe:
            self._probing = False

    def _granted(self, lease: LeaseHandle, started: float) -> None:
        lease._state = HELD
        lease.admitted_at = self._clock.now()
        self.holders += 1
        if self._events.enabled:
            self._emit(RequestAdmitted, lease, queue_wait=lease.admitted_at - started)

    def _on_failure(self, lease: LeaseHandle, left: float | None) -> None:
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
        lease: LeaseHandle,
        reason: Reason,
        detail: str,
        left: float | None,
        retry_after: float | None = None,
    ) -> NoReturn:
        lease._state = RELEASED
        if self._events.enabled:
            self._emit(RequestShed, lease, reason=reason, remaining=left, queue_wait=0.0)
        raise Rejected(reason, detail, retry_after=retry_after)

    def _emit(self, kind: type, lease: LeaseHandle, **fields: object) -> None:
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

    # -- release and renew ------------------------------------------------------------------
    def _leave(self, lease: LeaseHandle) -> int | None:
        """Give the slot back here; the token the store must forget (None: nothing stored)."""
        with self._lock:
            if lease._state == RELEASED or lease._state == NEW:
                return None
            if lease._state == HELD:
                self._settle_now(lease, "success", "")
            lease._state = RELEASED
            self.holders -= 1
            return lease.token

    def _store_failed(self) -> None:
        with self._lock:
            self.store_failures += 1

    def _renewing(self, lease: LeaseHandle) -> int | None:
        """The token to renew (None: a local lease, which has no expiry)."""
        lease.check()
        return lease.token

    def _renewed(self, lease: LeaseHandle, token: int, extended: bool, started: float) -> None:
        if not extended:
            lease.expires_at = -math.inf
            raise LeaseExpired(f"fleet lease {token} of {self.name!r} had expired: not renewed")
        lease.expires_at = started + self.lease

    def _settle(self, lease: LeaseHandle, outcome: str, error: str) -> None:
        with self._lock:
            self._settle_now(lease, outcome, error)

    def _settle_now(self, lease: LeaseHandle, outcome: str, error: str) -> None:
        if lease._state != HELD:
            return
        lease._state = SETTLED
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
                    FleetStoreChanged(
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
                FleetStoreChanged(
                    at=self._clock.now(),
                    source=self.name,
                    fallback=False,
                    detail="fleet lease store answers again",
                )
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, limit={self.limit!r}, "
            f"lease={self.lease!r}, store={self.store!r}, "
            f"on_store_failure={self.on_store_failure!r})"
        )


class LeaseHandle:
    """What both kinds of lease share: state, validity, `check`, and settling as a permit."""

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

    def __init__(self, limit: FleetDecisions) -> None:
        self._limit = limit
        self._state = NEW
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
        return self._state in (HELD, SETTLED) and self._limit._clock.now() < self.expires_at

    @property
    def remaining(self) -> float:
        """Seconds the lease stays valid (0.0 once it is not; ``inf`` for a local lease)."""
        if self._state not in (HELD, SETTLED):
            return 0.0
        return max(0.0, self.expires_at - self._limit._clock.now())

    def check(self, *, fenced: bool = False) -> None:
        """Raise `LeaseExpired` unless the lease may still act: call it before each action.

        A lease granted locally while the store was down (fail-open: ``token is None``) has
        no expiry, since no store can give its slot to anyone else: it passes while held.
        ``fenced=True`` is for an action the resource accepts only with a fencing token: such
        a lease then raises `LeaseUnfenced` (a `LeaseExpired`) instead of acting unfenced.
        """
        if self._state not in (HELD, SETTLED):
            raise LeaseExpired(f"fleet lease of {self._limit.name!r} is not held")
        if self._limit._clock.now() >= self.expires_at:
            raise LeaseExpired(
                f"fleet lease {self.token} of {self._limit.name!r} expired: its slot may be "
                "another holder's now"
            )
        if fenced and self.token is None:
            raise LeaseUnfenced(
                f"fleet lease of {self._limit.name!r} was granted while its store was down: "
                "it has no fencing token"
            )

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
        """Settle by the exception the work raised, as leaving the block does."""
        if issubclass(exc_type, (TimeoutError, asyncio.CancelledError)):
            self.dropped()
        elif issubclass(exc_type, Rejected):
            self.ignore()
        else:
            self.failed(exc_type.__name__)

    @property
    def settled(self) -> bool:
        return self._state in (SETTLED, RELEASED)

    def __repr__(self) -> str:
        state = ("new", "held", "settled", "released")[self._state]
        return f"<{type(self).__name__} {self._limit.name} token={self.token} {state}>"
