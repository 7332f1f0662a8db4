"""Unknown outcomes (D6): record them by idempotency key, reconcile them later.

A mutation that timed out or lost its connection after being sent may or may not have been
applied; cancelling the client does not undo it. `Dependency` raises `UnknownOutcome` and
writes the key to an `OutcomeLedger`; a `Reconciler` later asks the dependency (through a
user-supplied ``check(record)``) what happened, and marks each entry ``applied`` or
``not_applied``. Resending with the same idempotency key is safe only when the dependency
deduplicates by it; the reconciler is how you find out without resending.

`InMemoryOutcomeLedger` is bounded (oldest entries are evicted first, resolved before pending).
`brownout.RedisOutcomeLedger` shares the ledger across processes.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol, runtime_checkable

from .._clock import Clock, default_clock
from .._errors import BrownoutError, UnknownOutcome

__all__ = [
    "InMemoryOutcomeLedger",
    "OutcomeLedger",
    "OutcomeLedgerFull",
    "OutcomeRecord",
    "OutcomeState",
    "Reconciler",
    "ledger_name",
    "not_recorded",
    "record_shielded",
]

_log = logging.getLogger("brownout.retry")
_WRITES: set[asyncio.Future[None]] = set()  # shielded ledger writes still running (strong refs)


class OutcomeState(StrEnum):
    """What is known about a mutation's effect."""

    PENDING = "pending"
    """Sent, never answered: may or may not have been applied."""
    APPLIED = "applied"
    """The dependency applied it (exactly once, if it deduplicates by key)."""
    NOT_APPLIED = "not_applied"
    """The dependency never applied it: safe to send again, or to report as failed."""


class OutcomeLedgerFull(BrownoutError):
    """A ledger refused to record an unknown outcome: pending entries alone fill it.

    Raised instead of dropping a pending entry (the only record of its mutation) to make
    room. ``Dependency`` logs it with the key, and its caller still gets `UnknownOutcome`.
    """

    def __init__(self, key: str, *, pending: int, max_entries: int) -> None:
        super().__init__(
            f"outcome ledger full: {pending} pending entries at max_entries={max_entries}; "
            f"the unknown outcome of key {key!r} was not recorded"
        )
        self.key = key
        self.pending = pending
        self.max_entries = max_entries


@dataclass(frozen=True, slots=True)
class OutcomeRecord:
    """One ledger entry."""

    key: str
    dependency: str
    state: OutcomeState
    recorded_at: float
    """When it was recorded (the ledger's clock: monotonic in memory, Unix time on Redis)."""
    detail: str = ""
    checks: int = 0
    """How many times a reconciler asked about it without getting an answer."""
    previous: OutcomeState | None = None
    """What an earlier reconciliation found, when a later attempt with the same key made the
    outcome unknown again (``None`` otherwise). It says what was true *before* that attempt:
    after ``NOT_APPLIED`` the resend may have applied it; after ``APPLIED`` a dependency that
    deduplicates by key applied it once."""


@runtime_checkable
class OutcomeLedger(Protocol):
    """Where unknown outcomes are kept until reconciled."""

    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        """Record that the mutation with this key has an unknown outcome.

        A key already pending keeps its record, but its ``checks`` start again from 0: the
        new attempt is one no reconciler has asked about, so one that left the key for a human
        after ``max_checks`` must not keep it from being checked. A key already resolved is
        pending again: the new attempt may have changed what the resolution said (a resend
        after ``NOT_APPLIED`` may have been applied), so it is reconciled again, its record
        dated from this call with the earlier resolution in ``previous``.
        """
        ...

    async def resolve(self, key: str, state: OutcomeState) -> None:
        """Record what became of it (``APPLIED`` or ``NOT_APPLIED``)."""
        ...

    async def get(self, key: str) -> OutcomeRecord | None: ...

    async def pending(self, limit: int = 100) -> list[OutcomeRecord]:
        """Up to ``limit`` unresolved entries, oldest first."""
        ...

    async def note_check(self, key: str) -> None:
        """Count one inconclusive reconciliation attempt."""
        ...


