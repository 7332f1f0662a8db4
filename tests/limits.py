"""Test doubles for `brownout.admission.Limit` shared by several test modules."""

from __future__ import annotations


class SpyLimit:
    """An adaptive limit that never moves and records every rtt it is taught."""

    adaptive = True
    limit = 8

    def __init__(self) -> None:
        self.samples: list[float] = []

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        self.samples.append(rtt)
        return 8
