"""Drills (G3): forcing modes on and off, failing dependencies, and catching a fallback that
calls the failed service, even when the application swallows the error."""

from __future__ import annotations

import asyncio

import pytest

from brownout import DegradedMode, DegradedModes, StaleCache, depends_on, fallback_scope
from brownout.events import EventHub
from brownout.testing import (
    DrillFailed,
    DrillOutage,
    FallbackCalledFailedDependency,
    ManualClock,
    drill,
)
from brownout.wire import dependency_call


def registry() -> DegradedModes:
    return DegradedModes(
        [
            DegradedMode(
                "recommendations",
                "hide personalised recommendations",
                enter_at_level=1,
                min_dwell=30,
            )
        ],
        clock=ManualClock(),
        events=EventHub(),
    )


@depends_on("recs-service")
async def personalised(user: str) -> list[str]:
    return [f"for {user}"]


@depends_on("recs-service")
def personalised_sync(user: str) -> list[str]:
    return [f"for {user}"]


async def test_good_fallback_passes_the_drill() -> None:
    modes = registry()

    @modes.fallback("recommendations", lambda user: ["popular"])
    async def recommendations(user: str) -> list[str]:
        return await personalised(user)

    with drill(modes, "recommendations", failed=["recs-service"], require_fallback=True) as d:
        assert modes.active("recommendations")
        assert await recommendations("ann") == ["popular"]
        # The primary path sees the simulated outage.
        with pytest.raises(DrillOutage):
            await personalised("ann")
        with pytest.raises(ConnectionError):  # DrillOutage is a ConnectionError
            personalised_sync("ann")
    assert d.fallbacks_served == {"recommendations": 1}
    assert not modes.active("recommendations")  # released, dwell does not hold a drill
    assert await recommendations("ann") == ["for ann"]


async def test_fallback_calling_the_failed_dependency_fails_the_drill() -> None:
    modes = registry()

    async def bad_fallback(user: str) -> list[str]:
        # "Just the generic recommendations": but from the same failed service.
        return (await personalised("anonymous"))[:1]

    @modes.fallback("recommendations", bad_fallback)
    async def recommendations(user: str) -> list[str]:
        return await personalised(user)

    with (
        pytest.raises(DrillFailed, match="'recommendations' called 'recs-service'"),
        drill(modes, "recommendations", failed=["recs-service"]),
    ):
        with pytest.raises(FallbackCalledFailedDependency):
            await recommendations("ann")


async def test_swallowed_violation_still_fails_the_drill() -> None:
    modes = registry()

    async def sloppy_fallback(user: str) -> list[str]:
        try:
            return await personalised(user)
        except Exception:
            return []

    @modes.fallback("recommendations", sloppy_fallback)
    async def recommendations(user: str) -> list[str]:
        return await personalised(user)

    with pytest.raises(DrillFailed):
        async with drill(modes, "recommendations", failed=["recs-service"]):
            assert await recommendations("ann") == []


async def test_violation_detected_in_tasks_and_cache_loads_spawned_by_the_fallback() -> None:
    modes = registry()
    cache: StaleCache[str, list[str]] = StaleCache(max_entries=10, fresh_for=1, max_staleness=5)

    async def cached_fallback(user: str) -> list[str]:
        # A cache miss inside a fallback loads from the failed service: a real G3 bug.
        value, _ = await cache.get("popular", lambda: personalised("anonymous"))
        return value

    @modes.fallback("recommendations", cached_fallback)
    async def recommendations(user: str) -> list[str]:
        return await personalised(user)

    with pytest.raises(DrillFailed), drill(modes, "recommendations", failed=["recs-service"]):
        await asyncio.gather(recommendations("ann"), return_exceptions=True)


async def test_stale_fallback_warmed_before_the_outage_passes() -> None:
    """Serving stale content is a fallback that does not depend on the failed service: the
    refresh it triggers fails (simulated outage) and the stale value keeps being served."""
    modes = registry()
    cache: StaleCache[str, list[str]] = StaleCache(max_entries=10, fresh_for=0, max_staleness=600)
    await cache.get("popular", lambda: personalised("anonymous"))

    async def stale_fallback(user: str) -> list[str]:
        value, _ = await cache.get("popular", lambda: personalised("anonymous"))
        return value

    @modes.fallback("recommendations", stale_fallback)
    async def recommendations(user: str) -> list[str]:
        return await personalised(user)

    with drill(modes, "recommendations", failed=["recs-service"], require_fallback=True):
        assert await recommendations("ann") == ["for anonymous"]
        await asyncio.sleep(0)
        assert await recommendations("ann") == ["for anonymous"]


def test_require_fallback_catches_a_drill_that_exercised_nothing() -> None:
    modes = registry()
    with (
        pytest.raises(DrillFailed, match="never ran"),
        drill(modes, "recommendations", require_fallback=True),
    ):
        pass


def test_drill_restores_previous_control_and_nests() -> None:
    modes = registry()
    modes.force("recommendations", on=False, trigger="operator")
    with drill(modes, "recommendations", failed=["a"]):
        assert modes.active("recommendations")
        with drill(failed=["b"], outage=lambda name: TimeoutError(name)):
            with pytest.raises(TimeoutError):
                dependency_call("b")
            with pytest.raises(DrillOutage):
                dependency_call("a")
        dependency_call("b")  # no longer failed
    assert modes.forced("recommendations") is False
    assert not modes.active("recommendations")
    dependency_call("a")


def test_drill_validates_modes_up_front() -> None:
    with pytest.raises(KeyError):
        drill(registry(), "nope")
    with pytest.raises(ValueError):
        drill(None, "recommendations")


def test_outside_a_drill_dependency_call_is_free() -> None:
    dependency_call("recs-service")
    assert personalised_sync("ann") == ["for ann"]


async def test_fallback_scope_marks_hand_wired_fallbacks() -> None:
    """A fallback wired outside DegradedModes (an except branch, a breaker's fallback) is
    checked too once marked with fallback_scope."""

    async def handler() -> list[str]:
        try:
            return await personalised("ann")
        except ConnectionError:
            with fallback_scope("recommendations"):
                return await personalised("anonymous")  # the mistake again

    with pytest.raises(DrillFailed, match="'recommendations' called 'recs-service'"):
        async with drill(failed=["recs-service"]):
            await handler()