async def record_shielded(
    ledger: OutcomeLedger,
    key: str,
    unknown: UnknownOutcome,
    *,
    source: str,
    failed: Callable[[OutcomeLedger, str, BaseException], None],
) -> None:
    """Write ``unknown`` to ``ledger`` under ``key`` (D6), whatever happens to the caller.

    The write is shielded: a deadline (or the caller) may cancel the call while the write is
    on the wire, and a cut-off write loses the only record of the mutation. A failing write
    calls ``failed(ledger, key, error)`` once, from the write's own callback (so also when the
    caller is gone: to log and emit it); the caller's `UnknownOutcome` then gets
    ``recorded=False`` and a note, not the store's error (which an upper layer could mistake
    for a transient failure and retry). A write that succeeds sets ``recorded=True``."""
    write = asyncio.ensure_future(
        ledger.record_unknown(key, dependency=source, detail=repr(unknown.__cause__))
    )
    _WRITES.add(write)
    write.add_done_callback(functools.partial(_written, ledger, key, failed))
    try:
        await asyncio.shield(write)
    except Exception as error:  # reported by _written
        not_recorded(unknown, key, error)
    else:
        unknown.recorded = True


def _written(
    ledger: OutcomeLedger,
    key: str,
    failed: Callable[[OutcomeLedger, str, BaseException], None],
    write: asyncio.Future[None],
) -> None:
    _WRITES.discard(write)
    if write.cancelled() or (error := write.exception()) is None:
        return
    failed(ledger, key, error)


def not_recorded(unknown: UnknownOutcome, key: str, error: BaseException) -> None:
    """Mark ``unknown`` as missing from the ledger, with a note saying what to do."""
    unknown.recorded = False
    unknown.add_note(
        f"not recorded in the outcome ledger ({type(error).__name__}): no reconciler "
        f"will find idempotency key {key!r}; keep it and reconcile it yourself"
    )


def ledger_name(ledger: object) -> str:
    """A ledger's ``name`` when it has one, else its type's name (for logs and events)."""
    name = getattr(ledger, "name", None)
    return name if isinstance(name, str) else type(ledger).__name__


class InMemoryOutcomeLedger:
    """A bounded, process-local ledger (tests, single-process services).

    At most ``max_entries`` entries: past it, the oldest resolved entry is evicted, or the
    oldest pending one when none is resolved (logged). Finding it costs O(log n), not a scan:
    a ledger fills up during an outage, when every call records an unknown outcome.
    """

    __slots__ = (
        "_clock",
        "_entries",
        "_lock",
        "_next_seq",
        "_resolved",
        "_seq",
        "dropped_pending",
        "evicted",
        "max_entries",
    )

    def __init__(self, max_entries: int = 10_000, *, clock: Clock | None = None) -> None:
        if not 1 <= max_entries < math.inf:  # (NaN too: memory stays bounded)
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._clock = clock or default_clock()
        self._entries: OrderedDict[str, OutcomeRecord] = OrderedDict()
        # key -> when it was (last) recorded (a counter), and a heap of the resolved ones by
        # that order; entries leave only by eviction.
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._resolved: list[tuple[int, str]] = []
        self.evicted = 0
        """Entries dropped to stay within ``max_entries`` (pending ones are logged)."""
        self.dropped_pending = 0
        """Of those, entries still pending: unknown outcomes nobody can reconcile any more
        (D6). Alarm on it growing, and size ``max_entries`` for an outage's worth of keys."""
        # Blocking dependencies record from many threads; nothing awaits while it is held.
        self._lock = threading.Lock()

    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        with self._lock:
            entries = self._entries
            earlier = entries.get(key)
            if earlier is not None:
                if earlier.state is OutcomeState.PENDING:
                    # Still unknown: the first record stands, but the new attempt is unchecked.
                    if earlier.checks:
                        entries[key] = replace(earlier, checks=0)
                    return
                # Resolved, and a new attempt with the same key is unknown: pending again, at the
                # back of the queue (its heap row goes stale: `_evict_one` checks the order).
                entries.move_to_end(key)
            entries[key] = OutcomeRecord(
                key,
                dependency,
                OutcomeState.PENDING,
                self._clock.now(),
                detail,
                previous=None if earlier is None else earlier.state,
            )
            self._next_seq += 1
            self._seq[key] = self._next_seq
            while len(entries) > self.max_entries:
                self._evict_one()

    def _evict_one(self) -> None:
        entries = self._entries
        victim = None
        while self._resolved:
            seq, key = heapq.heappop(self._resolved)
            found = entries.get(key)
            if (
                found is not None
                and found.state is not OutcomeState.PENDING
                and self._seq[key] == seq
            ):
                victim = key  # (a key set back to pending, or recorded again, is skipped)
                break
        if victim is None:
            victim = next(iter(entries))
        del self._seq[victim]
        record = self._entries.pop(victim)
        self.evicted += 1
        if record.state is OutcomeState.PENDING:
            self.dropped_pending += 1
            _log.warning(
                "outcome ledger full: dropped pending key %r (%s)", victim, record.dependency
            )

    async def resolve(self, key: str, state: OutcomeState) -> None:
        with self._lock:
            record = self._entries.get(key)
            if record is not None:
                self._entries[key] = replace(record, state=state)
                if record.state is OutcomeState.PENDING and state is not OutcomeState.PENDING:
                    resolved = self._resolved
                    heapq.heappush(resolved, (self._seq[key], key))
                    if len(resolved) > 2 * self.max_entries:
                        # Keys resolved, set back to pending and resolved again leave stale
                        # heap rows that only an eviction would pop: rebuild from what is here.
                        resolved[:] = [
                            (self._seq[k], k)
                            for k, r in self._entries.items()
                            if r.state is not OutcomeState.PENDING
                        ]
                        heapq.heapify(resolved)

    async def get(self, key: str) -> OutcomeRecord | None:
        with self._lock:
            return self._entries.get(key)

    async def pending(self, limit: int = 100) -> list[OutcomeRecord]:
        with self._lock:
            out: list[OutcomeRecord] = []
            if limit <= 0:
                return out
            for record in self._entries.values():
                if record.state is OutcomeState.PENDING:
                    out.append(record)
                    if len(out) >= limit:
                        break
            return out

    async def note_check(self, key: str) -> None:
        with self._lock:
            record = self._entries.get(key)
            if record is not None:
                self._entries[key] = replace(record, checks=record.checks + 1)

    def __len__(self) -> int:
        return len(self._entries)


