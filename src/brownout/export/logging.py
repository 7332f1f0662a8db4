"""Shed logs: one structured record per refusal, sampled, plus a summary per interval (O4).

Operators need to know *who* was shed and why, but a flood of refusals must not become a flood
of log lines (logging is I/O on the request path). `ShedLog` is an event sink that logs each
`RequestShed` to the ``brownout.shed`` logger while a token bucket (on the event clock, i.e.
the loop's time) has tokens, counts the rest as suppressed, and logs one summary record per
interval with the counts: shed by reason, top callers and operations, logged, suppressed and
false positives (S8).

Records carry their fields as attributes (``record.caller``, ``record.reason``, ...) so a JSON
formatter prints them as fields; the message repeats them as ``key=value`` for plain handlers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from .._clock import Clock, default_clock
from .._stats import OTHER, label_value
from ..events import Event, RequestShed

__all__ = ["ShedLog"]

_MAX_TRACKED = 1000  # distinct callers/operations counted per interval before "other"


def _bump(table: dict[str, int], key: str) -> None:
    key = label_value(key)  # a caller named "other" is not the overflow count
    if key in table or len(table) < _MAX_TRACKED:
        table[key] = table.get(key, 0) + 1
    else:
        table[OTHER] = table.get(OTHER, 0) + 1


def _top(table: Mapping[str, int], n: int) -> dict[str, int]:
    return dict(sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:n])


class ShedLog:
    """A sink that logs shed decisions, at most ``rate`` per second (bursts of ``burst``), and
    a summary every ``interval`` seconds in which anything was shed.

    Summaries are written when a shed event arrives after the interval ended, on `flush`, and
    periodically while `run` is running (start it as a task to get summaries after a burst ends).
    """

    accepts_tallies = True
    """Only sheds matter here, and those are always one event each: tallies are ignored."""

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        rate: float = 5.0,
        burst: int = 20,
        interval: float = 10.0,
        level: int = logging.INFO,
        top: int = 5,
        clock: Clock | None = None,
    ) -> None:
        if rate < 0 or burst < 0 or interval <= 0:
            raise ValueError("rate and burst must be >= 0 and interval > 0")
        self.logger = logger if logger is not None else logging.getLogger("brownout.shed")
        self.rate = rate
        self.burst = burst
        self.interval = interval
        self.level = level
        self.top = top
        self._clock = clock if clock is not None else default_clock()
        self._tokens = float(burst)
        self._refilled_at: float | None = None
        self._interval_start: float | None = None
        self._reset_interval()
        self.total_logged = 0
        self.total_suppressed = 0

    def _reset_interval(self) -> None:
        self.shed = 0
        self.logged = 0
        self.suppressed = 0
        self.false_positive = 0
        self.by_reason: dict[str, int] = {}
        self.by_caller: dict[str, int] = {}
        self.by_operation: dict[str, int] = {}

    def emit(self, event: Event) -> None:
        if not isinstance(event, RequestShed):
            return
        now = event.at
        if self._interval_start is None:
            self._interval_start = now
        elif now - self._interval_start >= self.interval:
            self.flush(now)
            self._interval_start = now
        self.shed += 1
        _bump(self.by_reason, event.reason.value)
        _bump(self.by_caller, event.caller)
        _bump(self.by_operation, event.operation)
        if event.false_positive:
            self.false_positive += 1
        if self._take(now):
            self.logged += 1
            self.total_logged += 1
            self._log_one(event)
        else:
            self.suppressed += 1
            self.total_suppressed += 1

    def _take(self, now: float) -> bool:
        if self._refilled_at is not None:
            self._tokens = min(
                float(self.burst), self._tokens + (now - self._refilled_at) * self.rate
            )
        self._refilled_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _log_one(self, e: RequestShed) -> None:
        if not self.logger.isEnabledFor(self.level):
            return
        remaining = None if e.remaining is None else round(e.remaining, 6)
        fields: dict[str, Any] = {
            "event": "shed",
            "caller": e.caller,
            "operation": e.operation,
            "priority": e.priority.label,
            "reason": e.reason.value,
            "remaining": remaining,
            "queue_wait": round(e.queue_wait, 6),
            "source": e.source,
            "false_positive": e.false_positive,
        }
        self.logger.log(
            self.level,
            "shed caller=%s operation=%s priority=%s reason=%s remaining=%s queue_wait=%.3f "
            "source=%s false_positive=%s",
            e.caller,
            e.operation,
            fields["priority"],
            fields["reason"],
            "none" if remaining is None else f"{remaining:.3f}",
            e.queue_wait,
            e.source,
            e.false_positive,
            extra=fields,
        )

    def flush(self, now: float | None = None) -> None:
        """Write the summary of the current interval (if anything was shed) and start a new one."""
        if now is None:
            now = self._clock.now()
        if self.shed:
            start = self._interval_start if self._interval_start is not None else now
            fields: dict[str, Any] = {
                "event": "shed_summary",
                "interval": round(max(0.0, now - start), 3),
                "shed": self.shed,
                "logged": self.logged,
                "suppressed": self.suppressed,
                "false_positive": self.false_positive,
                "by_reason": dict(self.by_reason),
                "top_callers": _top(self.by_caller, self.top),
                "top_operations": _top(self.by_operation, self.top),
            }
            # Any false positive is a bug worth a warning (S8).
            level = logging.WARNING if self.false_positive else self.level
            self.logger.log(
                level,
                "shed summary: %d shed in %.1fs (%d logged, %d suppressed, %d false positive) "
                "by reason %s; top callers %s; top operations %s",
                self.shed,
                fields["interval"],
                self.logged,
                self.suppressed,
                self.false_positive,
                fields["by_reason"],
                fields["top_callers"],
                fields["top_operations"],
                extra=fields,
            )
        self._reset_interval()
        self._interval_start = None

    async def run(self) -> None:
        """Flush every ``interval`` seconds on the loop's timers, until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                if self._interval_start is not None:
                    self.flush()
        finally:
            self.flush()
