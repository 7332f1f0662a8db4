"""``brownout lab --quick --scenarios database`` end to end on the real PostgreSQL (issue 29
item 5).

The quick timings (4 s before, 6 s slowed, 6 s after, per configuration) keep it under a
minute. It asserts the invariants hold for brownout (the lab's exit status and its verdict
lines), the report carries the table and the plot, and the unprotected front shows what the
scenario is about: queries left running on the server for callers who gave up, and a pool
wait far past the brownout pool's bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests import services

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(150)
def test_database_scenario_holds_its_invariants(
    tmp_path: Path, postgres_server: services.Service
) -> None:
    out = tmp_path / "lab-report"
    # this checkout's brownout, also in the front processes the scenario starts
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    dsn = f"postgresql://postgres@{postgres_server.address}/test"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "brownout",
            "lab",
            "--quick",
            "--scenarios",
            "database",
            "--postgres",
            dsn,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("report.json", "index.html", "report.md", "timeline-database.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "## Slow database (front -> PostgreSQL pool)" in report
    assert "| configuration | goodput/s before |" in report
    lab = json.loads((out / "report.json").read_text())
    runs = {r["configuration"]: r for r in lab["database"]["runs"]}
    assert set(runs) == {"unprotected", "brownout"}
    ours, plain = runs["brownout"], runs["unprotected"]
    assert ours["overrun_max"] <= 1.0 and ours["gone_max"] <= plain["gone_max"]
    assert ours["refused"].get("queue_timeout", 0) > 0  # the pool refused, in its vocabulary
    # the unprotected front: queries running for callers gone, a pool wait without a bound
    assert plain["gone_max"] > 0 and plain["overrun_max"] > 1.0, plain["samples"]
    assert plain["pool_wait_max_ms"] > 1000, plain["pool_wait_max_ms"]
    verdict = [line for line in proc.stdout.splitlines() if "/ database /" in line]
    assert len(verdict) == 4 and all(line.startswith("PASS") for line in verdict), verdict
