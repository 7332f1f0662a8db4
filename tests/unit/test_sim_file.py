"""The simulator's TOML format, its errors, and ``brownout sim``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from brownout import Bulkhead, Dependency, Priority, RetryBudget
from brownout._cli import main
from brownout.sim import Build, Exponential, ModelError, loads, simulate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim" / "zone_loss.toml"

SMALL = """
[simulation]
duration = 5
seed = 2

[services.api]
instances = 2
workers = 4
zones = ["a", "b"]
service_time = { kind = "exponential", mean = 0.01 }
bulkhead = { limit = 4, queue = "fifo" }

[[services.api.calls]]
target = "db"
timeout = 0.2
retry = { attempts = 3, budget = 0.2, backoff = { base = 0.01 } }
breaker = { failure_rate = 0.5, window = 20 }

[services.db]
workers = 8
service_time = { kind = "constant", value = 0.005 }

[[arrivals]]
name = "users"
rate = 50
deadline = 1.0
priority = "sheddable"
call = { target = "api", timeout = 0.5 }

[[invariants]]
layer = "users"
metric = "success_ratio"
min = 0.99
"""


def test_a_file_loads_into_the_same_dataclasses() -> None:
    system = loads(SMALL)
    api = system.service("api")
    assert (api.instances, api.workers, api.zones) == (2, 4, ("a", "b"))
    assert api.service_time == Exponential(0.01)
    assert system.arrivals[0].priority is Priority.SHEDDABLE
    assert api.bulkhead is not None
    made = api.bulkhead(Build("api[0]", random.Random(0), "api", 0))
    assert isinstance(made, Bulkhead) and made.limit == 4
    call = api.calls[0]
    assert call.dependency is not None
    dep = call.dependency(Build("api[0]->db", random.Random(0), "api", 0))
    assert isinstance(dep, Dependency)
    assert (dep.timeout, dep.retry.attempts) == (0.2, 3)
    assert isinstance(dep.retry.budget, RetryBudget) and dep.retry.budget.ratio == 0.2
    assert dep.breaker is not None and dep.breaker.failure_rate == 0.5
    result = simulate(system)
    assert result.passed
    assert result.total("users", "offered") > 200


def test_constant_spacing_sends_evenly() -> None:
    system = loads(SMALL.replace("rate = 50", 'rate = 50\nspacing = "constant"'))
    assert system.arrivals[0].spacing == "constant"
    result = simulate(system)
    per_second = result.layers["users"].offered
    assert per_second == [50.0] * 5 or per_second == [49.0, *[50.0] * 4]


def test_the_same_seed_gives_the_same_result() -> None:
    one, two = simulate(loads(SMALL)), simulate(loads(SMALL))
    assert one.to_json()["layers"] == two.to_json()["layers"]


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (("workers = 4", "workers = 0"), "services.api.workers", "integer >= 1"),
        (("workers = 4", 'workers = "four"'), "services.api.workers", "must be an integer"),
        (('target = "db"', 'target = "dbx"'), "services.api.calls[0].target", "no service"),
        (("mean = 0.01", "mean = -1"), "services.api.service_time.mean", "positive"),
        (('kind = "exponential"', 'kind = "gamma"'), "services.api.service_time.kind", "one of"),
        (("window = 20", "windw = 20"), "services.api.calls[0]", "windw"),
        (("limit = 4,", "limit = 4, reserv = 1,"), "services.api.bulkhead", "reserv"),
        (('priority = "sheddable"', 'priority = "low"'), "arrivals[0].priority", "one of"),
        (('metric = "success_ratio"', 'metric = "joy"'), "invariants[0].metric", "one of"),
        (("seed = 2", "seed = 2\nspeed = 3"), "simulation.speed", "not a known field"),
        (("budget = 0.2", "budget = -1.0"), "services.api.calls[0]", "ratio"),
        (("rate = 50", 'rate = 50\nspacing = "bursty"'), "arrivals[0].spacing", "poisson or"),
    ],
)
def test_bad_input_names_its_field(change: tuple[str, str], field: str, words: str) -> None:
    with pytest.raises(ModelError) as caught:
        loads(SMALL.replace(*change, 1))
    assert any(p.field == field and words in p.message for p in caught.value.problems), str(
        caught.value
    )


def test_a_fault_on_a_zone_nobody_has_is_named() -> None:
    text = SMALL + '\n[[faults]]\nkind = "zone_loss"\nzone = "q"\nat = 1\n'
    with pytest.raises(ModelError, match=r"faults\[0\]\.zone: no service has zone 'q'"):
        loads(text)


def test_a_call_cycle_is_refused() -> None:
    text = SMALL.replace(
        "[services.db]\nworkers = 8", '[services.db]\nworkers = 8\ncalls = [{ target = "api" }]'
    )
    with pytest.raises(ModelError, match="cycle: api -> db -> api"):
        loads(text)


def test_invalid_toml_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="not valid TOML"):
        loads("[simulation\n")


def test_brownout_sim_runs_the_zone_loss_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    assert main(["sim", str(EXAMPLE), "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "== users" in printed.out and "PASS  goodput with a zone lost" in printed.out
    assert "sim: 40/40 s simulated" in printed.err
    result = json.loads(out.read_text())
    assert result["passed"] is True
    assert set(result["layers"]) == {"web", "api", "db", "users"}
    users = result["layers"]["users"]
    during = sum(users["failed"][6:8])  # the 2 s before load balancers noticed the loss
    assert during > 0


def test_brownout_sim_fails_on_a_broken_invariant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.toml"
    model.write_text(SMALL.replace("min = 0.99", "min = 0.99\nmax = 0.5"))
    assert main(["sim", str(model), "--json", str(tmp_path / "r.json"), "--quiet"]) == 1
    assert "FAIL  users.success_ratio >= 0.99 and <= 0.5" in capsys.readouterr().out


def test_brownout_sim_explains_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.toml"
    model.write_text(SMALL.replace("workers = 4", "workers = 0"))
    assert main(["sim", str(model)]) == 2
    assert "services.api.workers: must be an integer >= 1" in capsys.readouterr().err
