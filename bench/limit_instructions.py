"""What an adaptive limit costs per request, in instructions (callgrind), not seconds.

A limit learns from every finished request (`Limit.on_sample`), and a `Bulkhead` with an
adaptive limit times every request and feeds its estimator and queue too. This counts the
instructions per sample of each limit on recorded sample streams, and per admit + release of
the `ThreadBulkhead` the gunicorn docs recommend (`worker_limit`) against a `FixedLimit`.
Each workload runs twice under ``valgrind --tool=callgrind``, with 0 and with N samples
after the same set-up, so start-up and the recording cancel. Deterministic: seeded streams,
virtual time.

    flock /tmp/brownout-bench.lock .venv/bin/python bench/limit_instructions.py          # all
    flock /tmp/brownout-bench.lock .venv/bin/python bench/limit_instructions.py release  # one

Workloads:

- ``idle-gradient2``: `worker_limit(threads=16)`'s `Gradient2Limit` (limit 6) fed one request
  at a time (app-limited, as the in-process WSGI bench drives it), rtt 50 us +/- 20%;
- ``knee-gradient2``, ``knee-vegas``, ``knee-aimd``: each limit's own samples at saturation
  against the knee model (`run_saturated`, knee 20, 20 ms, +/-20% noise, a 4x slowdown
  half-way), recorded once and replayed on a fresh limit;
- ``release-gradient2``, ``release-fixed``: `ThreadBulkhead.admit_uncontended` + `success`
  on a `ManualClock` (50 us +/- 20% per request), with `worker_limit` or `FixedLimit(6)`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from brownout import Priority, ThreadBulkhead
from brownout.integrations.gunicorn import worker_limit
from brownout.limits import AIMDLimit, FixedLimit, Gradient2Limit, Limit, VegasLimit
from brownout.testing import KneeServer, ManualClock, run_saturated

N = 20_000
Sample = tuple[float, float, int, bool]


def _idle_stream(n: int) -> list[Sample]:
    rng = random.Random(0)
    t = 0.0
    out: list[Sample] = []
    for _ in range(n):
        rtt = 50e-6 * rng.uniform(0.8, 1.2)
        out.append((t, rtt, 1, False))
        t += rtt + 5e-6
    return out


class _Recorder:
    """A limit that records the samples it is fed (the knee model's closed loop)."""

    def __init__(self, inner: Limit) -> None:
        self.inner = inner
        self.samples: list[Sample] = []

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def adaptive(self) -> bool:
        return True

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        self.samples.append((start_time, rtt, in_flight, dropped))
        return self.inner.on_sample(start_time, rtt, in_flight, dropped)


def _knee_stream(make: Callable[[], Limit], n: int) -> list[Sample]:
    recorder = _Recorder(make())
    server = KneeServer(20, 0.02, noise=0.2, max_queue=2, seed=0)
    run_saturated(recorder, server, 60.0, slowdowns=((30.0, 4.0),))
    assert len(recorder.samples) >= n, len(recorder.samples)
    return recorder.samples[:n]


LIMITS: dict[str, Callable[[], Limit]] = {
    "gradient2": lambda: Gradient2Limit(rng=random.Random(1)),
    "vegas": lambda: VegasLimit(rng=random.Random(1)),
    "aimd": AIMDLimit,
}


def _replay(make: Callable[[], Limit], stream: list[Sample], n: int) -> None:
    on_sample = make().on_sample
    for start, rtt, in_flight, dropped in stream[:n]:
        on_sample(start, rtt, in_flight, dropped)


def _release(limit: Limit, n: int) -> None:
    clock = ManualClock()
    bulkhead = ThreadBulkhead("bench", limit, clock=clock)
    rng = random.Random(0)
    rtts = [50e-6 * rng.uniform(0.8, 1.2) for _ in range(N)]
    admit = bulkhead.admit_uncontended
    normal = Priority.CRITICAL
    for rtt in rtts[:n]:
        p = admit(normal, "", "GET /hello", clock.now(), 30.0)
        assert p is not None
        clock.advance(rtt)
        p.success()


def _child(workload: str, n: int) -> None:
    kind, _, name = workload.partition("-")
    if kind == "idle":
        stream = _idle_stream(N)
        _replay(lambda: worker_limit(threads=16, initial=6), stream, n)
    elif kind == "knee":
        make = LIMITS[name]
        _replay(make, _knee_stream(make, N), n)
    elif name == "fixed":
        _release(FixedLimit(6), n)
    else:
        _release(worker_limit(threads=16, initial=6), n)


def _instructions(workload: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                workload,
                str(n),
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


WORKLOADS = (
    "idle-gradient2",
    "knee-gradient2",
    "knee-vegas",
    "knee-aimd",
    "release-gradient2",
    "release-fixed",
)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], int(sys.argv[3]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    chosen = [w for w in WORKLOADS if not sys.argv[1:] or any(a in w for a in sys.argv[1:])]
    for workload in chosen:
        per = (_instructions(workload, N) - _instructions(workload, 0)) / N
        print(f"{workload:18} {per:9,.0f} instructions per sample ({N:,} samples)", flush=True)


if __name__ == "__main__":
    main()