Check = Callable[[OutcomeRecord], Awaitable[OutcomeState]]
"""Ask the dependency what became of a mutation; ``PENDING`` when it cannot tell yet."""


class Reconciler:
    """Resolves pending ledger entries through a user-supplied ``check``.

    ``await reconciler.run_once()`` checks up to ``batch`` pending entries and returns those it
    resolved; ``await reconciler.run(interval)`` repeats until cancelled. A check that raises
    or answers ``PENDING`` leaves the entry pending and counts one attempt; after
    ``max_checks`` inconclusive attempts an entry is left for a human (logged once).
    """

    __slots__ = ("batch", "check", "ledger", "max_checks")

    def __init__(
        self, ledger: OutcomeLedger, check: Check, *, batch: int = 100, max_checks: int = 20
    ) -> None:
        self.ledger = ledger
        self.check = check
        self.batch = batch
        self.max_checks = max_checks

    async def run_once(self) -> list[OutcomeRecord]:
        resolved: list[OutcomeRecord] = []
        for record in await self._checkable():
            try:
                state = await self.check(record)
            except Exception:
                _log.warning("reconcile check for %r failed", record.key, exc_info=True)
                state = OutcomeState.PENDING
            if state is OutcomeState.PENDING:
                await self.ledger.note_check(record.key)
                if record.checks + 1 >= self.max_checks:
                    _log.error(
                        "outcome of %r still unknown after %d checks", record.key, record.checks + 1
                    )
                continue
            await self.ledger.resolve(record.key, state)
            resolved.append(replace(record, state=state))
        return resolved

    async def _checkable(self) -> list[OutcomeRecord]:
        """Up to ``batch`` pending entries still under ``max_checks``, oldest first.

        Entries left for a human stay pending at the head of the ledger; reading past them
        keeps them from starving every newer entry.
        """
        limit = self.batch
        while True:
            records = await self.ledger.pending(limit)
            checkable = [r for r in records if r.checks < self.max_checks]
            if len(checkable) >= self.batch or len(records) < limit:
                return checkable[: self.batch]
            limit *= 2

    async def run(self, interval: float = 5.0) -> None:
        """Reconcile every ``interval`` seconds until cancelled."""
        while True:
            try:
                await self.run_once()
            except Exception:  # the ledger's store blipped: try again next round
                _log.warning("reconciliation round failed", exc_info=True)
            await asyncio.sleep(interval)
