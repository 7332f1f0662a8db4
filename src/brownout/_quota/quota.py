"""`Quota`: per-key GCRA limits with a defined behaviour when a shared store fails (S2, S5, F1).

`Quota.check` returns a `QuotaDecision`; the edge turns a refusal into 429 with
``Retry-After`` and the IETF ``RateLimit`` / ``RateLimit-Policy`` headers (or demotes the
request to SHEDDABLE when spare capacity exists, S5).

With a shared store (Redis) every call is bounded by the store's timeout, shortened to half
(`DEADLINE_SHARE`) of the request's remaining time. When the store times out or fails, the
failure policy decides:

- ``"open"`` (default): fall back to a local in-memory quota of ``rate / expected_instances``
  (and ``burst / expected_instances``), so the fleet as a whole stays near the limit while each
  instance decides alone.
- ``"closed"``: refuse with `Reason.DEPENDENCY_UNAVAILABLE` (503, not 429: the caller did
  nothing wrong; the service cannot check its quota). Use it where over-admission is worse
  than unavailability (G4).

A store that fails, or times out after its full timeout, is down at once. Timeouts cut short by
requests' deadlines count too: once those since the store last answered have waited, together,
as long as its timeout, it is down (so a stalled Redis is noticed even when every request's
deadline is shorter than its timeout; one request with a sliver of time left is not enough).
Entering and leaving the fallback emits `QuotaBackendChanged` (the `Stats` sink keeps it as the
``quota_fallback`` gauge). While in fallback, the store is probed again after a jittered,
doubling backoff, by one request at a time; every other request decides locally, so a dead
Redis is not hammered. The first successful probe restores the shared quota.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from .._clock import Clock, default_clock
from .._context import remaining as deadline_remaining
from .._errors import Reason, Rejected
from ..events import EventHub, QuotaBackendChanged, hub
from .gcra import GcraOutcome, GcraPolicy, invalid_cost
from .memory import InMemoryQuotaStore
from .redis import RedisQuotaStore
from .store import QuotaStore, QuotaStoreUnavailable

__all__ = ["DEADLINE_SHARE", "EdgeQuota", "FailurePolicy", "Quota", "QuotaDecision"]

DEADLINE_SHARE = 0.5
"""The largest share of a request's remaining time a shared store may take to decide it: the
rest is the request's own (and the failure policy's, when the store does not answer)."""

FailurePolicy = Literal["open", "closed"]

Backend = Literal["local", "shared", "fallback", "closed"]
"""Which path decided: the in-process store, the shared store, the local fail-open
fallback, or the fail-closed refusal."""


class QuotaDecision(NamedTuple):
    """One quota decision for one key.

    ``allowed``; ``retry_after``: seconds until this request would be allowed (0 when
    allowed); ``limit``: the burst (units allowed at once); ``remaining``: units allowed right
    now; ``reset``: seconds until the key's allowance is full again; ``reason``: why it was
    refused (`Reason.QUOTA`, or `Reason.DEPENDENCY_UNAVAILABLE` when failing closed), ``None``
    when allowed; ``backend``: which path decided; ``policy``: the limit that applied.
    Immutable (a named tuple: one is built per request, and tuples are the cheapest to build).
    """

    allowed: bool
    retry_after: float
    limit: int
    remaining: int
    reset: float
    reason: Reason | None
    backend: Backend
    policy: GcraPolicy
    name: str

    def headers(self) -> dict[str, str]:
        """HTTP response headers for this decision (draft-ietf-httpapi-ratelimit-headers).

        ``RateLimit-Policy: "<name>";q=<quota>;w=<window>`` and
        ``RateLimit: "<name>";r=<remaining>;t=<reset>``, plus ``Retry-After`` (whole seconds,
        at least 1) on a refusal. GCRA has no fixed window: the policy is advertised as the
        rate over ``w = max(1, ceil(burst / rate))`` seconds, the time a drained allowance
        takes to refill. A fail-closed refusal carries only ``Retry-After``.
        """
        out: dict[str, str] = {}
        if self.backend != "closed":
            window, quota = policy_window(self.policy)
            out["RateLimit-Policy"] = f'"{self.name}";q={quota};w={window}'
            out["RateLimit"] = f'"{self.name}";r={self.remaining};t={math.ceil(self.reset)}'
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return out

    def rejection(self) -> Rejected:
        """The `Rejected` to raise for this refusal (``Reason.QUOTA`` maps to 429)."""
        reason = self.reason or Reason.QUOTA
        if reason is Reason.QUOTA:
            detail = f"quota {self.name!r} exceeded: {self.policy.rate:g}/s, burst {self.limit}"
        else:
            detail = f"quota {self.name!r} cannot be checked: its store is unavailable"
        return Rejected(reason, detail, retry_after=self.retry_after)


def policy_window(policy: GcraPolicy) -> tuple[int, int]:
    """``(window seconds, quota units)`` that describe ``policy`` for RateLimit-Policy."""
    window = max(1, math.ceil(policy.burst / policy.rate - 1e-9))
    quota = max(1, math.floor(policy.rate * window + 1e-9))
    return window, quota


class Quota:
    """A per-key rate limit (GCRA: ``rate`` units per second, ``burst`` at once).

    The key is the caller's choice: a caller id, or ``f"{caller}:{operation}"`` for a limit
    per caller and operation. ``store`` holds the state: `InMemoryQuotaStore` (default; this
    process only) or `RedisQuotaStore` (the whole fleet). ``on_store_failure`` and
    ``expected_instances`` define what happens when a shared store fails (module docs).
    """

    __slots__ = (
        "_backoff",
        "_bounds_itself",
        "_clock",
        "_down",
        "_events",
        "_fallback",
        "_fallback_policy",
        "_instances",
        "_local",
        "_probe_at",
        "_probing",
        "_random",
        "_store",
        "_store_timeout",
        "_waited",
        "closed_refusals",
        "fallback_decisions",
        "max_probe_backoff",
        "name",
        "on_store_failure",
        "policy",
        "probe_backoff",
        "shared_decisions",
        "store_failures",
    )

    def __init__(
        self,
        rate: float,
        burst: int,
        store: QuotaStore | None = None,
        *,
        name: str = "quota",
        on_store_failure: FailurePolicy = "open",
        expected_instances: int = 1,
        probe_backoff: float = 0.5,
        max_probe_backoff: float = 10.0,
        fallback_max_keys: int = 100_000,
        clock: Clock | None = None,
        events: EventHub = hub,
        rng: random.Random | None = None,
    ) -> None:
        if on_store_failure not in ("open", "closed"):
            raise ValueError('on_store_failure must be "open" or "closed"')
        if expected_instances < 1:
            raise ValueError("expected_instances must be >= 1")
        if not 0 < probe_backoff <= max_probe_backoff:
            raise ValueError("need 0 < probe_backoff <= max_probe_backoff")
        if not name or any(c in name for c in '"\\') or not name.isprintable():
            raise ValueError(f"name must be printable, without quotes or backslashes: {name!r}")
        self.policy = GcraPolicy(rate, burst)
        self._instances = expected_instances
        self._fallback_policy = self.policy.scaled(expected_instances)
        self.name = name
        self.on_store_failure: FailurePolicy = on_store_failure
        self.probe_backoff = probe_backoff
        self.max_probe_backoff = max_probe_backoff
        self._clock = clock if clock is not None else default_clock()
        self._events = events
        self._random = rng if rng is not None else random.Random()
        if store is None:
            store = InMemoryQuotaStore(clock=self._clock)
        self._store = store
        self._local = store if isinstance(store, InMemoryQuotaStore) else None
        self._store_timeout: float = getattr(store, "timeout", math.inf)
        self._bounds_itself = isinstance(store, RedisQuotaStore)
        """The Redis store bounds each call by its budget itself (connection included)."""
        self._fallback = InMemoryQuotaStore(fallback_max_keys, clock=self._clock)
        self._down = False
        self._probing = False
        self._probe_at = 0.0
        self._backoff = probe_backoff
        self._waited = 0.0
        """Seconds that deadline-cut timeouts waited since the store last answered."""
        self.shared_decisions = 0
        """Decisions made by the shared store."""
        self.fallback_decisions = 0
        """Decisions made locally because the shared store was unavailable (fail-open)."""
        self.closed_refusals = 0
        """Requests refused because the shared store was unavailable (fail-closed)."""
        self.store_failures = 0
        """Store calls that timed out or failed."""

    @property
    def store(self) -> QuotaStore:
        return self._store

    @property
    def fallback_active(self) -> bool:
        """True while the shared store is considered down and the failure policy decides."""
        return self._down

    @property
    def expected_instances(self) -> int:
        """How many instances share the quota (the fail-open fallback divides by it)."""
        return self._instances

    @property
    def fallback_policy(self) -> GcraPolicy:
        """The local limit used while failing open: the policy split over the fleet."""
        return self._fallback_policy

    async def check(self, key: str, cost: int = 1) -> QuotaDecision:
        """Decide one request of ``cost`` units for ``key``. Never raises for a store failure;
        a cost outside ``1..burst`` is a ``ValueError`` whichever backend decides."""
        local = self._local
        if local is not None:
            return self._decision(local.decide_now(key, self.policy, cost), "local", self.policy)
        now = self._clock.now()
        probe = False
        if self._down:
            if self._probing or now < self._probe_at:
                return self._on_failure(key, cost, now)
            probe = self._probing = True
        budget = self._store_timeout
        left = deadline_remaining()
        if left is not None and left * DEADLINE_SHARE < budget:
            # At most a share of what is left: the request keeps the rest for itself, and a
            # store that does not answer still leaves it time for the failure policy's answer.
            budget = max(left * DEADLINE_SHARE, 0.0)
        try:
            if self._bounds_itself:
                outcome = await self._store.decide(key, self.policy, cost, budget)
            else:
                # A store of your own may ignore ``budget``: the quota bounds it anyway.
                outcome = await self._bounded(key, cost, budget)
        except QuotaStoreUnavailable as e:
            self.store_failures += 1
            if e.key_only:
                # One key holding another application's value: the store answered.
                self._waited = 0.0
            elif budget <= 0:
                pass  # no time left to ask at all: says nothing about the store
            elif probe or not e.timed_out or budget >= self._store_timeout:
                self._trip(e.detail, probe)
            else:
                # Cut short by the request's deadline: evidence, but weaker than a full
                # timeout. Together they count as one once they add up to the timeout.
                self._waited += budget
                if self._waited >= self._store_timeout:
                    self._trip(f"{e.detail} (deadline-cut timeouts add up to the timeout)", probe)
            return self._on_failure(key, cost, self._clock.now())
        finally:
            if probe:
                self._probing = False
        self._waited = 0.0
        if self._down:
            self._recover()
        self.shared_decisions += 1
        return self._decision(outcome, "shared", self.policy)

    async def _bounded(self, key: str, cost: int, budget: float) -> GcraOutcome:
        if budget <= 0:
            raise QuotaStoreUnavailable("no time left to ask the store", timed_out=True)
        try:
            async with asyncio.timeout(None if budget == math.inf else budget):
                return await self._store.decide(key, self.policy, cost, budget)
        except TimeoutError as e:
            raise QuotaStoreUnavailable(
                f"{type(self._store).__name__} did not answer within {budget * 1000:.0f} ms",
                timed_out=True,
            ) from e

    async def acquire(self, key: str, cost: int = 1) -> QuotaDecision:
        """Like `check`, but raise the decision's `Rejected` when refused."""
        decision = await self.check(key, cost)
        if not decision.allowed:
            raise decision.rejection()
        return decision

    def for_edge(
        self,
        *,
        key: Callable[[Any], str],
        cost: Callable[[Any], int] | None = None,
        per_caller: bool = True,
    ) -> EdgeQuota:
        """An async hook ``(classification) -> QuotaDecision`` for the edge's quota step.

        ``key`` (required: there is no default caller) picks the quota key from what the edge
        passes, e.g. ``lambda c: c.caller`` or ``lambda c: f"{c.caller}:{c.operation}"``;
        ``cost`` optionally weighs the request. ``per_caller`` (default) declares that the key
        tells callers apart by the classified caller, so the hook's ``requires_classifier`` is
        true: without a classifier every caller is ``"unknown"`` and all would share one
        allowance. Pass ``per_caller=False`` for a limit shared on purpose (per operation, or
        one for the whole service).
        """
        return EdgeQuota(self, key, cost, requires_classifier=per_caller)

    # -- failure policy ---------------------------------------------------------------------
    def _on_failure(self, key: str, cost: int, now: float) -> QuotaDecision:
        # A caller's impossible cost is its error, as with a healthy store: not a request
        # admitted at the clamped cost below (fail-open), nor a 503 (fail-closed).
        burst = self.policy.burst
        if not 1 <= cost <= burst:
            raise invalid_cost(cost, burst)
        if self.on_store_failure == "open":
            self.fallback_decisions += 1
            policy = self._fallback_policy
            cost = min(cost, policy.burst)
            return self._decision(self._fallback.decide_now(key, policy, cost), "fallback", policy)
        self.closed_refusals += 1
        wait = max(self._probe_at - now, 0.0) if self._down else 0.0
        return QuotaDecision(
            allowed=False,
            retry_after=max(wait, 0.001),
            limit=self.policy.burst,
            remaining=0,
            reset=0.0,
            reason=Reason.DEPENDENCY_UNAVAILABLE,
            backend="closed",
            policy=self.policy,
            name=self.name,
        )

    def _trip(self, detail: str, probe: bool) -> None:
        now = self._clock.now()
        if self._down:
            if not probe:
                return  # a call that started before the outage was noticed: nothing new
            self._backoff = min(self._backoff * 2, self.max_probe_backoff)
        else:
            self._down = True
            self._waited = 0.0
            self._backoff = self.probe_backoff
            if self._events.enabled:
                how = (
                    f"fail-open: local quota {self.fallback_policy.rate:g}/s"
                    if self.on_store_failure == "open"
                    else "fail-closed: refusing"
                )
                self._events.emit(
                    QuotaBackendChanged(
                        at=now, source=self.name, fallback=True, detail=f"{detail}; {how}"
                    )
                )
        # Jitter keeps a fleet from probing a recovering store in one synchronized wave.
        self._probe_at = now + self._backoff * self._random.uniform(0.5, 1.0)

    def _recover(self) -> None:
        self._down = False
        self._backoff = self.probe_backoff
        self._fallback.clear()
        if self._events.enabled:
            self._events.emit(
                QuotaBackendChanged(
                    at=self._clock.now(),
                    source=self.name,
                    fallback=False,
                    detail="shared quota store answers again",
                )
            )

    def _decision(
        self, outcome: GcraOutcome, backend: Backend, policy: GcraPolicy
    ) -> QuotaDecision:
        allowed, _, retry_after, remaining, reset = outcome
        return QuotaDecision(
            allowed,
            retry_after,
            policy.burst,
            remaining,
            reset,
            None if allowed else Reason.QUOTA,
            backend,
            policy,
            self.name,
        )

    def __repr__(self) -> str:
        return (
            f"Quota(name={self.name!r}, rate={self.policy.rate!r}, burst={self.policy.burst!r}, "
            f"store={self._store!r}, on_store_failure={self.on_store_failure!r})"
        )


class EdgeQuota:
    """`Quota.for_edge`'s hook: ``await hook(classification)`` decides one request.

    ``requires_classifier`` is true when the key tells callers apart by the classified caller
    (``for_edge(per_caller=True)``, the default): an edge without a classifier classifies every
    caller as ``"unknown"``, so one caller's burst would refuse every other caller.
    """

    __slots__ = ("_cost", "_key", "quota", "requires_classifier")

    def __init__(
        self,
        quota: Quota,
        key: Callable[[Any], str],
        cost: Callable[[Any], int] | None,
        *,
        requires_classifier: bool,
    ) -> None:
        if not callable(key):
            raise TypeError(f"key must be a function of the classification, got {key!r}")
        if cost is not None and not callable(cost):
            raise TypeError(f"cost must be a function of the classification, got {cost!r}")
        self.quota = quota
        self._key = key
        self._cost = cost
        self.requires_classifier = requires_classifier

    async def __call__(self, request: Any) -> QuotaDecision:
        cost = self._cost
        return await self.quota.check(self._key(request), 1 if cost is None else cost(request))

    def __repr__(self) -> str:
        return f"EdgeQuota({self.quota!r}, requires_classifier={self.requires_classifier!r})"
