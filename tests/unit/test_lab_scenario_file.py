"""Scenario files: the loader on good and bad files, the demo's files, templates, the knee
search on a simulated service, and the scenario-file invariants."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from brownout._lab.knee import find_knee
from brownout._lab.runner import Target, classes_for, file_classes
from brownout._lab.scenario_file import (
    CapacitySpec,
    ScenarioFileError,
    load_scenario,
    parse_base_url,
    parse_scenario,
)
from brownout._lab.scenarios import DEMO_FILES, SCENARIOS, demo_file
from brownout._lab.verdict import scenario_checks
from brownout._propagation import PRIORITY_HEADER

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lab-scenario.toml"
ENV = {"SHOP_TOKEN": "secret-value"}

MINIMAL = """
version = 1
name = "small"
[[endpoints]]
name = "home"
path = "/"
[[steps]]
load = 1.0
"""


def test_the_example_file_loads() -> None:
    sf = load_scenario(EXAMPLE, env=ENV)
    assert [e.name for e in sf.endpoints] == ["item", "order", "cart"]
    assert [e.method for e in sf.endpoints] == ["GET", "POST", "DELETE"]
    assert dict(sf.endpoints[0].headers)["authorization"] == "Bearer secret-value"
    assert [s.label for s in sf.steps] == ["0.5x", "1x", "2x", "spike"]
    assert sf.steps[-1].steps == pytest.approx(0.5)  # 1 s of 2 s steps
    assert sf.capacity.rps == 100
    assert sf.deadline(sf.endpoints[2]) == 2.0
    assert sf.base_url is not None and sf.base_url.port == 8000


@pytest.mark.parametrize("example", [EXAMPLE, ROOT / "examples" / "lab_shop" / "scenario.toml"])
def test_the_docs_show_the_example_file_verbatim(example: Path) -> None:
    page = (ROOT / "docs" / "lab.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert example.read_text() in blocks


def test_the_requests_carry_class_priority_deadline_and_drawn_values() -> None:
    sf = load_scenario(EXAMPLE, env=ENV)
    classes = {c.name: c for c in file_classes(sf, parse_base_url("https://shop.test/api/"))}
    assert classes["item"].deadline == 0.5
    assert (PRIORITY_HEADER, "sheddable") in classes["cart"].headers
    order = classes["order"].template
    assert order is not None
    raw = order.render(random.Random(3), "shop.test", ())
    head, body = raw.split(b"\r\n\r\n")
    assert head.startswith(b"POST /api/orders HTTP/1.1\r\nhost: shop.test\r\n")
    assert b"content-type: application/json" in head
    assert re.search(rb'^\{"sku":"(apple|pear|plum)","quantity":[1-5],"note":"lab order"\}$', body)
    assert f"content-length: {len(body)}".encode() in head
    item = classes["item"].template
    assert item is not None
    paths = {item.render(random.Random(i), "h", ()).split(b" ")[1] for i in range(20)}
    assert len(paths) > 10 and all(re.fullmatch(rb"/api/items/\d+", p) for p in paths)


def test_base_urls() -> None:
    b = parse_base_url("https://api.example.com")
    assert (b.host, b.port, b.tls, b.prefix, b.host_header) == (
        "api.example.com",
        443,
        True,
        "",
        "api.example.com",
    )
    b = parse_base_url("http://[::1]:8080/v2/")
    assert (b.host, b.port, b.prefix, b.host_header) == ("::1", 8080, "/v2", "[::1]:8080")
    for bad in ("ftp://x", "http://", "http://h:99999", "http://h/?q=1", "127.0.0.1:80"):
        with pytest.raises(ScenarioFileError):
            parse_base_url(bad)


def test_the_demo_files_are_the_registered_scenarios() -> None:
    assert list(SCENARIOS)[: len(DEMO_FILES)] == list(DEMO_FILES)
    demo_paths = {c.name: c.path for c in classes_for(Target("127.0.0.1", 1, ""))}
    for name in DEMO_FILES:
        sf = demo_file(name)
        assert sf.name == name
        for e in sf.endpoints:  # the files name the demo's real routes
            assert demo_paths[e.name] == e.path
    ramp = SCENARIOS["ramp"]
    assert [p.load for p in ramp.phases] == [0.5, 0.8, 1.0, 2.0, 4.0, 10.0]
    storm = SCENARIOS["retry-storm"].phases
    assert dict(storm[0].client) == {"retries": 3, "backoff": 0.1}
    assert dict(storm[1].client) == {"retries": 3, "backoff": 0.1, "budget": 0.1}
    recovered = SCENARIOS["slow-dependency"].phases[2].dependency
    assert recovered is not None and recovered.body(0.04, 8) == {"latency": 0.04, "concurrency": 8}


def _with(extra: str, base: str = MINIMAL) -> str:
    return base + extra


BAD: list[tuple[str, str]] = [
    ("version = 1\n", "name: is required"),
    (MINIMAL.replace("version = 1", "version = 2"), "version: must be 1"),
    (MINIMAL.replace('path = "/"', 'path = "/x/{id}"'), "endpoints[0].path: placeholder {id}"),
    (MINIMAL.replace('path = "/"', 'path = "x"'), "endpoints[0].path: must start with /"),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\nmethod = "FETCH"'),
        "endpoints[0].method: must be one of",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\nheaders = { auth = "${NOT_SET_HERE}" }'),
        "endpoints[0].headers.auth: environment variable NOT_SET_HERE is not set",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\njson = { a = 1 }'),
        "endpoints[0].method: GET sends no body",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\nclass = "vip"'),
        "endpoints[0].class: unknown traffic class 'vip'",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\nparams.id = { int = [5, 1] }'),
        "endpoints[0].params.id.int: must be [low, high]",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/{id}"\nparams.id = { int = [1, 2], uuid = true }'),
        "endpoints[0].params.id: declare exactly one",
    ),
    (
        MINIMAL.replace('path = "/"', 'path = "/"\nparams.id = { uuid = true }'),
        "endpoints[0].params.id: is declared but no path, header or body uses it",
    ),
    (MINIMAL.replace("load = 1.0", "load = -1"), "steps[0].load: must be a finite number > 0"),
    (MINIMAL.replace("load = 1.0", 'load = "2x"'), "steps[0].load: must be a number, not str"),
    (MINIMAL.replace("load = 1.0", "loads = [1, 0]"), "steps[0].loads[1]: must be a number > 0"),
    (MINIMAL.replace("load = 1.0", "load = 1\nmix = { away = 1 }"), "steps[0].mix.away: no end"),
    (MINIMAL.replace("load = 1.0", "load = 1\nspeed = 3"), "steps[0].speed: unknown field"),
    (_with("[classes.c]\npriority = 'urgent'\n"), "classes.c.priority: unknown priority"),
    (_with("[capacity]\nrps = 5\nfind = true\n"), "capacity.find: declare rps or find"),
    (_with("[plan]\nsettle_seconds = 5\n"), "plan.settle_seconds: must be shorter"),
    (_with("[plan]\narrivals = 'bursty'\n"), "plan.arrivals: must be constant or poisson"),
    (_with("[[invariants]]\ncheck = 'speed'\nmin = 1\n"), "invariants[0].check: unknown check"),
    (_with("[[invariants]]\ncheck = 'goodput'\nmax = 1\n"), "invariants[0].max: goodput takes"),
    (_with("[[invariants]]\ncheck = 'served'\nmin = 99\n"), "invariants[0].min: is a share"),
    (
        _with("[[invariants]]\ncheck = 'goodput'\nmin = 0.9\nsteps = ['9x']\n"),
        "invariants[0].steps: no step is labelled '9x'",
    ),
    (_with("[[invariants]]\ncheck = 'class_goodput'\nmin = 0.9\n"), "class_goodput needs class"),
    (_with('base_url = "ftp://x"\n', ""), "base_url: must be an http"),
    ("version = 1\nname = [", "not valid TOML"),
    (MINIMAL.replace("[[steps]]\nload = 1.0\n", ""), "steps: declare at least one"),
    (
        MINIMAL + '[[endpoints]]\nname = "home"\npath = "/b"\n',
        "endpoints[1].name: 'home' is already",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_files_name_the_field(text: str, message: str) -> None:
    if text.startswith("base_url"):
        text = text + MINIMAL
    with pytest.raises(ScenarioFileError) as err:
        parse_scenario(text, "bad.toml", env={})
    assert str(err.value).startswith("bad.toml: ")
    assert message in str(err.value)


def test_a_missing_file_is_a_scenario_file_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioFileError, match="cannot read"):
        load_scenario(tmp_path / "absent.toml")


def test_placeholders_and_env_in_bodies() -> None:
    text = MINIMAL.replace(
        'path = "/"',
        'path = "/"\nmethod = "PUT"\nbody = "id={id};key=${K}"\nparams.id = { choice = [7] }',
    )
    sf = parse_scenario(text, env={"K": "v"})
    t = sf.endpoints[0].template()
    assert t.render(random.Random(1), "h", ()).endswith(b"\r\n\r\nid=7;key=v")


def _service(capacity: float) -> Any:
    """A simulated service: keeps up to ``capacity``, then serves only ``capacity``."""
    tried: list[float] = []

    def measure(rate: float) -> tuple[float, float, float | None]:
        tried.append(rate)
        return rate, min(rate, capacity), 20.0 if rate <= capacity else 900.0

    return measure, tried


def test_the_knee_is_bracketed_then_bisected() -> None:
    measure, tried = _service(200.0)
    spec = CapacitySpec(find=True, start_rps=10, factor=2.0, refine=4, follow=0.95)
    knee = find_knee(measure, spec, 1000.0)
    assert tried[:6] == [10, 20, 40, 80, 160, 320]
    assert len(tried) == 6 + 4
    assert 160 <= knee.capacity <= 200 / spec.follow  # 95% of it still kept up with
    assert knee.capacity >= 190  # four bisections of 160..320 land within 5%
    assert "kept up with" in knee.why


def test_latency_past_the_deadline_is_not_keeping_up() -> None:
    def measure(rate: float) -> tuple[float, float, float | None]:
        return rate, rate, 50.0 if rate < 100 else 1500.0

    knee = find_knee(measure, CapacitySpec(start_rps=10, factor=2.0, refine=0), 1000.0)
    assert knee.capacity == 80.0


def test_a_start_above_capacity_searches_down_and_the_max_stops_up() -> None:
    measure, tried = _service(30.0)
    knee = find_knee(measure, CapacitySpec(start_rps=100, factor=2.0, refine=0), 1000.0)
    assert tried == [100, 50, 25] and knee.capacity == 25.0
    measure, _ = _service(1e9)
    knee = find_knee(measure, CapacitySpec(start_rps=10, factor=10, max_rps=5000), 1000.0)
    assert knee.capacity == 1000.0 and "max_rps" in knee.why
    with pytest.raises(RuntimeError, match="no offered rate"):
        find_knee(lambda r: (r, 0.0, None), CapacitySpec(start_rps=10), 1000.0)


def _step(label: str, load: float, classes: dict[str, tuple[int, int, float]]) -> dict[str, Any]:
    per = {
        n: {"offered": o, "ok": k, "refused": o - k, "success_p99_ms": p}
        for n, (o, k, p) in classes.items()
    }
    offered = sum(o for o, _, _ in classes.values())
    ok = sum(k for _, k, _ in classes.values())
    steady = {"offered": offered, "ok": ok, "refused": offered - ok, "goodput_per_s": ok / 2}
    return {
        "label": label,
        "load": load,
        "valid": True,
        "host_bound": [],
        "steady": steady,
        "classes": per,
    }


def test_scenario_invariants_use_the_verdict_vocabulary() -> None:
    sf = load_scenario(EXAMPLE, env=ENV)
    steps = [
        _step("0.5x", 0.5, {"item": (60, 60, 40.0), "order": (30, 30, 90.0), "cart": (10, 10, 9)}),
        # order's p99 is past half of its 500 ms deadline
        _step("1x", 1.0, {"item": (120, 118, 60.0), "order": (60, 60, 300.0)}),
        _step("2x", 2.0, {"item": (240, 200, 10.0)}),
    ]
    lab = {
        "calibration": {"capacity": 100.0},
        "scenario_file": {
            "endpoints": [
                {"name": e.name, "class": e.traffic_class, "deadline": sf.deadline(e)}
                for e in sf.endpoints
            ],
            "invariants": [
                {"check": i.check, "threshold": i.threshold, "steps": list(i.steps),
                 "traffic_class": i.traffic_class}
                for i in sf.invariants
            ],
        },
        "runs": [{"configuration": "target", "scenario": "shop", "steps": steps}],
    }  # fmt: skip
    checks = scenario_checks(lab)
    by = {(c["check"], c["step"]): c for c in checks}
    assert by[("goodput >= 99% of offered", "0.5x")]["passed"]
    assert ("goodput >= 99% of offered", "1x") not in by  # below capacity only
    assert not by[("order: success p99 <= 0.5x its deadline", "1x")]["passed"]
    assert by[("order: success p99 <= 0.5x its deadline", "1x")]["limit"] == 250.0
    assert by[("cart: success p99 <= 0.5x its deadline", "0.5x")]["limit"] == 1000.0
    share = by[("checkout goodput >= 99% of its demand", "1x")]
    assert share["value"] == pytest.approx(98.89, abs=0.01) and not share["passed"]
    assert ("checkout goodput >= 99% of its demand", "2x") not in by  # steps = [0.5x, 1x]


def test_a_uuid_param_is_fresh_on_every_send_even_with_the_same_seed() -> None:
    """A host-bound step is measured again with the same seed; an idempotency key drawn
    from the seeded rng would then repeat and the server would replay, not work."""
    from brownout._lab.templates import Param, RequestTemplate

    template = RequestTemplate(
        "POST", "/orders", headers=(("idempotency-key", "{key}"),), params=(("key", Param("uuid")),)
    )
    first = [template.render(random.Random(7), "h", ()) for _ in range(50)]
    again = [template.render(random.Random(7), "h", ()) for _ in range(50)]
    assert len(set(first) | set(again)) == 100


PROXIED = """
version = 1
name = "proxied"
[proxies.inventory]
control = "127.0.0.1:7002"
[proxies.cache]
control = "http://127.0.0.1:7004"
[[endpoints]]
name = "home"
path = "/"
[[steps]]
label = "calm"
load = 1.0
[[steps]]
label = "slow"
load = 1.0
faults.inventory = { latency = 0.2, jitter = 0.05 }
[[steps]]
label = "lossy"
load = 1.0
faults.cache = { loss_rate = 0.1 }
"""


def test_each_step_sets_every_declared_proxy_and_clears_the_ones_it_does_not_name() -> None:
    from brownout._lab.runner import LabSettings, plan_for
    from brownout._lab.scenarios import from_file

    sf = parse_scenario(PROXIED, env={})
    assert [(x.name, x.host, x.port) for x in sf.proxies] == [
        ("inventory", "127.0.0.1", 7002),
        ("cache", "127.0.0.1", 7004),
    ]
    plan = plan_for(from_file(sf), LabSettings(), 100.0, Target("127.0.0.1", 8000, "/"), None)
    calls = {s.label: {(a.port, a.path): a.body for a in s.actions} for s in plan.steps}
    assert calls["warm-up"] == {(7002, "/faults"): {}, (7004, "/faults"): {}}
    assert calls["calm"] == {(7002, "/faults"): {}, (7004, "/faults"): {}}
    slow = calls["slow"][(7002, "/faults")]
    assert slow["latency"] == 0.2 and slow["jitter"] == 0.05
    assert calls["slow"][(7004, "/faults")] == {}
    assert calls["lossy"][(7002, "/faults")] == {}
    assert calls["lossy"][(7004, "/faults")]["loss_rate"] == 0.1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("faults.inventory", "faults.db"), "steps[1].faults.db"),
        (("latency = 0.2", "latnecy = 0.2"), "latnecy"),
        (("latency = 0.2", "latency = -1"), "latency"),
        (('control = "127.0.0.1:7002"', 'control = "127.0.0.1"'), "proxies.inventory.control"),
        (('control = "127.0.0.1:7002"', 'control = "ftp://h:1"'), "proxies.inventory.control"),
    ],
)
def test_a_bad_proxy_or_fault_names_its_field(change: tuple[str, str], field: str) -> None:
    with pytest.raises(ScenarioFileError) as err:
        parse_scenario(PROXIED.replace(*change), "bad.toml", env={})
    assert field in str(err.value)


def test_a_step_whose_faults_could_not_be_set_fails_the_run() -> None:
    lab = {
        "calibration": {"capacity": 100},
        "scenario_file": {"endpoints": [], "invariants": []},
        "runs": [
            {"configuration": "target", "scenario": "s", "steps": [
                {"label": "slow", "failed_actions": ["127.0.0.1:7002/faults: unreachable"],
                 "valid": True, "host_bound": []},
            ]},
        ],
    }  # fmt: skip
    (check,) = scenario_checks(lab)
    assert not check["passed"] and "7002/faults: unreachable" in check["check"]
