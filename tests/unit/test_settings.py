"""Settings from TOML and the environment: the built objects behave as code-built ones, and
every bad key or value is named in one `ConfigError`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brownout import (
    ConfigError,
    DegradedMode,
    DegradedModes,
    Dependency,
    EdgePolicy,
    InboundDeadlinePolicy,
    Priority,
    Reason,
    RetryBudget,
    RetryPolicy,
    Route,
    Trust,
    load_config,
)
from brownout.limits import AIMDLimit, FixedLimit, Gradient2Limit
from brownout.queues import CoDelQueue, PriorityCoDelQueue

FILE = """
[edge]
trust = "trusted"
health_paths = ["/ping"]
retry_after_jitter = 0.25
default_priority = "critical"
do_not_retry = ["budget_exhausted"]

[edge.statuses]
overloaded = 500

[edge.deadline]
default = 2
maximum = 5

[edge.bulkhead]
reserve = 2
queue = "priority-codel"

[edge.bulkhead.limit]
kind = "gradient2"
initial = 20
max_limit = 200

[edge.routes."/search"]
priority = "sheddable"
maximum = 1.5

[edge.routes."/admin/{id}".bulkhead]
limit = 4

[edge.slowed]
max_held = 10
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "brownout.toml"
    path.write_text(text)
    return path


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


def test_the_file_builds_the_policy_code_would(tmp_path: Path) -> None:
    policy = EdgePolicy.from_config(load_config(write(tmp_path, FILE), env={}))
    assert policy.trust is Trust.TRUSTED
    assert policy.is_health("/ping") and not policy.is_health("/health")
    assert policy.retry_after_jitter == 0.25
    assert policy.status_for(Reason.OVERLOADED) == 500
    assert policy.refusal(Reason.BUDGET_EXHAUSTED).do_not_retry
    assert policy.deadline == InboundDeadlinePolicy(default=2, maximum=5)
    bulkhead = policy.bulkhead
    assert bulkhead is not None
    assert isinstance(bulkhead.limit_algorithm, Gradient2Limit)
    assert bulkhead.limit == 20
    assert isinstance(bulkhead.queue, PriorityCoDelQueue)
    search = policy.route("/search")
    assert search.priority is Priority.SHEDDABLE
    assert search.deadline.maximum == 1.5 and search.deadline.default == 1.5
    assert search.bulkhead is bulkhead
    admin = policy.route("/admin/{id}")
    assert admin.bulkhead is not None and admin.bulkhead is not bulkhead
    assert admin.bulkhead.limit == 4
    assert policy.slowed is not None

    by_code = EdgePolicy(
        deadline=InboundDeadlinePolicy(default=2, maximum=5),
        routes={"/search": Route(priority=Priority.SHEDDABLE, maximum=1.5)},
    )
    assert search.deadline == by_code.route("/search").deadline
    assert search.priority == by_code.route("/search").priority


