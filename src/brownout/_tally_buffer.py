"""`Ledger`: routine per-request decisions counted by the component that made them (O1).

Building and dispatching an event costs more than a bulkhead's whole admit and release. So when
every sink on a hub accepts tallies (`EventHub.tallying`), a bulkhead counts the routine
outcomes (offered, admitted without waiting, completed within or after the deadline) in its
ledger: a dict lookup at admission and integer increments, no event objects, no sink calls. The
ledger turns the counts into one `RequestsTallied` event:

- when a reader asks (`EventHub.flush`, which `Stats` calls before every read, so a scrape
  always sees every request that has finished);
- when it holds ``max_rows`` rows (distinct operation, priority and caller), after which
  rows no permit still uses are dropped, so memory stays bounded however many callers come;
- at most every ``flush_interval`` seconds while traffic flows (for sinks that never read,
  such as an OpenTelemetry histogram sink);
- after its bulkhead is discarded: the hub adopts the ledger until its next flush
  (`EventHub.adopt`), so nothing counted is lost.

Counters are cumulative and a flush emits the difference from the previous flush, so a flush
from another thread (a Prometheus HTTP server thread) never loses an increment made
concurrently on the loop: it is counted by the next flush. Latency and remaining-deadline
samples are taken from the front of their lists at flush, never swapped out: a releasing
thread may hold the list while another thread flushes, and its sample lands in the next flush.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypeVar

from ._priority import Priority
from ._snapshot import items_of
from .events import EventHub, RequestsTallied, TallyRow

if TYPE_CHECKING:
    from ._clock import Clock

__all__ = [
    "ADMITTED",
    "COMPLETED",
    "FAST",
    "LATE",
    "MAX_SAMPLES",
    "OFFERED",
    "OTHER",
    "WAITED",
    "Index",
    "Ledger",
    "held",
]

FAST, OFFERED, ADMITTED, COMPLETED, LATE, WAITED, OTHER = 0, 1, 2, 3, 4, 5, 6
"""Row columns. ``FAST``: offered and admitted at once on a bulkhead's fast path (one
increment where the others take two); ``OFFERED`` and ``ADMITTED`` (without waiting): the same
on the full path; ``COMPLETED`` within the deadline, ``LATE`` after it. ``WAITED`` (admitted
after queueing) and ``OTHER`` (settled otherwise: failed, dropped, cancelled) are reported as
events; they are counted here only so `held` needs no increment of its own on the fast path."""
_COUNTED = 5  # FAST .. LATE are emitted; their values at the last flush follow the row
_BASE = OTHER + 1
_ROW_LEN = _BASE + _COUNTED
MAX_SAMPLES = 4096
"""Latency or remaining-deadline samples held before a flush."""

T = TypeVar("T")

_BY_VALUE = tuple(sorted(Priority))
_PRIORITIES = len(_BY_VALUE)

Index = dict[str, dict[str, list[list[int] | None]]]
"""caller -> operation -> a row per priority (None until used). Nested rather than keyed by a
tuple: on the admission path, three subscripts are cheaper than a tuple's build, hash and
lookup."""


def _take(samples: list[T]) -> list[T]:
    """The samples appended so far, removed from the front of ``samples``: one appended
    concurrently (after the length is read) stays for the next flush."""
    n = len(samples)
    taken = samples[:n]
    del samples[:n]
    return taken


def held(row: list[int]) -> int:
    """How many permits hold this row now (admitted and not yet settled)."""
    return row[FAST] + row[ADMITTED] + row[WAITED] - row[COMPLETED] - row[LATE] - row[OTHER]


class Ledger:
    """Counts for one emitter (``source``), emitted on ``hub`` as `RequestsTallied`."""

    __slots__ = (
        "__weakref__",
        "_clock",
        "_hub",
        "_lock",
        "flush_interval",
        "index",
        "latencies",
        "max_rows",
        "next_flush",
        "remaining",
        "row_count",
        "source",
    )

    def __init__(
        self,
        source: str,
        hub: EventHub,
        clock: Clock,
        *,
        max_rows: int = 1024,
        flush_interval: float = 1.0,
    ) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.source = source
        self._hub = hub
        self._clock = clock
        self.max_rows = max_rows
        self.flush_interval = flush_interval
        self.index: Index = {}
        self.row_count = 0
        self.latencies: list[tuple[str, Priority, float]] = []
        self.remaining: list[float] = []
        self.next_flush = clock.now() + flush_interval
        self._lock = threading.Lock()
        hub.register_ledger(self)

    def row(self, operation: str, priority: Priority, caller: str) -> list[int]:
        """The row for this key, made (and the table kept bounded) if new.

        Emitters look rows up with ``ledger.index[caller][operation][priority]`` first (the
        fast path) and call this when that fails or gives None.
        """
        by_priority = self.index.get(caller, {}).get(operation)
        row = by_priority[priority] if by_priority is not None else None
        if row is not None:
            return row
        if self.row_count >= self.max_rows:
            self._compact()
        by_priority = self.index.setdefault(caller, {}).setdefault(operation, [None] * _PRIORITIES)
        row = by_priority[priority] = [0] * _ROW_LEN
        self.row_count += 1
        return row

    def _rows(self) -> list[tuple[str, Priority, str, list[int]]]:
        out = []
        for caller, by_operation in items_of(self.index):
            for operation, by_priority in items_of(by_operation):
                for priority, row in zip(_BY_VALUE, list(by_priority)):
                    if row is not None:
                        out.append((operation, priority, caller, row))
        return out

    def sample_remaining(self, seconds: float) -> None:
        remaining = self.remaining
        remaining.append(seconds)
        if len(remaining) >= MAX_SAMPLES:
            self.flush()

    def flush(self, now: float | None = None) -> None:
        """Emit everything counted since the last flush as one `RequestsTallied`."""
        with self._lock:
            if now is None:
                now = self._clock.now()
            self.next_flush = now + self.flush_interval
            rows: list[TallyRow] = []
            for operation, priority, caller, row in self._rows():
                # Read each count once: an increment racing this flush lands in the next one.
                now_counts = row[:_COUNTED]
                last = row[_BASE:]
                if now_counts != last:
                    fast, offered, admitted, completed, late = (
                        a - b for a, b in zip(now_counts, last)
                    )
                    row[_BASE:] = now_counts
                    rows.append(
                        (
                            operation,
                            priority,
                            caller,
                            fast + offered,
                            fast + admitted,
                            completed,
                            late,
                        )
                    )
            latencies = _take(self.latencies)
            remaining = _take(self.remaining)
            if not (rows or latencies or remaining):
                return
            event = RequestsTallied(
                now, self.source, tuple(rows), tuple(latencies), tuple(remaining)
            )
        self._hub.emit(event)

    def _compact(self) -> None:
        """Flush, then forget rows no permit holds (a held row is still written to)."""
        self.flush()
        with self._lock:
            index: Index = {}
            kept = 0
            for operation, priority, caller, row in self._rows():
                if held(row) > 0:
                    by_priority = index.setdefault(caller, {}).setdefault(
                        operation, [None] * _PRIORITIES
                    )
                    by_priority[priority] = row
                    kept += 1
            # In place: emitters hold this dict (`Bulkhead` looks rows up through it).
            self.index.clear()
            self.index.update(index)
            self.row_count = kept

    def __repr__(self) -> str:
        return f"<Ledger {self.source} rows={self.row_count}>"
