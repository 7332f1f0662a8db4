"""pytest fixtures for testing a service's overload behaviour (`brownout.testing`).

Registered through the ``pytest11`` entry point, so installing brownout makes them available;
``-p no:brownout`` turns them off. Fixtures only, no hooks: a session that uses none of them
runs as without the plugin. It imports pytest and brownout's standard-library core, nothing
else.

- ``brownout_time``: a `brownout.testing.VirtualTime` (a manual clock and deadlines on it);
- ``brownout_clock``: its `brownout.testing.ManualClock`;
- ``brownout_events``: a `brownout.testing.EventRecorder` on `brownout.events.hub`,
  unsubscribed at teardown;
- ``brownout_force``: a `brownout.testing.Forcing`; what it forced is restored at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._clock import ManualClock
from .._testkit import EventRecorder, Forcing, VirtualTime

__all__ = ["brownout_clock", "brownout_events", "brownout_force", "brownout_time"]


@pytest.fixture
def brownout_time() -> VirtualTime:
    """Virtual time: ``advance`` it, and run code under ``with brownout_time.deadline(0.2)``."""
    return VirtualTime()


@pytest.fixture
def brownout_clock(brownout_time: VirtualTime) -> ManualClock:
    """The manual clock of ``brownout_time``: pass it as ``clock=`` to what you test."""
    return brownout_time.clock


@pytest.fixture
def brownout_events() -> Iterator[EventRecorder]:
    """Every event on brownout's hub during the test: ``assert_shed``, ``shed``, ..."""
    with EventRecorder() as recorder:
        yield recorder


@pytest.fixture
def brownout_force() -> Iterator[Forcing]:
    """``brownout_force.full(bulkhead)`` and ``.mode(modes, "name")``, undone at teardown."""
    forcing = Forcing()
    try:
        yield forcing
    finally:
        forcing.restore()
