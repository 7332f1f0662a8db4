"""Testing a service that uses brownout: virtual time and degradation drills.

`ManualClock` is a clock you move by hand, for tests of timing logic without sleeping.
`drill` forces degraded modes on and fails dependencies, and fails the test when a fallback
calls the dependency it replaces. `KneeServer` and `run_saturated` model a server with a
latency knee on virtual time, to see what a limit converges to.

For a service's own tests: `VirtualTime` runs code under a deadline on a `ManualClock`,
`EventRecorder` keeps the hub's events and asserts on what was shed and why, `forced_full`
and `forced_mode` hold a bulkhead full or a degraded mode on for a block (`Forcing` until a
test ends). The pytest plugin `brownout.integrations.pytest_plugin` (loaded when brownout is
installed) offers them as fixtures: ``brownout_time``, ``brownout_clock``,
``brownout_events``, ``brownout_force``.
"""

from ._admission.model import KneeServer, run_saturated
from ._clock import ManualClock
from ._degrade import Drill, DrillFailed, DrillOutage, FallbackCalledFailedDependency, drill
from ._testkit import EventRecorder, Forcing, VirtualTime, forced_full, forced_mode

__all__ = [
    "Drill",
    "DrillFailed",
    "DrillOutage",
    "EventRecorder",
    "FallbackCalledFailedDependency",
    "Forcing",
    "KneeServer",
    "ManualClock",
    "VirtualTime",
    "drill",
    "forced_full",
    "forced_mode",
    "run_saturated",
]
