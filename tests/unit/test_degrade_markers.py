"""Context markers of the degradation pieces (`brownout._degrade.markers`): bounded memory."""

from __future__ import annotations

import asyncio

from brownout._degrade.markers import note_fallback_served, served_by_fallback


async def test_bounded_fallback_marks_hold_each_mode_once() -> None:
    """The edge gives each request a list of the modes whose fallback answered. A task the
    handler spawns inherits that list with its context and may outlive the request, serving
    fallbacks for hours: the list holds each mode once, not once per fallback served."""
    marks: list[str] = []
    token = served_by_fallback.set(marks)

    async def background_worker() -> None:
        for i in range(100_000):
            note_fallback_served(("cached-prices", "no-recommendations", "breaker:db")[i % 3])

    try:
        await asyncio.create_task(background_worker())
    finally:
        served_by_fallback.reset(token)
    assert marks == ["cached-prices", "no-recommendations", "breaker:db"]
