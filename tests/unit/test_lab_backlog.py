"""The backlog scenario's figures, from synthetic raw results (no broker): the recovery time,
the accounting, the verdict and the report's table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from brownout._lab.backlog import BacklogSettings, _Run, fresh_recovery, summarize
from brownout._lab.report import backlog_rows, backlog_seconds, markdown, write_report
from brownout._lab.verdict import evaluate, targets

TTL = 3.0


def test_fresh_recovery_waits_for_a_good_suffix() -> None:
    published = {i: 100.0 + i * 0.1 for i in range(100)}  # 10 s after recovery at 100
    # the first 4 s served late, then in time
    done = {i: (5.0 if i < 40 else 0.05) for i in range(100)}
    assert fresh_recovery(published, done, 100.0, 113.0, TTL) == 4.05


def test_fresh_recovery_never_when_the_last_second_is_late() -> None:
    published = {i: 100.0 + i * 0.1 for i in range(100)}
    done = {i: (0.05 if i < 60 else 9.0) for i in range(100)}
    assert fresh_recovery(published, done, 100.0, 113.0, TTL) is None


def test_fresh_recovery_counts_unfinished_messages_as_late() -> None:
    published = {i: 100.0 + i * 0.1 for i in range(100)}
    done = {i: 0.05 for i in range(100) if i % 10}  # every 10th never completed: 90% per second
    assert fresh_recovery(published, done, 100.0, 113.0, TTL) is None


def _raw(run: _Run, lost: int = 0) -> dict[str, Any]:
    start = 1000.0
    published = {
        i: start + i * 0.01 for i in range(int((run.before + run.outage + run.after) * 100))
    }
    recovered = start + run.before + run.outage
    completions, parked, queued = [], [], []
    for seq, at in published.items():
        if seq < lost:
            continue  # in no store at all
        if run.before <= at - start < run.before + run.outage:
            parked.append((seq, "expired", at + TTL))
        elif at >= recovered and seq % 50 == 0:
            queued.append(seq)
        else:
            completions.append((float(seq), at, at + 0.03))
    return {
        "run": run,
        "start": start,
        "published": published,
        "unknown": [],
        "completions": completions,
        "parked": parked,
        "queued": queued,
        "depth": [(0.5, 2), (5.0, 300)],
        "kills": [{"at": 9.5, "held": 4, "restarted_in": 0.3}] * len(run.kills),
    }


def _lab(lost: int = 0) -> dict[str, Any]:
    s = BacklogSettings(before=2, outage=4, after=6, kills=(0.5, 1.5))
    runs = [
        summarize(_raw(_Run("brownout", "brownout", 2, 4, 6)), s),
        summarize(_raw(_Run("brownout-killed", "brownout", 2, 4, 6, s.kills), lost), s),
    ]
    settings = {**s.__dict__, "kills": list(s.kills)}
    return {
        "settings": {"deadline": 1.0},
        "target": None,
        "calibration": None,
        "configurations": [],
        "scenarios": [],
        "runs": [],
        "backlog": {"settings": settings, "runs": runs},
    }


def test_every_message_lands_in_one_class() -> None:
    lab = _lab()
    acc = lab["backlog"]["runs"][0]["accounting"]
    assert acc["published"] == 1200
    assert acc["parked"] == 400
    assert acc["queued"] == 12  # every 50th published after recovery
    assert acc["completed"] + acc["parked"] + acc["queued"] == acc["published"]
    assert acc["lost"] == 0
    assert lab["backlog"]["runs"][0]["parked_by_reason"] == {"expired": 400}
    timeline = lab["backlog"]["runs"][0]["timeline"]
    assert len(timeline) == 12
    assert sum(b["published"] for b in timeline) == 1200


def test_the_verdict_passes_then_fails_on_a_lost_message() -> None:
    checks = evaluate(_lab())
    assert [c["passed"] for c in checks] == [True, True, True]
    assert checks[0]["check"].startswith("fresh messages served within their deadline")
    assert targets(_lab())[0]["configuration"] == "brownout-killed"
    failed = [c for c in evaluate(_lab(lost=3)) if not c["passed"]]
    assert [(c["configuration"], c["value"]) for c in failed] == [("brownout-killed", 3)]


def test_a_killed_run_whose_kills_did_not_happen_fails() -> None:
    lab = _lab()
    lab["backlog"]["runs"][1]["kills"] = lab["backlog"]["runs"][1]["kills"][:1]
    failed = [c for c in evaluate(lab) if not c["passed"]]
    assert [c["configuration"] for c in failed] == ["brownout-killed"]
    assert "1 of 2 SIGKILLs" in failed[0]["check"]


def test_the_report_renders_without_an_http_run(tmp_path: Path) -> None:
    lab = _lab()
    rows = backlog_rows(lab)
    assert [r[0] for r in rows] == ["brownout", "brownout-killed"]
    cols, seconds = backlog_seconds(lab)
    assert cols[0] == "s after recovery"
    assert seconds[0][0] == "-2"
    text = markdown(lab, [], command="brownout lab --scenarios backlog")
    assert "## Backlog after an outage (Redis Streams)" in text
    assert "PASS brownout / backlog" in text
    written = write_report(lab, tmp_path)
    assert (tmp_path / "timeline-backlog.png").exists()
    assert tmp_path / "index.html" in written


def test_a_broker_that_does_not_answer_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from brownout._cli import EXIT_UNREACHABLE, lab_main

    # nothing listens on port 1: the connection is refused at once
    argv = ["--scenarios", "backlog", "--redis", "redis://127.0.0.1:1/0", "--out", str(tmp_path)]
    assert lab_main(argv) == EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert "backlog scenario not measured" in out
    assert "redis://127.0.0.1:1/0 did not answer" in out
    assert lab_main(["--scenarios", "backlog", "--redis", "http://x", "--out", str(tmp_path)]) == 3
    assert "is not a Redis URL" in capsys.readouterr().out
