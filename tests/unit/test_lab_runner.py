"""Turning scenarios (data) into generator plans (T1, T2)."""

from __future__ import annotations

import pytest

from brownout._lab.runner import CONFIGURATIONS, LabSettings, Target, classes_for, plan_for
from brownout._lab.scenarios import (
    DEFAULT_SCENARIOS,
    SCENARIOS,
    DependencyChange,
    Phase,
    Scenario,
    register,
)


def test_plans_start_with_a_warm_up_and_scale_loads_by_capacity() -> None:
    settings = LabSettings()
    demo = Target("127.0.0.1", 1234, "")
    plan = plan_for(SCENARIOS["ramp"], settings, 400.0, demo, ("127.0.0.1", 99))
    warm, *steps = plan.steps
    assert not warm.measured
    assert warm.rate == 200.0
    assert [s.rate for s in steps] == [200.0, 320.0, 400.0, 800.0, 1600.0, 4000.0]
    assert all(s.duration >= 3 * settings.deadline for s in steps)
    assert all(s.settle == settings.settle_seconds for s in steps)
    assert plan.deadline == settings.deadline
    assert {c.name for c in plan.classes} == {
        "interactive",
        "batch",
        "health",
        "outbound",
        "recommendations",
    }


def test_default_steps_have_steady_windows_of_five_seconds_and_quick_stays_short() -> None:
    demo = Target("127.0.0.1", 1234, "")
    for name, scenario in SCENARIOS.items():
        plan = plan_for(scenario, LabSettings(), 400.0, demo, ("127.0.0.1", 2), proxy=("", 3))
        steady = [s.duration - s.settle for s in plan.steps if s.measured]
        assert min(steady) >= 5.0, name
    quick = LabSettings.quick()
    assert quick.step_seconds - quick.settle_seconds <= 1.0


def test_dependency_changes_become_admin_calls_on_the_demo_backend() -> None:
    settings = LabSettings()
    plan = plan_for(
        SCENARIOS["slow-dependency"],
        settings,
        400.0,
        Target("127.0.0.1", 1, ""),
        ("127.0.0.1", 2),
    )
    bodies = [s.actions[0].body if s.actions else None for s in plan.steps]
    latency, slots = settings.backend_latency, settings.backend_concurrency
    assert bodies == [
        None,
        None,
        {"latency": 4 * latency, "concurrency": slots},
        {"latency": latency, "concurrency": slots},
    ]
    assert all(a.port == 2 and a.path == "/admin" for s in plan.steps for a in s.actions)
    assert DependencyChange(concurrency_factor=0.5).body(0.02, 8) == {
        "latency": 0.02,
        "concurrency": 4,
    }


def test_a_user_target_gets_one_path_and_no_dependency_actions() -> None:
    target = Target("127.0.0.1", 8000, "/api/items", health_path="/healthz")
    assert [(c.name, c.path) for c in classes_for(target)] == [
        ("interactive", "/api/items"),
        ("health", "/healthz"),
    ]
    plan = plan_for(SCENARIOS["capacity-loss"], LabSettings(), 100.0, target, None)
    assert not any(s.actions for s in plan.steps)


def test_scenarios_are_data_that_can_be_registered() -> None:
    assert set(DEFAULT_SCENARIOS) <= set(SCENARIOS)
    custom = Scenario(
        "test-only-burst",
        "Burst",
        "a test scenario",
        (Phase("burst", 3.0, steps=0.5, client={"retries": 3}),),
    )
    try:
        assert register(custom) is custom
        assert SCENARIOS["test-only-burst"].phases[0].client == {"retries": 3}
    finally:
        del SCENARIOS["test-only-burst"]


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_configurations_differ_only_in_protection(name: str) -> None:
    c = CONFIGURATIONS[name]
    assert c.brownout == ("brownout" in name)
    assert (c.limit_concurrency is not None) == (name == "uvicorn-limit")
    assert c.mode in ("unprotected", "fixed", "adaptive")
    assert c.sync == name.startswith("sync-")
    assert c.mode != "adaptive" or not c.sync  # the sync front's protection is the fixed one


def test_the_sync_configurations_run_the_ramp_and_brownout_also_the_flood() -> None:
    ran = {
        (c.name, s.name) for c in CONFIGURATIONS.values() for s in SCENARIOS.values() if c.runs(s)
    }
    assert {s for c, s in ran if c == "sync-unprotected"} == {"ramp"}
    assert {s for c, s in ran if c == "sync-brownout"} == {"ramp", "health"}
    # the async configurations keep every scenario they ran before
    assert {s for c, s in ran if c == "unprotected"} == set(SCENARIOS) - {"cpu-starved"}
    assert {s for c, s in ran if c == "brownout-adaptive"} == set(SCENARIOS)
