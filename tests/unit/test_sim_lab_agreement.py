"""The simulator against the lab: the ramp, simulated, gives the measured goodput per step.

The lab's figures are run 1 of docs/lab.md (2026-12-02, commit c66d376): the demo's front
with brownout's ``FixedLimit(10)`` and ``Gradient2Limit()`` configurations, goodput per
second over each step's last 2 s. examples/sim/lab_ramp.toml is the same system: the
demo's measured capacity (197.8 req/s) and service time (41.0 ms), the front's bulkhead as
src/brownout/_lab/protect.py configures it, the generator's constant arrivals.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from brownout.sim import loads, simulate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim" / "lab_ramp.toml"
STEPS = (0.5, 0.8, 1.0, 2.0, 4.0, 10.0)
LAB_GOODPUT = {
    "fixed": (99.0, 158.0, 198.0, 198.0, 200.0, 198.0),
    "adaptive": (99.0, 158.0, 198.0, 196.0, 194.0, 200.0),
}
FIXED_BULKHEAD = (
    'bulkhead = { limit = 10, queue = { kind = "fifo", max_size = 10, max_wait = 0.1 } }'
)
ADAPTIVE_BULKHEAD = 'bulkhead = { limit = { kind = "gradient2" } }'  # its default queue


@pytest.mark.parametrize("configuration", ["fixed", "adaptive"])
def test_each_ramp_step_is_within_ten_percent_of_the_lab(configuration: str) -> None:
    text = EXAMPLE.read_text()
    assert FIXED_BULKHEAD in text
    if configuration == "adaptive":
        text = text.replace(FIXED_BULKHEAD, ADAPTIVE_BULKHEAD)
    result = simulate(loads(text))
    for i, (step, lab) in enumerate(zip(STEPS, LAB_GOODPUT[configuration], strict=True)):
        simulated = result.metric("clients", "completed", 3.0 * i + 1.0, 3.0 * i + 3.0)
        assert abs(simulated - lab) <= 0.1 * lab, (step, simulated, lab)
    if configuration == "fixed":
        assert result.passed  # the file's own invariants: the same bounds
