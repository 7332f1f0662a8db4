"""The payments scenario's verdict and report from synthetic results (no servers), and the
message when PostgreSQL does not answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from brownout._lab.payments import PaymentsSettings, chain_key, payments_rows
from brownout._lab.report import markdown, write_report
from brownout._lab.verdict import evaluate
from brownout.wire import bind_idempotency_key


def _run(config: str, **kw: int) -> dict[str, Any]:
    run = {
        "configuration": config,
        "scenario": "payments",
        "requested": 400,
        "applied_once": 400,
        "duplicates": 0,
        "extra_rows": 0,
        "not_applied": 0,
        "unknown_recorded": 30,
        "reconciled_applied": 30,
        "reconciled_not_applied": 0,
        "pending_after": 0,
        "replays": 80,
        "client": {},
        "seconds": 25.0,
    }
    return {**run, **kw}


def _lab(*runs: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "settings": {},
        "target": None,
        "calibration": None,
        "configurations": [],
        "scenarios": [],
        "runs": [],
        "payments": {"settings": asdict(PaymentsSettings()), "runs": list(runs)},
    }


def test_brownout_passes_and_naive_is_not_judged() -> None:
    naive = _run("naive", applied_once=320, duplicates=80, extra_rows=80, unknown_recorded=0)
    checks = evaluate(_lab(naive, _run("brownout")))
    assert [(c["configuration"], c["check"], c["passed"]) for c in checks] == [
        ("brownout", "late successes replayed, not applied twice", True),
        ("brownout", "unknown outcomes not reconciled", True),
    ]


def test_no_replay_at_all_is_not_measured_rather_than_passed() -> None:
    quiet = _run("brownout", unknown_recorded=0, reconciled_applied=0, replays=0)
    late = evaluate(_lab(quiet))[0]
    assert (late["status"], late["passed"]) == ("not measured", False)


@pytest.mark.parametrize(
    "kw",
    [
        {"duplicates": 1},
        {"pending_after": 2},
        {"unknown_recorded": 31},  # one recorded and never resolved
    ],
)
def test_a_duplicate_or_an_unreconciled_outcome_fails(kw: dict[str, int]) -> None:
    checks = evaluate(_lab(_run("brownout", **kw)))
    assert [c["passed"] for c in checks].count(False) == 1


def test_the_report_renders_without_an_http_run(tmp_path: Path) -> None:
    lab = _lab(_run("naive", duplicates=80), _run("brownout"))
    assert [r[0] for r in payments_rows(lab)] == ["naive", "brownout"]
    text = markdown(lab, [], command="brownout lab --scenarios payments")
    assert "## Payments slow after commit" in text
    assert "| brownout | 400 | 400 | 0 |" in text
    assert tmp_path / "index.html" in write_report(lab, tmp_path)


def test_the_chain_key_is_bound_at_each_hop() -> None:
    assert chain_key("k") == bind_idempotency_key("front", bind_idempotency_key("shop", "k"))
    assert chain_key("k") != chain_key("k2")


def test_postgres_that_does_not_answer_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from brownout._cli import EXIT_UNREACHABLE, lab_main

    # nothing listens on port 1: the connection is refused at once
    dsn = "postgresql://postgres@127.0.0.1:1/test"
    argv = ["--scenarios", "payments", "--postgres", dsn, "--out", str(tmp_path)]
    assert lab_main(argv) == EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert "payments scenario not measured" in out
    assert "did not answer" in out
