"""Where the adaptive limits settle against the knee model (docs/admission.md's table).

A server whose latency grows linearly past its knee (`brownout._admission.model.KneeServer`,
+/-20% service-time noise), driven at saturation for 60 virtual seconds: 20 s normal, 20 s
at 4x the service time, 20 s normal again. Prints, per knee and algorithm, the range of
``limit / knee`` over the last 10 s of each phase (probe periods left out), across three
seeds. Deterministic: virtual time, seeded, no sleeping; the same command prints the same
table on any machine.

    .venv/bin/python bench/limits_model.py
"""

from __future__ import annotations

import random

from brownout.limits import AIMDLimit, Gradient2Limit, Limit, VegasLimit
from brownout.testing import KneeServer, run_saturated

KNEES = (10, 20, 100, 500)
SEEDS = (0, 1, 2)
PHASES = ((10.0, 20.0), (30.0, 40.0), (50.0, 60.0))


def make(name: str, knee: int, seed: int) -> tuple[Limit, KneeServer]:
    rng = random.Random(seed)
    if name == "AIMD":
        server = KneeServer(knee, 0.02, noise=0.2, max_queue=max(1, knee // 10), seed=seed)
        return AIMDLimit(), server
    server = KneeServer(knee, 0.02, noise=0.2, seed=seed)
    if name == "Gradient2":
        return Gradient2Limit(rng=rng), server
    return VegasLimit(rng=rng), server


def settles(name: str, knee: int) -> tuple[float, float]:
    low, high = float("inf"), 0.0
    for seed in SEEDS:
        limit, server = make(name, knee, seed)
        trace = run_saturated(limit, server, 60.0, slowdowns=((20.0, 4.0), (40.0, 1.0)))
        for start, end in PHASES:
            window = trace.window(start, end)
            low = min(low, min(window) / knee)
            high = max(high, max(window) / knee)
    return low, high


def main() -> None:
    names = ("AIMD", "Gradient2", "Vegas")
    print("| knee | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for knee in KNEES:
        cells = [f"{lo:.2f}-{hi:.2f}x" for lo, hi in (settles(n, knee) for n in names)]
        print(f"| {knee} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
