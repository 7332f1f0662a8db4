"""Watch a protected demo front's limit through a flood: where an adaptive limit settles.

Runs the lab's demo system (the same processes and core layout as `brownout lab`): measures
capacity closed loop on an unprotected front, as the lab does, then, on fresh processes in
one protected mode, offers a warm-up at 0.5x and a flood at ``--load`` x capacity, polling the
front's ``/lab/bulkhead`` every 100 ms. Prints the flood's goodput and success latency (as the
lab measures them), the front's and the dependency's CPU share during the flood, the limit's
median and range, and a trace of what the limit believed (short and no-load rtt, probing).

    flock /tmp/brownout-bench.lock .venv/bin/python bench/lab_limit_trace.py adaptive
    flock /tmp/brownout-bench.lock .venv/bin/python bench/lab_limit_trace.py fixed --seconds 8
    flock /tmp/brownout-bench.lock .venv/bin/python bench/lab_limit_trace.py adaptive --hog 10/10

``--hog BUSY/IDLE`` (ms) also runs, during the flood, a process pinned to the front's core that
spins BUSY ms and sleeps IDLE ms in turn: a noisy neighbour taking up to BUSY/(BUSY+IDLE) of the
core in bursts, as a shared machine does. ``--hog-nice -10`` runs it at that nice level (as
root), so that while it spins the front gets little of the core: a host too slow for the flood.

Why it exists: the lab reports one p50 per step; this shows the equilibrium behind it (with 8
dependency slots of 20 ms, each unit of limit above 8 adds about 2.5 ms of queueing at the
dependency to every success).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from brownout._lab.generator import LoadPlan, LoadStep, PlanResult
from brownout._lab.process import GeneratorProcess
from brownout._lab.runner import LabSettings, Target, classes_for, cpu_layout, summarize_step
from brownout._lab.servers import DemoSystem, start_demo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from edge_bench import process_cpu

Polled = list[tuple[float, dict[str, Any], float, float]]
"""(seconds since the poll began, the bulkhead's state, front CPU s, dependency CPU s)."""


_HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
busy, idle, end = float(sys.argv[2]), float(sys.argv[3]), time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    spin_until = time.monotonic() + busy
    while time.monotonic() < spin_until:
        pass
    time.sleep(idle)
"""


@contextlib.contextmanager
def noisy_neighbour(
    spec: str | None, cpus: list[int], seconds: float, nice: int = 0
) -> Iterator[None]:
    """While the block runs, spin BUSY ms / sleep IDLE ms (``spec`` "BUSY/IDLE") on ``cpus``
    at ``nice``."""
    if spec is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    busy, idle = (float(x) / 1000.0 for x in spec.split("/"))
    where = ",".join(map(str, cpus))
    command = [sys.executable, "-c", _HOG, where, str(busy), str(idle), str(seconds)]
    hog = subprocess.Popen(["nice", "-n", str(nice), *command] if nice else command)
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("mode", choices=["adaptive", "fixed"])
    parser.add_argument("--load", type=float, default=10.0, help="multiple of capacity")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the flood")
    parser.add_argument(
        "--hog", default=None, help="BUSY/IDLE ms: a noisy neighbour on the front's core"
    )
    parser.add_argument("--hog-nice", type=int, default=0, help="the neighbour's nice level")
    lab = LabSettings()
    parser.add_argument(
        "--latency",
        type=float,
        default=lab.backend_latency,
        help="the dependency's service time, seconds",
    )
    parser.add_argument(
        "--concurrency", type=int, default=lab.backend_concurrency, help="the dependency's slots"
    )
    args = parser.parse_args()

    gen_cpus, front_cpus, backend_cpus = cpu_layout()
    shape = {"latency": args.latency, "concurrency": args.concurrency}  # the lab's by default
    with GeneratorProcess(gen_cpus) as gen:
        with start_demo(
            "unprotected", backend_cpus=backend_cpus, front_cpus=front_cpus, **shape
        ) as demo:
            port = demo.front.port
            capacity = gen.calibrate(host="127.0.0.1", port=port, path="/api/interactive").capacity
        with (
            start_demo(
                args.mode, backend_cpus=backend_cpus, front_cpus=front_cpus, **shape
            ) as demo,
            noisy_neighbour(args.hog, front_cpus, 3.0 + args.seconds, args.hog_nice),
        ):
            result, polled = flood(gen, demo, capacity, args.load, args.seconds)
    report(args.mode, args.load, args.seconds, capacity, result, polled)
    if args.hog:
        print(
            f"  (a noisy neighbour spun {args.hog} ms busy/idle at nice {args.hog_nice} on the "
            "front's core throughout)"
        )


def flood(
    gen: GeneratorProcess, demo: DemoSystem, capacity: float, load: float, seconds: float
) -> tuple[PlanResult, Polled]:
    """Warm up at 0.5x, then flood at ``load`` x ``capacity``; poll the bulkhead meanwhile."""
    port = demo.front.port
    target = Target("127.0.0.1", port, "")
    mix = (("interactive", 1.0),)
    steps = (
        LoadStep("warm-up", 0.5 * capacity, 2.0, mix, measured=False),
        LoadStep(f"{load:g}x", load * capacity, seconds, mix, settle=1.0),
    )
    plan = LoadPlan(target.host, target.port, classes_for(target), steps, 1.0, seed=1)
    polled: Polled = []
    done = threading.Event()

    def poll() -> None:
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{port}/lab/bulkhead"
        while not done.is_set():
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    state = json.load(r)
            except OSError as e:
                state = {"error": str(e)}
            front = process_cpu(demo.front.proc.pid)
            polled.append((time.monotonic() - t0, state, front, process_cpu(demo.backend.proc.pid)))
            done.wait(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = gen.run(plan)
    finally:
        done.set()
        poller.join()
    return result, polled


def args_every() -> int:
    """Print every Nth poll (``LAB_TRACE_EVERY``, default 5: one line per 0.5 s)."""
    return max(1, int(os.environ.get("LAB_TRACE_EVERY", "5")))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def report(
    mode: str, load: float, seconds: float, capacity: float, result: PlanResult, polled: Polled
) -> None:
    steady = summarize_step(result.steps[-1], load)["steady"]
    print(f"{mode} at {load:g}x of {capacity:.0f} req/s, {seconds:g} s:")
    print(
        f"  goodput {steady['goodput_per_s']} req/s, success p50 {steady['success_p50_ms']} ms, "
        f"p99 {steady['success_p99_ms']} ms, refused {steady['refused']} "
        f"{steady['shed_reasons']}"
    )
    during = [p for p in polled if p[0] >= 3.0]  # past the warm-up and the flood's first second
    if len(during) > 2:
        span = during[-1][0] - during[0][0]
        print(
            f"  CPU share during the flood: front {(during[-1][2] - during[0][2]) / span:.2f}, "
            f"dependency {(during[-1][3] - during[0][3]) / span:.2f} (of one core)"
        )
        limits = [p[1]["limit"] for p in during if "limit" in p[1]]
        if limits:
            print(
                f"  limit during the flood: median {statistics.median(limits):g}, "
                f"min {min(limits)}, max {max(limits)}"
            )
    print("  t(s)  limit in_flight queued short_rtt(ms) no_load_rtt(ms) probing lag_mean/peak(ms)")
    for at, state, _, _ in polled[:: args_every()]:
        if "limit" not in state:
            print(f"  {at:4.1f}  {state}")
            continue
        print(
            f"  {at:4.1f}  {state['limit']:5d} {state['in_flight']:9d} {state['queue_depth']:6d} "
            f"{_ms(state['short_rtt']):>13s} {_ms(state['no_load_rtt']):>15s} "
            f"{state['probing']!s:7s}"
            + (
                f" {_ms(state['loop_lag']['mean'])}/{_ms(state['loop_lag']['peak'])}"
                if "loop_lag" in state
                else ""
            )
        )


if __name__ == "__main__":
    main()
