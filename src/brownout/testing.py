"""Testing a service that uses brownout: virtual time and degradation drills.

`ManualClock` is a clock you move by hand, for tests of timing logic without sleeping.
`drill` forces degraded modes on and fails dependencies, and fails the test when a fallback
calls the dependency it replaces. `KneeServer` and `run_saturated` model a server with a
latency knee on virtual time, to see what a limit converges to.
"""

from ._admission.model import KneeServer, run_saturated
from ._clock import ManualClock
from ._degrade import Drill, DrillFailed, DrillOutage, FallbackCalledFailedDependency, drill

__all__ = [
    "Drill",
    "DrillFailed",
    "DrillOutage",
    "FallbackCalledFailedDependency",
    "KneeServer",
    "ManualClock",
    "drill",
    "run_saturated",
]
