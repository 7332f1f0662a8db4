"""dashboards/: every metric and label the Grafana dashboard and the alert rules use is one the
collector exports (O1..O5, S8). The exported names come from the collector itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify

from brownout import Priority, Reason, Stats
from brownout._stats import GAUGE_KINDS
from brownout.events import (
    AttemptRetried,
    BreakerStateChanged,
    DeadlineHeaderIgnored,
    DegradedModeChanged,
    IdempotencyDecided,
    LimitChanged,
    MessageCompleted,
    MessageParked,
    MessagePublished,
    MessageRefused,
    MessageRetried,
    MessageStarted,
    OutcomeUnknown,
    OverloadLevelChanged,
    QuotaBackendChanged,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestQueued,
    RequestShed,
    RetryBudgetExhausted,
)
from brownout.export.prometheus import BrownoutCollector

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
METRIC = re.compile(r"\bbrownout_[a-zA-Z0-9_]+")
BY = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
STANDARD_LABELS = {"job", "instance", "le", "__name__"}


def fully_populated_stats() -> Stats:
    """A Stats that has seen one of every event and has every known gauge."""
    s = Stats()
    kw = {
        "at": 0.0,
        "source": "api",
        "operation": "op",
        "priority": Priority.CRITICAL,
        "caller": "c",
    }
    for e in (
        RequestOffered(**kw, remaining=1.0),
        RequestQueued(**kw, depth=1),
        RequestAdmitted(**kw, queue_wait=0.01),
        RequestShed(
            **kw, reason=Reason.QUEUE_FULL, remaining=1.0, queue_wait=0.0, false_positive=True
        ),
        RequestExpired(**kw, stage="queue", queue_wait=0.5),
        RequestCompleted(**kw, latency=0.1, useful=True),
        RequestCompleted(**kw, latency=2.0, useful=False),
        RequestFailed(**kw, latency=0.1, error="E"),
        RequestAbandoned(**kw, latency=0.1),
        AttemptRetried(**kw, attempt=2, cause="unavailable", backoff=0.1),
        RetryBudgetExhausted(**kw, attempt=3),
        OutcomeUnknown(**kw, idempotency_key="k"),
        LimitChanged(at=0.0, source="api", old=1, new=2),
        BreakerStateChanged(at=0.0, source="db", old="closed", new="open"),
        OverloadLevelChanged(at=0.0, source="overload", old=0, new=1, signals=("lag",)),
        DegradedModeChanged(at=0.0, source="d", mode="stale", active=True, trigger="t"),
        QuotaBackendChanged(at=0.0, source="quota", fallback=True, detail="down"),
        DeadlineHeaderIgnored(at=0.0, source="edge", header="h", problem="p"),
        IdempotencyDecided(at=0.0, source="idempotency", operation="op", outcome="replayed"),
        MessagePublished(**kw, valid_for=60.0),
        MessageRefused(**kw, reason=Reason.BACKLOG_FULL, detail="d"),
        MessageStarted(**kw, attempt=1, age=2.0, remaining=58.0),
        MessageCompleted(**kw, attempt=1, latency=0.1, age=2.1),
        MessageRetried(
            **kw, attempt=2, delay=1.0, cause="E", budget_exhausted=False, deferred=False
        ),
        MessageParked(**kw, reason="too_old", detail="d", attempt=1),
    ):
        s.emit(e)
    s.declare_degraded_mode("stale", 60)
    for kind in GAUGE_KINDS:
        s.watch_gauge(kind, {"source": "api"}, lambda: 1.0)
    return s


def exported() -> tuple[set[str], set[str]]:
    """(sample names, label names) the collector produces."""
    names: set[str] = set()
    labels: set[str] = set()
    for family in BrownoutCollector(fully_populated_stats()).collect():
        for sample in family.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


def dashboard_exprs() -> list[str]:
    dash = json.loads((DASHBOARDS / "brownout-grafana.json").read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    exprs.extend(v["query"] for v in dash["templating"]["list"] if v["type"] == "query")
    return exprs


def all_rules() -> list[dict]:
    doc = yaml.safe_load((DASHBOARDS / "brownout-alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict]:
    return [rule for rule in all_rules() if "alert" in rule]


def recording_rules() -> dict[str, str]:
    return {rule["record"]: rule["expr"] for rule in all_rules() if "record" in rule}


def check(exprs: list[str], recorded: set[str] | frozenset[str] = frozenset()) -> None:
    names, labels = exported()
    for expr in exprs:
        # Series recorded by the rules themselves are not the collector's to export.
        for name in sorted(recorded, key=len, reverse=True):
            expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", "", expr)
        for metric in METRIC.findall(expr):
            assert metric in names, f"{metric!r} in {expr!r} is not exported"
        used = {m for group in BY.findall(expr) for m in re.split(r"\s*,\s*", group.strip()) if m}
        used |= set(MATCHER.findall(expr))
        unknown = used - labels - STANDARD_LABELS
        assert not unknown, f"labels {unknown} in {expr!r} are not exported"


def test_every_dashboard_metric_is_exported():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    # The SLO panel reads series the alert rules record; they must be recorded there.
    check(exprs, set(recording_rules()))
    text = " ".join(exprs)
    for needed in (
        "offered",
        "admitted",
        "shed",
        "completed",
        "expired",
        "success_latency",
        "queue_oldest_age",
        "concurrency_limit",
        "in_flight",
        "retry_budget",
        "breaker_state",
        "degraded_mode",
        "goodput_errors:ratio_rate1h",
        "backlog_oldest_age",
        "backlog_depth",
        "messages_started",
        "messages_completed",
        "messages_parked",
        "messages_retried",
        "messages_refused",
        "message_age_seconds_bucket",
    ):
        assert needed in text, f"no panel for {needed}"


def test_every_alert_metric_is_exported_and_the_required_alerts_exist():
    rules = alert_rules()
    recorded = set(recording_rules())
    check([r["expr"] for r in all_rules()], recorded)
    by_name = {r["alert"]: r for r in rules}
    for required in (
        "BrownoutLargeShedVolume",
        "BrownoutFalsePositiveShedding",
        "BrownoutRetryBudgetExhausted",
        "BrownoutDegradedModeOverMaximum",
        "BrownoutBacklogTooOld",
        "BrownoutMessagesParkedBroken",
        "BrownoutMessagesParkedStale",
        "BrownoutProducersRefused",
        "BrownoutQueueGoodputLow",
    ):
        assert required in by_name
        assert by_name[required]["annotations"]["summary"]
        assert by_name[required]["labels"]["severity"]
    assert (
        "brownout_requests_shed_false_positive_total"
        in by_name["BrownoutFalsePositiveShedding"]["expr"]
    )
    # Work that will not succeed by waiting is its own signal, apart from work that ran out of time.
    assert 'reason=~"failed|malformed"' in by_name["BrownoutMessagesParkedBroken"]["expr"]
    assert 'reason=~"expired|too_old|attempts"' in by_name["BrownoutMessagesParkedStale"]["expr"]
    assert "brownout_backlog_oldest_age_seconds" in by_name["BrownoutBacklogTooOld"]["expr"]


def test_a_wrong_name_would_be_caught():
    with pytest.raises(AssertionError, match="not exported"):
        check(["rate(brownout_requests_shedded_total[5m])"])
    with pytest.raises(AssertionError, match="are not exported"):
        check(["sum by (tenant)(rate(brownout_requests_shed_total[5m]))"])
    with pytest.raises(AssertionError, match="not exported"):
        check(["job_source:brownout_goodput_nope:ratio_rate1h"], set(recording_rules()))


NO_PROMTOOL = (
    "promtool not installed: it ships with Prometheus (Debian/Ubuntu: "
    "`apt-get install --no-install-recommends prometheus`; or the release tarball from "
    "prometheus.io/download)"
)
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMTOOL)


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run(
        ["promtool", "check", "rules", str(DASHBOARDS / "brownout-alerts.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    """dashboards/brownout-alerts.test.yml: every alert firing and not firing."""
    result = subprocess.run(
        ["promtool", "test", "rules", str(DASHBOARDS / "brownout-alerts.test.yml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_rule_unit_test():
    tests = yaml.safe_load((DASHBOARDS / "brownout-alerts.test.yml").read_text())
    assert tests["rule_files"] == ["brownout-alerts.yml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for t in case.get("alert_rule_test", []):
            (firing if t["exp_alerts"] else quiet).add(t["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names <= firing, f"no firing case for {sorted(names - firing)}"
    # A case that expects only some series to fire also shows the others staying quiet.
    assert {"BrownoutGoodputBudgetBurn", "BrownoutLargeShedVolume"} <= quiet


def docs_base_url() -> str:
    project = tomllib.loads((DASHBOARDS.parent / "pyproject.toml").read_text())["project"]
    return project["urls"]["Documentation"].rstrip("/")


def runbook_anchors() -> set[str]:
    """The ids mkdocs gives docs/runbooks.md's headings (toc's slugify, as in mkdocs.yml)."""
    text = (DASHBOARDS.parent / "docs" / "runbooks.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slugify(h.strip(), "-") for h in re.findall(r"^#{1,6}\s+(.+)$", text, re.M)}


def test_every_alert_links_to_its_runbook_section():
    anchors = runbook_anchors()
    base = f"{docs_base_url()}/runbooks.md#"
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(base), f"{rule['alert']}: runbook_url {url!r} is not under {base}"
        anchor = url.removeprefix(base)
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in docs/runbooks.md"
        # One section per alert, named after it, so the page reads as an index of alerts.
        assert anchor == slugify(rule["alert"], "-")


def test_a_missing_runbook_section_would_be_caught():
    assert "brownoutlargeshedvolume" in runbook_anchors()
    assert "brownoutnosuchalert" not in runbook_anchors()


WINDOWS = ("5m", "30m", "1h", "6h", "3d")


def test_the_goodput_sli_is_the_same_expression_at_every_window():
    recorded = recording_rules()
    assert recorded["brownout:goodput_objective:ratio"].strip() == "vector(0.999)"
    for prefix in ("bad:rate", "valid:rate", "errors:ratio_rate"):
        names = [f"job_source:brownout_goodput_{prefix}{w}" for w in WINDOWS]
        shapes = {re.sub(r"(?<![0-9])(?:5m|30m|1h|6h|3d)\b", "W", recorded[n]) for n in names}
        assert len(shapes) == 1, f"{prefix} differs between windows"
    bad = recorded["job_source:brownout_goodput_bad:rate5m"]
    for counter in ("expired", "failed", "completed_late", "shed"):
        assert f"brownout_requests_{counter}_total" in bad
    assert 'priority!="sheddable"' in bad and 'reason!="quota"' in bad


def test_the_burn_rate_alerts_use_the_workbook_windows_and_factors():
    by_name = {r["alert"]: r for r in alert_rules()}
    page = by_name["BrownoutGoodputBudgetBurn"]
    ticket = by_name["BrownoutGoodputBudgetSlowBurn"]
    assert page["labels"]["severity"] == "critical"
    assert ticket["labels"]["severity"] == "warning"
    pairs = {
        "BrownoutGoodputBudgetBurn": [("14.4", "1h", "5m"), ("6", "6h", "30m")],
        "BrownoutGoodputBudgetSlowBurn": [("1", "3d", "6h")],
    }
    for name, conditions in pairs.items():
        expr = " ".join(by_name[name]["expr"].split())
        for factor, long, short in conditions:
            for window in (long, short):
                assert (
                    f"ratio_rate{window} > on () group_left () "
                    f"({factor} * (1 - brownout:goodput_objective:ratio))"
                ) in expr, (name, window)


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    grafana_vars = {
        "$__rate_interval": "5m",
        "$__range": "1h",
        "$job": ".*",
        "$source": ".*",
        "$operation": ".*",
        "$queue": ".*",
    }
    rules = []
    for i, expr in enumerate(e for e in dashboard_exprs() if not e.startswith("label_values")):
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:panel{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_docs_metric_reference_lists_every_exported_metric():
    doc = (DASHBOARDS.parent / "docs" / "observability.md").read_text()
    names, _labels = exported()
    bases = {re.sub(r"_(bucket|sum|count)$", "", n) if "_seconds_" in n else n for n in names}
    missing = sorted(b for b in bases if f"`{b}`" not in doc)
    assert not missing, f"docs/observability.md does not describe {missing}"
