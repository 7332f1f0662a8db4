"""The gRPC client's timeout against grpc core's rounding of ``grpc-timeout`` (D1).

grpc core writes a call's timeout rounded *up* (``Timeout::FromMillis`` / ``FromSeconds``):
milliseconds below 1 s, 10 ms below 10 s, 100 ms below 100 s, whole seconds below 1,000 s
(whole minutes when that is exact), 10 s below 10,000 s. ``grpc_sends`` models that rule; the
interceptor's `_wire_timeout` must hand grpc a timeout that, so rounded, is never more than
the budget, and costs the callee at most about one rounding step. The loopback test
``tests/integration/test_grpc_client.py::test_the_callee_never_gets_more_time_than_the_caller_has``
checks the same against grpcio itself.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from brownout.integrations.grpc_client import _wire_timeout


def _up(value: int, step: int) -> int:
    return -(-value // step) * step


def grpc_sends(timeout: float) -> float:
    """The seconds grpc core writes for ``timeout`` (its rule up to 10,000 s)."""
    millis = math.ceil(timeout * 1000)
    if millis <= 0:
        return 1e-9
    if millis < 1000:
        return millis / 1000
    if millis < 10_000 and _up(millis, 10) % 1000:
        return _up(millis, 10) / 1000
    if 10_000 <= millis < 100_000 and _up(millis, 100) % 1000:
        return _up(millis, 100) / 1000
    seconds = math.ceil(millis / 1000)
    if seconds < 1000:
        return seconds  # (whole minutes, when exact, are the same value)
    if seconds < 10_000:
        tens = _up(seconds, 10)
        return tens if tens % 60 else _up(seconds, 60)
    raise AssertionError("beyond the modelled range")


def test_the_model_matches_what_grpcio_was_seen_to_send() -> None:
    # Seen on loopback with grpcio 1.85 (server's time_remaining(), less the trip).
    assert grpc_sends(1.0) == 1.0 and grpc_sends(1.0001) == 1.01
    assert grpc_sends(12.3456) == 12.4
    assert grpc_sends(60.0001) == 60.1
    assert grpc_sends(100.5) == 101
    assert grpc_sends(1000.5) == 1010


@given(st.floats(min_value=0.002, max_value=9_000.0))
def test_the_wire_timeout_never_arrives_longer_than_the_budget(budget: float) -> None:
    # (Below 2 ms grpc's own millisecond cannot be beaten; such calls are refused as too
    # short by any `Dependency` with a ``min_useful``.)
    sent = _wire_timeout(budget)
    assert 0 < sent < budget
    arrives = grpc_sends(sent)
    assert arrives <= budget
    # The callee loses at most about one rounding step (a hundredth of the budget) and 2 ms.
    assert arrives >= budget - budget / 50 - 0.002 or budget < 0.004
