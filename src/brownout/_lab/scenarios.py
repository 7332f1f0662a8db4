"""Scenarios as data: sequences of phases in units of the measured capacity.

The embedded demo's scenarios are scenario files (``scenario_files/*.toml``, the format of
`brownout._lab.scenario_file`), loaded into `SCENARIOS` at import. A `Scenario` is a tuple
of `Phase` objects; the runner turns each phase into a generator `LoadStep` once capacity is
known (``load=4.0`` means four times the calibrated capacity),
prepends a warm-up and resolves `DependencyChange` into calls to the demo backend's admin
endpoint. New scenarios are new data: `register` adds one to `SCENARIOS`. `Phase.client`
describes client behaviour: ``{"retries": 3, "backoff": 0.1}`` naive clients retrying each
failure 3 times; add ``"budget": 0.1`` for brownout-style clients (a `RetryBudget`, jitter,
and the do-not-retry marker honoured).

The outbound scenarios (retry storm, partial errors, outage and recovery) and the degraded
scenario are opt-in (``--scenarios``): each would lengthen the default run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from .scenario_file import ScenarioFile, parse_scenario

__all__ = [
    "DEFAULT_SCENARIOS",
    "DEMO_FILES",
    "OPT_IN_SCENARIOS",
    "QUICK_SCENARIOS",
    "SCENARIOS",
    "DependencyChange",
    "Phase",
    "Scenario",
    "demo_file",
    "from_file",
    "quick_variant",
    "register",
]

INTERACTIVE = (("interactive", 1.0),)


@dataclass(frozen=True)
class DependencyChange:
    """Change the demo dependency when a phase starts, relative to its original shape.

    ``latency_factor`` and ``concurrency_factor`` change the dependency itself (its service
    time and its slots: its capacity); ``error_rate`` and ``down`` are the network's, injected
    by `brownout proxy` between the front and the dependency (`faults`)."""

    latency_factor: float = 1.0
    concurrency_factor: float = 1.0
    error_rate: float = 0.0
    """Share of requests the proxy answers 503 at once."""
    down: bool = False
    """The proxy resets every request's connection (an outage)."""

    def body(self, base_latency: float, base_concurrency: int) -> dict[str, float | int]:
        """The backend's ``POST /admin`` body: its whole shape, so omissions restore it."""
        return {
            "latency": base_latency * self.latency_factor,
            "concurrency": max(1, round(base_concurrency * self.concurrency_factor)),
        }

    def faults(self) -> dict[str, float]:
        """The proxy's ``PUT /faults`` body (a `brownout._lab.faults.Faults`): a setting
        replaces the previous one whole, so a change that names no fault clears them."""
        faults: dict[str, float] = {}
        if self.error_rate:
            faults["error_rate"] = self.error_rate
        if self.down:
            faults["reset_rate"] = 1.0
        return faults

    @property
    def network(self) -> bool:
        """True when the change needs the proxy."""
        return bool(self.error_rate or self.down)


@dataclass(frozen=True)
class Phase:
    """One step of a scenario."""

    label: str
    load: float
    """Offered load as a multiple of the measured capacity."""
    mix: tuple[tuple[str, float], ...] = INTERACTIVE
    """Traffic classes (``interactive``, ``batch``, ``health``) and their shares."""
    steps: float = 1.0
    """Length in units of the run's step length (at least 3x the client deadline)."""
    dependency: DependencyChange | None = None
    """Applied to the demo backend as the phase starts (demo only)."""
    client: Mapping[str, Any] = field(default_factory=dict)
    """Client behaviour: ``retries`` (per failed request), ``backoff`` (seconds before the
    first retry, doubling), ``budget`` (a retry-budget ratio: brownout-style clients)."""
    faults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """A scenario file's faults per declared proxy (`Scenario.proxies`) for this phase."""


@dataclass(frozen=True)
class Scenario:
    """A named sequence of phases, run on a fresh demo system per configuration."""

    name: str
    title: str
    description: str
    phases: tuple[Phase, ...]
    needs_dependency: bool = False
    """True when the scenario needs the demo system (a phase changes its dependency, or a hog
    shares its front's core): not possible against ``--target``."""
    outbound: bool = False
    """Report what reached the dependency (attempts per second, amplification, peak)."""
    hog: bool = False
    """A CPU hog shares the front's core for the whole run (`brownout._lab.hog`)."""
    configurations: tuple[str, ...] | None = None
    """The configurations it runs on (None: every one asked for)."""
    proxies: tuple[tuple[str, str, int], ...] = ()
    """A scenario file's proxies as (name, host, port) of their control endpoints: every
    phase sets each one's faults (none where the phase names none)."""

    def runs_on(self, configuration: str) -> bool:
        """True when this scenario is measured on ``configuration``."""
        return self.configurations is None or configuration in self.configurations

    @property
    def proxied(self) -> bool:
        """True when a phase injects network faults: the demo puts the proxy in the path."""
        return any(p.dependency is not None and p.dependency.network for p in self.phases)


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    """Add ``scenario`` to `SCENARIOS` (by name; a later one replaces an earlier one)."""
    SCENARIOS[scenario.name] = scenario
    return scenario


def from_file(sf: ScenarioFile) -> Scenario:
    """The `Scenario` a scenario file describes (its loads still multiples of capacity)."""
    phases = []
    for st in sf.steps:
        client: dict[str, Any] = {}
        if st.retries:
            client = {"retries": st.retries, "backoff": st.backoff}
            if st.budget is not None:
                client["budget"] = st.budget
        dependency = None if st.dependency is None else DependencyChange(**st.dependency)
        phases.append(
            Phase(
                st.label,
                st.load,
                st.mix or sf.mix,
                st.steps,
                dependency,
                client,
                {name: dict(f) for name, f in st.faults},
            )
        )
    return Scenario(
        sf.name,
        sf.title,
        sf.description,
        tuple(phases),
        needs_dependency=sf.demo.needs_dependency,
        outbound=sf.demo.outbound,
        hog=sf.demo.hog,
        configurations=sf.demo.configurations,
        proxies=tuple((x.name, x.host, x.port) for x in sf.proxies),
    )


DEMO_FILES = (
    "ramp",
    "priority",
    "slow-dependency",
    "capacity-loss",
    "health",
    "cpu-starved",
    "retry-storm",
    "partial-errors",
    "outage",
    "degraded",
)
"""The embedded demo's scenario files (package data in ``scenario_files/``), in order."""


def demo_file(name: str) -> ScenarioFile:
    """One of the demo's scenario files, parsed (no environment: they use none)."""
    text = resources.files(__package__).joinpath("scenario_files", f"{name}.toml").read_text()
    return parse_scenario(text, f"scenario_files/{name}.toml", env={})


for _name in DEMO_FILES:
    register(from_file(demo_file(_name)))

OPT_IN_SCENARIOS = ("retry-storm", "partial-errors", "outage", "degraded")
"""Scenarios run only when named with ``--scenarios`` (each lengthens the run)."""

QUICK_RAMP_LOADS = (0.8, 2.0, 4.0, 10.0)


def quick_variant(scenario: Scenario) -> Scenario:
    """The ``--quick`` form of a scenario: the ramp keeps only the steps the verdict checks."""
    if scenario.name != "ramp":
        return scenario
    return replace(scenario, phases=tuple(p for p in scenario.phases if p.load in QUICK_RAMP_LOADS))


DEFAULT_SCENARIOS = (
    "ramp",
    "priority",
    "slow-dependency",
    "capacity-loss",
    "health",
    "cpu-starved",
)
QUICK_SCENARIOS = ("ramp", "priority")