def test_a_typo_is_named_in_full_with_a_suggestion(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[edge.bulkhead]\nlimt = 10\n"), env={})
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config(config)
    assert "edge.bulkhead.limt" in problems(excinfo)
    assert "did you mean 'limit'" in problems(excinfo)
    assert isinstance(excinfo.value, ValueError)


def test_every_problem_is_listed_at_once() -> None:
    config = {
        "edge": {
            "retry_after_jitter": -1,
            "deadline": {"maximum": "5s"},
            "routes": {"/search": {"priority": "urgent", "default": True}},
            "bulkhead": {"limit": {"kind": "gradient3", "initial": 10}, "queue": 7},
            "classifier": "mine",
            "statuses": {"overload": 529},
        }
    }
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config(config)
    text = problems(excinfo)
    assert "edge.deadline.maximum: expected a number" in text
    assert "edge.routes.\"/search\".priority: 'urgent' is not one of" in text
    assert 'edge.routes."/search".default: expected a number' in text
    assert "edge.bulkhead.limit.kind: 'gradient3'" in text and "'gradient2'" in text
    assert "edge.bulkhead.queue: expected a name or a table" in text
    assert "edge.classifier: set in code" in text
    assert "edge.statuses: 'overload' is not one of" in text
    assert len(excinfo.value.problems) >= 7


def test_a_constructor_refusal_names_the_table() -> None:
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config({"edge": {"retry_after_jitter": -1}})
    assert problems(excinfo) == "edge: retry_after_jitter must be >= 0"
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config({"edge": {"bulkhead": {"limit": -3}}})
    assert problems(excinfo).startswith("edge.bulkhead: ")
    with pytest.raises(ConfigError, match=r"edge.bulkhead.limit: .*min_limit"):
        EdgePolicy.from_config({"edge": {"bulkhead": {"limit": {"kind": "aimd", "min_limit": 0}}}})


def test_the_environment_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    env = {
        "BROWNOUT_EDGE__BULKHEAD__LIMIT__INITIAL": "30",
        "BROWNOUT_EDGE__DEADLINE__MAXIMUM": "4.5",
        "BROWNOUT_EDGE__TRUST": "untrusted",
        "BROWNOUT_EDGE__HEALTH_PATHS": '["/live", "/ready"]',
        "BROWNOUT_TESTING": "1",  # no double underscore: not a setting
        "OTHER_EDGE__TRUST": "trusted",
    }
    config = load_config(path, env=env)
    policy = EdgePolicy.from_config(config)
    assert policy.bulkhead is not None and policy.bulkhead.limit == 30
    assert policy.deadline.maximum == 4.5 and policy.deadline.default == 2
    assert policy.trust is Trust.UNTRUSTED
    assert policy.is_health("/live") and not policy.is_health("/ping")
    assert "testing" not in config


def test_environment_alone_and_a_fixed_limit_shorthand() -> None:
    config = load_config(env={"BROWNOUT_EDGE__BULKHEAD__LIMIT": "12"})
    policy = EdgePolicy.from_config(config)
    assert policy.bulkhead is not None
    assert isinstance(policy.bulkhead.limit_algorithm, FixedLimit)
    assert policy.bulkhead.limit == 12


def test_load_config_refuses_unknown_tables_bad_toml_and_clashing_variables(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"edg: unknown table \(did you mean 'edge'\?\)"):
        load_config(write(tmp_path, "[edg]\ntrust = 'trusted'\n"), env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[edge\n"), env={})
    with pytest.raises(ConfigError, match=r"BROWNOUT_EDGE__TRUST__X: edge\.trust is not a table"):
        load_config(
            write(tmp_path, "[edge]\ntrust = 'trusted'\n"), env={"BROWNOUT_EDGE__TRUST__X": "1"}
        )
    with pytest.raises(ConfigError, match="empty name"):
        load_config(env={"BROWNOUT_EDGE____TRUST": "1"})


def test_code_wins_over_settings_and_missing_tables_give_defaults() -> None:
    policy = EdgePolicy.from_config({"edge": {"trust": "trusted"}}, trust=Trust.SIGNED)
    assert policy.trust is Trust.SIGNED
    default = EdgePolicy.from_config({})
    assert default.bulkhead is None and default.deadline == InboundDeadlinePolicy()


def test_retry_policy_budget_and_dependency() -> None:
    config = load_config(
        env={
            "BROWNOUT_RETRY__ATTEMPTS": "4",
            "BROWNOUT_RETRY__BACKOFF__KIND": "exponential",
            "BROWNOUT_RETRY__BACKOFF__CAP": "1.5",
            "BROWNOUT_RETRY__BUDGET__RATIO": "0.2",
            "BROWNOUT_DEPENDENCIES__PAYMENTS__TIMEOUT": "0.8",
            "BROWNOUT_DEPENDENCIES__PAYMENTS__RETRY__ATTEMPTS": "2",
            "BROWNOUT_DEPENDENCIES__PAYMENTS__BULKHEAD__LIMIT": '{kind = "aimd", initial = 8}',
            "BROWNOUT_DEPENDENCIES__PAYMENTS__BREAKER__FAILURE_RATE": "0.3",
        }
    )
    retry = RetryPolicy.from_config(config)
    assert retry.attempts == 4
    assert retry.backoff.cap == 1.5  # type: ignore[attr-defined]
    assert isinstance(retry.budget, RetryBudget) and retry.budget.ratio == 0.2
    assert RetryBudget.from_config(config).ratio == 0.2
    payments = Dependency.from_config(config, "payments")
    assert payments.name == "payments" and payments.timeout == 0.8
    assert payments.retry is not None and payments.retry.attempts == 2
    assert payments.bulkhead is not None
    assert isinstance(payments.bulkhead.limit_algorithm, AIMDLimit)  # type: ignore[attr-defined]
    assert payments.breaker is not None and payments.breaker.failure_rate == 0.3
    with pytest.raises(ConfigError, match=r"dependencies.payments.retry.attempts: expected an"):
        Dependency.from_config(
            {"dependencies": {"payments": {"retry": {"attempts": "2"}}}}, "payments"
        )
    with pytest.raises(
        ConfigError, match=r"retry.budget.ratoi: unknown key \(did you mean 'ratio'"
    ):
        RetryPolicy.from_config({"retry": {"budget": {"ratoi": 0.2}}})


def test_degraded_modes_forced_from_settings() -> None:
    declared = [
        DegradedMode("recommendations", "cached recommendations", enter_at_level=1),
        DegradedMode("search", "no typo tolerance", enter_at_level=2),
    ]
    config = {"degraded": {"force": {"recommendations": True, "search": False}}}
    modes = DegradedModes.from_config(config, declared)
    assert modes.active("recommendations") and modes.forced("recommendations") is True
    assert modes.forced("search") is False
    modes.set_level(3)
    assert not modes.active("search")
    with pytest.raises(ConfigError, match=r"degraded.force.recomendations: no such declared mode"):
        DegradedModes.from_config({"degraded": {"force": {"recomendations": True}}}, declared)
    with pytest.raises(ConfigError, match=r"degraded.force.search: expected true or false"):
        DegradedModes.from_config({"degraded": {"force": {"search": "on"}}}, declared)


def test_priority_queue_and_codel_from_a_table() -> None:
    policy = EdgePolicy.from_config(
        {"edge": {"bulkhead": {"queue": {"kind": "codel", "max_size": 8, "target": 0.01}}}}
    )
    assert policy.bulkhead is not None
    assert isinstance(policy.bulkhead.queue, CoDelQueue)


def test_a_table_without_its_kind_is_named_once() -> None:
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config({"edge": {"bulkhead": {"queue": {"max_size": 3}}}})
    assert excinfo.value.problems == (
        "edge.bulkhead.queue.kind: missing: one of fifo, lifo, codel, adaptive_lifo, "
        "priority_codel",
    )


def test_nan_is_refused_where_a_constructor_would_let_it_through() -> None:
    with pytest.raises(ConfigError, match=r"edge\.retry_after_jitter: expected a number, got nan"):
        EdgePolicy.from_config(load_config(env={"BROWNOUT_EDGE__RETRY_AFTER_JITTER": "nan"}))
    jitter = EdgePolicy.from_config({"edge": {"retry_after_jitter": math.inf}}).retry_after_jitter
    assert jitter == math.inf  # infinity is the constructor's to judge


KNOWN_EDGE_KEYS = {
    "bulkhead", "deadline", "trust", "classifier", "health_paths", "routes", "default_priority",
    "max_claimed_priority", "quota", "on_quota_exceeded", "degraded", "slowed", "expired_status",
    "statuses", "grpc_codes", "details", "do_not_retry", "retry_after_jitter", "sweep_period",
    "connections", "name", "events", "rng", "metrics_paths",
}  # fmt: skip


@given(
    key=st.text(st.characters(codec="ascii", categories=("L", "N", "P")), min_size=1).filter(
        lambda k: k not in KNOWN_EDGE_KEYS
    ),
    value=st.one_of(st.integers(), st.text(), st.booleans()),
)
def test_any_unknown_key_is_named(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        EdgePolicy.from_config({"edge": {key: value}})
    assert len(excinfo.value.problems) == 1
    assert "unknown key" in excinfo.value.problems[0]
    quoted = key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
    assert excinfo.value.problems[0].startswith(f"edge.{quoted}: unknown key")


@given(initial=st.integers(1, 1000), maximum=st.floats(0.001, 1e6))
def test_limit_and_maximum_round_trip(initial: int, maximum: float) -> None:
    config = {"edge": {"bulkhead": {"limit": initial}, "deadline": {"maximum": maximum}}}
    policy = EdgePolicy.from_config(config)
    assert policy.bulkhead is not None and policy.bulkhead.limit == initial
    assert policy.deadline == InboundDeadlinePolicy(default=min(10.0, maximum), maximum=maximum)
