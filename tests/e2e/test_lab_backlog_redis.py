"""``brownout lab --quick --scenarios backlog`` end to end on the real Redis (issue 26 item 8).

The quick timings (1.5 s deadlines, a 6 s outage) keep it under a minute. It asserts the
scenario's shape: brownout's consumer serves fresh messages within their deadline again
within 5 s of the dependency's recovery while the naive consumer is clearly slower; every
published message is completed, parked or still queued in every run; the killed run's two
SIGKILLs happened and lost nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


def _redis_answers() -> bool:
    async def ping() -> bool:
        client = redis_asyncio.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=2)
        try:
            return bool(await client.ping())
        except Exception:
            return False
        finally:
            await client.aclose()

    return asyncio.run(ping())


@pytest.mark.timeout(150)
def test_backlog_scenario_recovers_and_loses_nothing(tmp_path: Path) -> None:
    if not _redis_answers():
        pytest.fail(
            "Redis at 127.0.0.1:6379 did not answer: start it with "
            "`redis-server --port 6379 --daemonize yes` (7.0 or newer)"
        )
    out = tmp_path / "lab-report"
    # this checkout's brownout, also in the consumer processes the scenario starts
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    argv = ["lab", "--quick", "--scenarios", "backlog", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "brownout._cli", *argv],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("report.json", "index.html", "report.md", "timeline-backlog.png"):
        assert (out / name).stat().st_size > 0, name
    lab = json.loads((out / "report.json").read_text())
    runs = {r["configuration"]: r for r in lab["backlog"]["runs"]}
    assert set(runs) == {"naive", "brownout", "brownout-killed"}
    for name, run in runs.items():
        acc = run["accounting"]
        assert acc["published"] > 0, name
        assert acc["lost"] == 0, (name, acc)
        assert acc["completed"] + acc["parked"] + acc["queued"] == acc["published"], (name, acc)
        assert acc["completed_in_time"] + acc["completed_late"] == acc["completed"], name
    fast = runs["brownout"]["fresh_recovery_s"]
    assert fast is not None and fast <= 5.0, runs["brownout"]
    slow = runs["naive"]["fresh_recovery_s"]
    # the naive consumer works through the stale backlog first: late, or not back in the run
    assert slow is None or slow >= fast + 2.0, (slow, fast)
    assert runs["naive"]["accounting"]["completed_late"] > 0
    assert runs["naive"]["accounting"]["parked"] == 0
    assert runs["brownout"]["accounting"]["completed_late"] == 0
    assert runs["brownout"]["parked_by_reason"].get("expired", 0) > 0
    killed = runs["brownout-killed"]
    assert len(killed["kills"]) == 2, killed["kills"]
    assert all(k["restarted_in"] < 30 for k in killed["kills"])
    # a kill landed mid-handler: the dead process held unacknowledged entries
    assert any(k["held"] > 0 for k in killed["kills"]), killed["kills"]
    checks = "\n".join(line for line in proc.stdout.splitlines() if "backlog" in line)
    assert "PASS brownout-killed / backlog" in checks, checks
