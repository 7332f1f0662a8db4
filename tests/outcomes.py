"""What the edge-path agreement tests share (``test_edge_paths_agree*.py``): an observed
bulkhead whose limit records what it is taught, a degraded mode that is on, and the two
route deadlines the handlers are measured against."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tests.limits import CountingBulkhead

from brownout import DegradedMode, DegradedModes, Stats
from brownout.events import EventHub

SHORT = 0.1
"""The deadline (seconds) of the routes where handlers expire; they would sleep 5 s."""
LONG = 2.0
"""The deadline of every other route: clients that go away do so after 0.2 s."""


# The ways an HTTP handler can end that both edge paths must count alike.
OUTCOMES = [
    "ok",
    "status_500",
    "raises",
    "http_404",
    "rejected",
    "unknown",
    "expires",
    "disconnect",
    "swallows_disconnect",
    "stream",
    "expires_mid_stream",
    "fallback",
]


class RecordingLimit:
    """An adaptive limit that never moves and records what it is taught (dropped or not)."""

    adaptive = True
    limit = 8

    def __init__(self) -> None:
        self.samples: list[bool] = []

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        self.samples.append(dropped)
        return 8


@dataclass
class Observed:
    """One service's admission and what was seen of it."""

    hub: EventHub
    stats: Stats
    bulkhead: CountingBulkhead
    limit: RecordingLimit
    modes: DegradedModes
    recommendations: Callable[[], Awaitable[Any]]
    """Its fallback answers while the ``recs`` mode is on (it always is here)."""
    cancelled: list[str] = field(default_factory=list)

    def seen(self) -> tuple[dict[Any, int], list[bool], list[str]]:
        return dict(self.stats.counters), self.limit.samples, self.cancelled


def observed(name: str, personal: Any, default: Any) -> Observed:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    limit = RecordingLimit()
    bulkhead = CountingBulkhead(name, limit, events=hub)  # type: ignore[arg-type]
    modes = DegradedModes([DegradedMode("recs", "recommendations from a default list")])
    modes.force("recs", on=True)

    @modes.fallback("recs", lambda: default)
    async def recommendations() -> Any:
        return personal

    return Observed(hub, stats, bulkhead, limit, modes, recommendations)
