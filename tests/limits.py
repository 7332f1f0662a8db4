"""Test doubles around admission (a `brownout._admission.Limit`, a counting `Bulkhead`) shared
by several test modules."""

from __future__ import annotations

from typing import Any

from brownout import Bulkhead, Permit
from brownout._admission.permit import Untracked


class CountingBulkhead(Bulkhead):
    """A real bulkhead that also counts how many admissions took an edge's express path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.express = 0

    def admit_uncontended(self, *args: Any) -> Permit | Untracked | None:
        admitted = super().admit_uncontended(*args)
        if admitted is not None:
            self.express += 1
        return admitted


class SpyLimit:
    """An adaptive limit that never moves and records every rtt it is taught."""

    adaptive = True
    limit = 8

    def __init__(self) -> None:
        self.samples: list[float] = []

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        self.samples.append(rtt)
        return 8
