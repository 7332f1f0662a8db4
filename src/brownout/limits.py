"""Concurrency limits for `brownout.Bulkhead`: how many requests may run at once.

`FixedLimit` is a number you choose; `AIMDLimit`, `Gradient2Limit` and `VegasLimit` find it
from observed latency and drops. `Limit` is the protocol for writing your own;
`LatencyEstimator` predicts a request's wait so a deadline that cannot be met is refused early.
"""

from ._admission.estimator import LatencyEstimator
from ._admission.limits import AIMDLimit, FixedLimit, Gradient2Limit, Limit, VegasLimit

__all__ = ["AIMDLimit", "FixedLimit", "Gradient2Limit", "LatencyEstimator", "Limit", "VegasLimit"]
