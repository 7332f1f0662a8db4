"""`Idempotency`: the server half of idempotency keys (IETF HTTPAPI ``Idempotency-Key`` draft).

Adapters hand every request to `Idempotency.begin` with its method, target, operation,
``Idempotency-Key`` value and body, and get one of three answers:

- ``None``: nothing to do (the route's rule does not cover the method, no key was sent where
  none is required, or the store is down and ``on_outage="open"``): run the handler as usual;
- an `IdempotentAnswer`: write it and do not run the handler (a replay, or a problem+json
  refusal: 400 missing/invalid key, 409 in progress, 413 body too large, 422 mismatch, 503
  store down with ``on_outage="closed"``);
- a `Ticket`: the key is this request's; run the handler, then `Ticket.complete` with its
  answer, `Ticket.release` when it raised, or `Ticket.abandon` when it was cancelled.

The rules a ticket ends by (documented in docs/idempotency.md):

- an answer below 500 is stored for the rule's ``ttl`` and replayed to every repeat;
- an answer of 500 or more, or an exception, releases the key: the handler says it did not
  do the work, so the next attempt runs it (on PostgreSQL the rollback makes that true);
- a cancelled handler (deadline, disconnect) may or may not have applied its effect: the key
  stays locked until the lease (the request's remaining deadline plus ``lease_margin``, or
  ``default_lease`` without a deadline) ends, repeats get 409 with ``Retry-After``, and then
  a later attempt runs it again. On PostgreSQL the effect rolls back and the key is free.
"""

from __future__ import annotations

import contextvars
import http
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .._clock import Clock, default_clock
from .._context import get_current
from .._edge.refusals import PROBLEM_CONTENT_TYPE, problem_body
from .._errors import Reason
from .._propagation import IDEMPOTENCY_HEADER
from ..events import EventHub, IdempotencyDecided, hub
from .model import (
    Claim,
    ClaimState,
    IdempotencyKeyInvalid,
    IdempotencyStore,
    IdempotencyStoreUnavailable,
    StoredResponse,
    fingerprint,
    parse_key,
    store_key,
)

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "REPLAYED_HEADER",
    "Idempotency",
    "IdempotencyRule",
    "IdempotentAnswer",
    "NoTransaction",
    "Ticket",
    "transaction",
]

_log = logging.getLogger("brownout.idempotency")

IDEMPOTENCY_KEY_HEADER = IDEMPOTENCY_HEADER
REPLAYED_HEADER = "idempotent-replayed"
"""Added (``true``) to every replayed answer, so clients and logs can tell."""

OutagePolicy = Literal["open", "closed"]

_TRANSACTION: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "brownout_idempotency_transaction", default=None
)


class NoTransaction(LookupError):
    """`transaction` was called outside a request run under a transactional store's key."""


def transaction() -> Any:
    """The connection of the PostgreSQL store's open transaction for the current request: write
    the effect through it and it commits with the stored answer (or rolls back with it).
    Raises `NoTransaction` outside such a request."""
    conn = _TRANSACTION.get()
    if conn is None:
        raise NoTransaction("no idempotency transaction in this request")
    return conn


@dataclass(frozen=True, slots=True)
class IdempotencyRule:
    """Where keys apply: the ``methods`` (upper case) whose requests use them, whether a key
    is ``required`` (a request without one gets 400), and how long answers are kept (``ttl``
    seconds; ``None``: the layer's)."""

    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    required: bool = False
    ttl: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if self.ttl is not None and not 0 < self.ttl < math.inf:
            raise ValueError("ttl must be > 0 seconds")


OFF = IdempotencyRule(methods=frozenset())
"""A rule that turns the layer off for an operation."""


