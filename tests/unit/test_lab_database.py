"""The database scenario's pure parts: the query tag and its parse, the samples of
``pg_stat_activity``, the per-second figures, recovery, the verdict and the report, from
synthetic results (no servers); and the message when PostgreSQL does not answer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from brownout._lab.database import (
    DATABASE_COLUMNS,
    DATABASE_SECONDS_COLUMNS,
    DatabaseSettings,
    DatabaseUnavailable,
    Outcome,
    Sample,
    database_rows,
    database_seconds,
    recovery_seconds,
    run_database,
    sample_queries,
    summarize_seconds,
)
from brownout._lab.database_service import parse_tag, tagged_query
from brownout._lab.report import markdown, write_report
from brownout._lab.verdict import evaluate

START = 1000.0


def test_a_tagged_query_parses_back_to_its_run_and_give_up_time() -> None:
    assert parse_tag(tagged_query("ab12", 2361.5604)) == ("ab12", 2361.56)
    assert parse_tag("SELECT 1") is None
    assert parse_tag("/* brownout-lab-db run=x give_up=oops */") is None


def test_a_sample_counts_this_runs_queries_and_those_whose_caller_is_gone() -> None:
    texts = [
        tagged_query("mine", START + 2.0),  # caller still waiting
        tagged_query("mine", START + 0.5),  # gone 1.0 s ago
        tagged_query("mine", START + 1.2),  # gone 0.3 s ago
        tagged_query("other", START),  # another run's: not counted
        "SELECT pg_advisory_lock(1)",
    ]
    sample = sample_queries(texts, "mine", now=START + 1.5, start=START)
    assert sample == Sample(at=1.5, running=3, gone=2, overrun=1.0)
    assert sample_queries([], "mine", START, START) == Sample(0.0, 0, 0, 0.0)


def test_the_seconds_count_goodput_refusals_waits_and_samples_per_second() -> None:
    outcomes = [
        Outcome(0.1, "ok", 0.1),
        Outcome(0.5, "ok", 0.2),
        Outcome(0.9, "refused:queue_timeout", 0.25),
        Outcome(1.2, "timeout", 1.0),
        Outcome(1.3, "late", 1.1),
    ]
    waits = [(0.1, 0.0), (0.5, 0.01), (0.9, 0.25), (1.2, 3.0)]
    samples = [Sample(0.2, 2, 0, 0.0), Sample(1.4, 8, 3, 0.7), Sample(1.6, 8, 5, 0.9)]
    first, second = summarize_seconds(outcomes, waits, samples, 2)
    assert first["offered"] == 3 and first["goodput"] == 2
    assert first["refused"] == {"queue_timeout": 1}
    assert first["p99_ms"] == 200.0 and first["pool_wait_p99_ms"] == 250.0
    assert first["running_max"] == 2 and first["gone_max"] == 0
    assert second["goodput"] == 0 and second["timeouts"] == 1 and second["late"] == 1
    assert second["p99_ms"] is None
    assert second["pool_waiters"] == 1  # the 3 s wait started at 1.2 is still under way
    assert (second["running_max"], second["gone_max"], second["overrun_max"]) == (8, 5, 0.9)


@pytest.mark.parametrize(
    ("goodput", "expected"),
    [
        ([50, 56, 56, 56, 0, 0, 56, 56, 56], 0.0),
        ([50, 56, 56, 56, 0, 0, 10, 30, 51, 56], 2.0),
        ([50, 56, 56, 56, 0, 0, 0, 56, 0], None),  # falls again: not recovered
    ],
)
def test_recovery_is_the_first_second_from_which_goodput_stays_at_90_percent(
    goodput: list[int], expected: float | None
) -> None:
    assert recovery_seconds(goodput, before=4, slow_end=6) == expected


def _run(config: str, **kw: Any) -> dict[str, Any]:
    second = {
        "second": 0,
        "offered": 56,
        "goodput": 56,
        "late": 0,
        "timeouts": 0,
        "errors": 0,
        "refused": {},
        "p99_ms": 110.0,
        "pool_wait_p99_ms": 0.3,
        "pool_waiters": 0,
        "running_max": 6,
        "gone_max": 0,
        "overrun_max": 0.0,
    }
    run = {
        "configuration": config,
        "scenario": "database",
        "requests": 1568,
        "goodput_before": 56.0,
        "goodput_slow": 19.3,
        "goodput_after": 56.0,
        "good_slow": 193,
        "refused": {"queue_timeout": 196},
        "timeouts": 8,
        "late": 0,
        "errors": 0,
        "p99_ms": 909.5,
        "pool_wait_p99_ms": 253.4,
        "pool_wait_max_ms": 255.4,
        "pool_waiters_max": 14,
        "running_max": 8,
        "gone_max": 0,
        "gone_sample_share": 0.0,
        "overrun_max": 0.0,
        "recovery_s": 0.0,
        "seconds": [second],
        "samples": [asdict(Sample(0.2, 6, 0, 0.0))],
    }
    return {**run, **kw}


def _unprotected(**kw: Any) -> dict[str, Any]:
    plain = {
        "goodput_slow": 0.0,
        "good_slow": 0,
        "refused": {},
        "timeouts": 665,
        "pool_wait_p99_ms": 4134.1,
        "gone_max": 8,
        "overrun_max": 5.9,
        "recovery_s": None,
    }
    return _run("unprotected", **{**plain, **kw})


def _lab(*runs: dict[str, Any]) -> dict[str, Any]:
    return {
        "settings": {},
        "target": None,
        "calibration": None,
        "configurations": [],
        "scenarios": [],
        "runs": [],
        "database": {"settings": asdict(DatabaseSettings()), "runs": list(runs)},
    }


def test_brownout_passes_and_the_unprotected_front_is_not_judged() -> None:
    checks = evaluate(_lab(_unprotected(), _run("brownout")))
    assert [(c["configuration"], c["check"], c["passed"]) for c in checks] == [
        ("brownout", "query running past its caller's deadline", True),
        ("brownout", "pool wait p99", True),
        ("brownout", "seconds to goodput >= 90% of before, after the slowdown", True),
        ("brownout", "goodput during the slowdown vs unprotected", True),
    ]


@pytest.mark.parametrize(
    "kw",
    [
        {"overrun_max": 1.3},  # a query outlived its caller on the server
        {"pool_wait_p99_ms": 400.0},  # above the 250 ms bound and its slack
        {"pool_wait_p99_ms": None},  # no acquisition measured
        {"recovery_s": 4.0},
        {"recovery_s": None},
        {"good_slow": 0},  # below the unprotected front's 5
    ],
)
def test_each_broken_invariant_fails_once(kw: dict[str, Any]) -> None:
    checks = evaluate(_lab(_unprotected(good_slow=5), _run("brownout", **kw)))
    assert [c["passed"] for c in checks].count(False) == 1


def test_the_report_has_the_table_the_seconds_and_the_plot(tmp_path: Path) -> None:
    lab = _lab(_unprotected(), _run("brownout"))
    assert [r[0] for r in database_rows(lab)] == ["unprotected", "brownout"]
    assert database_rows(lab)[0][4] == "never"
    assert [r[2] for r in database_seconds(lab)] == ["unprotected", "brownout"]
    text = markdown(lab, [], command="brownout lab --scenarios database")
    assert "## Slow database (front -> PostgreSQL pool)" in text
    assert "| brownout | 56 | 19.3 | 56 | 0 | 196 queue_timeout | 8 | 0 |" in text
    assert "| 0 | before | unprotected | 56 |" in text
    written = write_report(lab, tmp_path)
    assert tmp_path / "timeline-database.png" in written


def test_a_postgresql_that_does_not_answer_says_how_to_start_it() -> None:
    # Port 1 on loopback: nothing listens, the connection is refused at once.
    with pytest.raises(DatabaseUnavailable, match="service postgresql start"):
        run_database(DatabaseSettings(dsn="postgresql://postgres@127.0.0.1:1/test"))


def test_the_docs_page_shows_the_command_and_the_reports_table() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "lab-database.md").read_text()
    assert "$ brownout lab --scenarios database" in page
    assert "| " + " | ".join(DATABASE_COLUMNS) + " |" in page
    assert "| " + " | ".join(DATABASE_SECONDS_COLUMNS) + " |" in page
