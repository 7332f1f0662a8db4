"""The fleet limit's crash test (B3): 8 processes x 200 tasks, killed and restarted at random.

Each worker process (tests/integration/fleet_worker.py) runs 200 asyncio tasks that acquire a
lease of the shared limit, act for a few milliseconds (sometimes far longer than the lease,
cut at its expiry), and release. Every few hundred milliseconds one process is killed with
SIGKILL, mid-lease, and a new one started. Independent check, offline: every action's interval
(from after ``lease.check()`` to its end, or to its lease's local expiry for a killed process)
is recorded on the machine's monotonic clock, and at no instant do more than ``limit`` of them
overlap. The run also has to reach the limit and see refusals, or it proves nothing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tests import services

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROCESSES, TASKS, LIMIT, LEASE = 8, 200, 40, 0.5
RUN_SECONDS = 12.0


def _start(i: int, prefix: str, out_dir: Path, generation: int) -> subprocess.Popen[bytes]:
    out = out_dir / f"worker-{i}-{generation}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    args = [str(services.REDIS.port), prefix, str(LIMIT), str(TASKS), str(LEASE), str(out)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.fleet_worker", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _max_overlap(out_dir: Path) -> tuple[int, int, int]:
    """(most actions overlapping at one instant, actions, actions cut by a kill)."""
    starts: dict[tuple[str, str], tuple[float, float]] = {}
    ends: dict[tuple[str, str], float] = {}
    for log in out_dir.glob("worker-*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "S":
                starts[(log.name, parts[1])] = (float(parts[2]), float(parts[3]))
            elif len(parts) == 3 and parts[0] == "E":
                ends[(log.name, parts[1])] = float(parts[2])
    points: list[tuple[float, int]] = []
    cut = 0
    for key, (start, bound) in starts.items():
        end = ends.get(key)
        if end is None:
            cut += 1
            end = bound  # killed while acting: it could have acted until its lease expired
        points.append((start, 1))
        points.append((end, -1))
    points.sort(key=lambda p: (p[0], p[1]))  # an end at the same instant frees first
    now = peak = 0
    for _, step in points:
        now += step
        peak = max(peak, now)
    return peak, len(starts), cut


def test_the_fleet_never_holds_more_than_the_limit_through_crashes(
    redis_server: services.Service, tmp_path: Path
) -> None:
    prefix = f"bfl-crash:{uuid.uuid4().hex[:12]}:"
    rng = random.Random()
    procs = {i: _start(i, prefix, tmp_path, 0) for i in range(PROCESSES)}
    kills = 0
    try:
        stop = time.monotonic() + RUN_SECONDS
        while time.monotonic() < stop:
            time.sleep(rng.uniform(0.3, 0.8))
            victim = rng.randrange(PROCESSES)
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(5)
            kills += 1
            procs[victim] = _start(victim, prefix, tmp_path, kills)
        for p in procs.values():
            assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGKILL)
            p.wait(5)
        import redis

        c = redis.Redis(host=services.REDIS.host, port=services.REDIS.port)
        c.delete(f"{{{prefix}crash}}:leases", f"{{{prefix}crash}}:fence")
        c.close()
    peak, actions, cut = _max_overlap(tmp_path)
    print(f"kills={kills} actions={actions} cut={cut} peak={peak} limit={LIMIT}")
    assert kills >= 10
    assert cut > 0, "no process was killed while acting"
    assert actions > 300, actions
    assert peak <= LIMIT, f"{peak} actions overlapped under a limit of {LIMIT}"
    assert peak >= LIMIT * 3 // 4, f"the run never came near the limit (peak {peak})"