class IdempotentAnswer(NamedTuple):
    """What to answer instead of running the handler: ``status``, ``headers`` (lower-case
    names), ``body``; ``outcome`` names the decision (`IdempotencyDecided`), ``replayed`` says
    it is a stored answer, ``grpc_code`` (a `grpc.StatusCode` member name) and ``detail`` are
    what a gRPC adapter ends the call with."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    outcome: str
    replayed: bool = False
    grpc_code: str = "OK"
    detail: str = ""


def _problem(
    status: int, kind: str, detail: str, grpc_code: str, retry_after: float | None = None
) -> IdempotentAnswer:
    doc = {
        "type": f"urn:brownout:idempotency:{kind}",
        "title": http.HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "reason": f"idempotency_{kind}",
    }
    headers = [("content-type", PROBLEM_CONTENT_TYPE)]
    if retry_after is not None:
        headers.append(("retry-after", str(max(1, math.ceil(retry_after)))))
    body = json.dumps(doc, separators=(",", ":")).encode()
    return IdempotentAnswer(status, tuple(headers), body, kind, False, grpc_code, detail)


class Ticket:
    """The key is this request's while the handler runs; end it exactly once."""

    __slots__ = ("_claim", "_ended", "_layer", "_operation", "_reset", "_ttl")

    def __init__(self, layer: Idempotency, claim: Claim, operation: str, ttl: float) -> None:
        self._layer = layer
        self._claim = claim
        self._operation = operation
        self._ttl = ttl
        self._ended = False
        self._reset = _TRANSACTION.set(claim.connection) if claim.connection is not None else None

    @property
    def commits_first(self) -> bool:
        """The answer must be stored before it is sent: the store commits the handler's
        effect with it (PostgreSQL), so an answer sent before a failed commit would be a lie.
        Elsewhere an adapter may send first and store right after, saving the client one
        round trip (a repeat in between gets 409, never a second run)."""
        return bool(getattr(self._layer.store, "transactional", False))

    @property
    def connection(self) -> Any:
        """The PostgreSQL store's connection in the open transaction (else ``None``)."""
        return self._claim.connection

    def _end(self, outcome: str) -> bool:
        if self._ended:
            return False
        self._ended = True
        if self._reset is not None:
            try:
                _TRANSACTION.reset(self._reset)
            except ValueError:  # ended from another context: forget it there
                _TRANSACTION.set(None)
        self._layer._emit(self._operation, outcome)
        return True

    async def complete(
        self, status: int, headers: Iterable[tuple[str, str]], body: bytes
    ) -> IdempotentAnswer | None:
        """The handler answered: store it (below 500) or release the key (500 and up).

        Returns ``None`` to send the handler's answer, or an `IdempotentAnswer` to send
        instead: a transactional store (PostgreSQL) that could not commit rolled the effect
        back, so the handler's success would be a lie (503)."""
        layer = self._layer
        if status >= 500:
            await self.release()
            return None
        kept = tuple((k.lower(), v) for k, v in headers if k.lower() not in layer.unstored_headers)
        response = StoredResponse(status, kept, body)
        if response.size() > layer.max_response:
            _log.warning("answer of %s too large to store (%d bytes)", self._operation, len(body))
            await self._release("unstorable")
            return None
        if self._ended:
            return None
        try:
            stored = await layer.store.complete(self._claim, response, self._ttl)
        except IdempotencyStoreUnavailable as e:
            _log.warning("idempotency store could not keep an answer: %s", e)
            self._end("store_failed")
            if getattr(layer.store, "transactional", False):
                return layer._unavailable("The answer could not be committed; nothing changed.")
            return None
        self._end("stored" if stored else "lease_lost")
        return None

    async def unstorable(self) -> None:
        """The answer is over ``max_response``: release the key (counted ``unstorable``)."""
        await self._release("unstorable")

    async def release(self) -> None:
        """The handler raised (or answered 5xx): free the key for the next attempt."""
        await self._release("released")

    async def _release(self, outcome: str) -> None:
        if self._ended:
            return
        try:
            await self._layer.store.release(self._claim)
        except IdempotencyStoreUnavailable as e:  # the lease still ends by itself
            _log.warning("idempotency store could not release a key: %s", e)
        self._end(outcome)

    def abandon(self) -> None:
        """The handler was cancelled: its effect is unknown (see the module's rules)."""
        if self._end("abandoned"):
            self._layer.store.abandon(self._claim)


class Idempotency:
    """The idempotency layer: one store, a default `IdempotencyRule`, rules per operation.

    ``operations`` maps an operation (the route template, or a gRPC method's full name) to
    its rule (`OFF` turns it off there). ``ttl``: seconds an answer is kept; ``lease_margin``:
    added to the request's remaining deadline to make the lease; ``default_lease``: the lease
    of a request without a deadline. ``on_outage``: ``"closed"`` answers 503 while the store
    is down (no double execution); ``"open"`` runs the handler without deduplication.
    ``max_body`` and ``max_response`` bound the request body read and the answer stored.
    """

    __slots__ = (
        "_clock",
        "_events",
        "default_lease",
        "lease_margin",
        "max_body",
        "max_response",
        "name",
        "on_outage",
        "operations",
        "rule",
        "store",
        "ttl",
        "unstored_headers",
    )

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        rule: IdempotencyRule | None = None,
        operations: Mapping[str, IdempotencyRule] | None = None,
        ttl: float = 24 * 3600.0,
        lease_margin: float = 5.0,
        default_lease: float = 60.0,
        on_outage: OutagePolicy = "closed",
        max_body: int = 1 << 20,
        max_response: int = 1 << 20,
        name: str = "idempotency",
        unstored_headers: Iterable[str] = ("date", "server", "set-cookie"),
        events: EventHub = hub,
        clock: Clock | None = None,
    ) -> None:
        if on_outage not in ("open", "closed"):
            raise ValueError(f"on_outage must be 'open' or 'closed', not {on_outage!r}")
        for label, value in (
            ("ttl", ttl),
            ("default_lease", default_lease),
            ("max_body", max_body),
            ("max_response", max_response),
        ):
            if not 0 < value < math.inf:
                raise ValueError(f"{label} must be > 0")
        if not 0 <= lease_margin < math.inf:
            raise ValueError("lease_margin must be >= 0")
        self.store = store
        self.rule = rule or IdempotencyRule()
        self.operations = dict(operations or {})
        self.ttl = float(ttl)
        self.lease_margin = float(lease_margin)
        self.default_lease = float(default_lease)
        self.on_outage: OutagePolicy = on_outage
        self.max_body = int(max_body)
        self.max_response = int(max_response)
        self.name = name
        self.unstored_headers = frozenset(h.lower() for h in unstored_headers) | {REPLAYED_HEADER}
        self._events = events
        self._clock = clock or default_clock()

    def rule_for(self, operation: str, method: str) -> IdempotencyRule | None:
        """The rule covering ``method`` on ``operation``, or ``None`` when none does."""
        rule = self.operations.get(operation, self.rule)
        return rule if method.upper() in rule.methods else None

    def _emit(self, operation: str, outcome: str) -> None:
        events = self._events
        if events.enabled:
            events.emit(IdempotencyDecided(self._clock.now(), self.name, operation, outcome))

    def _unavailable(self, detail: str) -> IdempotentAnswer:
        body = problem_body(Reason.DEPENDENCY_UNAVAILABLE, 503, detail=detail)
        headers = (("content-type", PROBLEM_CONTENT_TYPE), ("retry-after", "1"))
        return IdempotentAnswer(503, headers, body, "unavailable_closed", False, "UNAVAILABLE")

    def too_large(self, operation: str) -> IdempotentAnswer:
        """The answer to a request whose body is over ``max_body`` (413)."""
        self._emit(operation, "too_large")
        return _problem(
            413,
            "too_large",
            f"The body of a request with an idempotency key is limited to {self.max_body} bytes.",
            "RESOURCE_EXHAUSTED",
        )

    async def begin(
        self,
        *,
        method: str,
        target: str,
        operation: str,
        key: str | None,
        body: bytes,
        caller: str | None = None,
        remaining: float | None = None,
        rule: IdempotencyRule | None = None,
    ) -> IdempotentAnswer | Ticket | None:
        """Decide one request (see the module docstring). ``key``: the raw
        ``Idempotency-Key`` value (``None``: the request context's key, if any); ``caller``
        and ``remaining`` default to the current request context's."""
        rule = rule or self.rule_for(operation, method)
        if rule is None:
            return None
        ctx = get_current()
        if key is None:
            key = ctx.idempotency_key
        if key is None:
            if not rule.required:
                return None
            self._emit(operation, "missing")
            return _problem(
                400,
                "missing",
                f"{method.upper()} {operation} requires an Idempotency-Key header.",
                "INVALID_ARGUMENT",
            )
        try:
            token = parse_key(key)
        except IdempotencyKeyInvalid as e:
            self._emit(operation, "invalid")
            return _problem(400, "invalid", str(e), "INVALID_ARGUMENT")
        if len(body) > self.max_body:
            return self.too_large(operation)
        if caller is None:
            caller = ctx.caller
        if remaining is None:
            remaining = ctx.remaining()
        lease = self.default_lease if remaining is None else max(remaining, 0.0)
        lease += self.lease_margin
        name = store_key(caller, token)
        try:
            claim = await self.store.begin(name, fingerprint(method, target, body), lease)
        except IdempotencyStoreUnavailable as e:
            _log.warning("idempotency store unavailable (%s): %s", self.on_outage, e)
            if self.on_outage == "open":
                self._emit(operation, "unavailable_open")
                return None
            self._emit(operation, "unavailable_closed")
            return self._unavailable(
                "The idempotency store is unavailable, so the request was not run; retry later."
            )
        state = claim.state
        if state is ClaimState.RUN:
            self._emit(operation, "executed")
            return Ticket(self, claim, operation, rule.ttl or self.ttl)
        if state is ClaimState.REPLAY:
            response = claim.response
            assert response is not None  # (a store's REPLAY always carries one)
            self._emit(operation, "replayed")
            headers = (*response.headers, (REPLAYED_HEADER, "true"))
            return IdempotentAnswer(response.status, headers, response.body, "replayed", True)
        if state is ClaimState.IN_PROGRESS:
            self._emit(operation, "in_progress")
            return _problem(
                409,
                "in_progress",
                "A request with this Idempotency-Key is still being processed; retry later.",
                "ABORTED",
                claim.retry_after,
            )
        self._emit(operation, "mismatch")
        return _problem(
            422,
            "mismatch",
            "This Idempotency-Key was used for a different request (method, target or body).",
            "FAILED_PRECONDITION",
        )

    def __repr__(self) -> str:
        return f"Idempotency({self.store!r}, on_outage={self.on_outage!r})"
