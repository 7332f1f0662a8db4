"""Scenarios as data: sequences of phases in units of the measured capacity.

A `Scenario` is a tuple of `Phase` objects; the runner turns each phase into a generator
`LoadStep` once capacity is known (``load=4.0`` means four times the calibrated capacity),
prepends a warm-up and resolves `DependencyChange` into calls to the demo backend's admin
endpoint. New scenarios are new data: `register` adds one to `SCENARIOS`. `Phase.client`
describes client behaviour: ``{"retries": 3, "backoff": 0.1}`` naive clients retrying each
failure 3 times; add ``"budget": 0.1`` for brownout-style clients (a `RetryBudget`, jitter,
and the do-not-retry marker honoured).

The outbound scenarios (retry storm, partial errors, outage and recovery) and the degraded
scenario are opt-in (``--scenarios``), so the default run stays under five minutes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "DEFAULT_SCENARIOS",
    "OPT_IN_SCENARIOS",
    "QUICK_SCENARIOS",
    "SCENARIOS",
    "DependencyChange",
    "Phase",
    "Scenario",
    "quick_variant",
    "register",
]

INTERACTIVE = (("interactive", 1.0),)


@dataclass(frozen=True)
class DependencyChange:
    """Change the demo dependency when a phase starts, relative to its original shape."""

    latency_factor: float = 1.0
    concurrency_factor: float = 1.0
    error_rate: float = 0.0
    """Share of requests the dependency answers 503 at once."""
    down: bool = False
    """The dependency answers every request 503 (an outage)."""

    def body(self, base_latency: float, base_concurrency: int) -> dict[str, float | int]:
        # A change describes the whole state: failures not named are cleared by the backend.
        body: dict[str, float | int] = {
            "latency": base_latency * self.latency_factor,
            "concurrency": max(1, round(base_concurrency * self.concurrency_factor)),
        }
        if self.error_rate:
            body["error_rate"] = self.error_rate
        if self.down:
            body["down"] = True
        return body


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

    def runs_on(self, configuration: str) -> bool:
        """True when this scenario is measured on ``configuration``."""
        return self.configurations is None or configuration in self.configurations


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    """Add ``scenario`` to `SCENARIOS` (by name; a later one replaces an earlier one)."""
    SCENARIOS[scenario.name] = scenario
    return scenario


RAMP_LOADS = (0.5, 0.8, 1.0, 2.0, 4.0, 10.0)

register(
    Scenario(
        "ramp",
        "Ramp past the breaking point",
        "Offered load from 0.5x to 10x of the measured capacity (T1): goodput should "
        "plateau at capacity and stay flat.",
        tuple(Phase(f"{x:g}x", x) for x in RAMP_LOADS),
    )
)
register(
    Scenario(
        "priority",
        "Priority mix at 4x",
        "4x capacity offered: interactive (CRITICAL) at half the capacity, batch (SHEDDABLE) "
        "the rest; interactive goodput must hold (S3).",
        (Phase("4x mix", 4.0, (("interactive", 0.125), ("batch", 0.875)), steps=1.5),),
    )
)
register(
    Scenario(
        "slow-dependency",
        "Slow dependency",
        "Constant load at 0.8x; the dependency's latency rises 4x, then recovers (T2).",
        (
            Phase("before", 0.8),
            Phase("4x latency", 0.8, dependency=DependencyChange(latency_factor=4.0)),
            Phase("recovered", 0.8, dependency=DependencyChange()),
        ),
        needs_dependency=True,
    )
)
register(
    Scenario(
        "capacity-loss",
        "Capacity loss",
        "Constant load at 0.8x; half of the dependency's capacity disappears (T2).",
        (
            Phase("before", 0.8),
            Phase(
                "half capacity",
                0.8,
                steps=1.5,
                dependency=DependencyChange(concurrency_factor=0.5),
            ),
        ),
        needs_dependency=True,
    )
)
register(
    Scenario(
        "health",
        "Health checks under a 10x flood",
        "10x capacity of interactive work plus a trickle of health checks: the health "
        "endpoint must keep answering quickly (S7).",
        (Phase("10x + health", 10.0, (("interactive", 0.99), ("health", 0.01))),),
    )
)

register(
    Scenario(
        "cpu-starved",
        "CPU-starved front",
        "4x then 10x capacity while a CPU hog (a pure spinner at nice 0, its own process) "
        "shares the front's core from the warm-up on: a noisy neighbour. brownout-adaptive "
        "must keep goodput >= 90% of capacity and >= uvicorn --limit-concurrency's, success "
        "p99 <= half the deadline. Not run unprotected (it collapses without a hog).",
        (Phase("4x + hog", 4.0), Phase("10x + hog", 10.0)),
        needs_dependency=True,
        hog=True,
        configurations=("uvicorn-limit", "brownout-fixed", "brownout-adaptive"),
    )
)

NAIVE_CLIENTS: Mapping[str, Any] = {"retries": 3, "backoff": 0.1}
"""Clients that retry every failure 3 times after 0.1, 0.2, 0.4 s: no budget, no jitter."""
BUDGETED_CLIENTS: Mapping[str, Any] = {"retries": 3, "backoff": 0.1, "budget": 0.1}
"""The same clients with brownout's habits: a 10% retry budget, full jitter, the marker."""
OUTBOUND = (("outbound", 1.0),)
RECOMMENDATIONS = (("recommendations", 1.0),)

register(
    Scenario(
        "retry-storm",
        "Retry storm",
        "2x capacity on a route that calls the dependency; clients retry each failure 3 "
        "times, first naively, then with a 10% retry budget. Unprotected, the front also "
        "retries naively (3 attempts); protected, through brownout's Dependency (R1, R3, T3). "
        "The dependency is saturated in every configuration (the front's connection pool "
        "caps what reaches it): the storm shows in the client retries the front must absorb "
        "and in the goodput left.",
        (
            Phase("naive clients", 2.0, OUTBOUND, client=NAIVE_CLIENTS),
            Phase("budgeted clients", 2.0, OUTBOUND, client=BUDGETED_CLIENTS),
        ),
        needs_dependency=True,
        outbound=True,
    )
)
register(
    Scenario(
        "partial-errors",
        "Partial errors",
        "0.5x capacity; the dependency answers 30% of requests 503. The front retries: "
        "naively (3 attempts) unprotected, under a 20% retry budget protected (R3, T3).",
        (
            Phase("healthy", 0.5, OUTBOUND),
            Phase(
                "30% errors",
                0.5,
                OUTBOUND,
                steps=1.5,
                dependency=DependencyChange(error_rate=0.3),
            ),
        ),
        needs_dependency=True,
        outbound=True,
    )
)
register(
    Scenario(
        "outage",
        "Outage and recovery",
        "0.5x capacity from naive retrying clients; the dependency answers everything 503 "
        "for one step, then returns. Compare the peak per-second load reaching it after it "
        "returns with the steady state: no thundering herd (R5, T3).",
        (
            Phase("steady", 0.5, OUTBOUND, client=NAIVE_CLIENTS),
            Phase(
                "outage",
                0.5,
                OUTBOUND,
                client=NAIVE_CLIENTS,
                dependency=DependencyChange(down=True),
            ),
            Phase("returned", 0.5, OUTBOUND, client=NAIVE_CLIENTS, dependency=DependencyChange()),
        ),
        needs_dependency=True,
        outbound=True,
    )
)
register(
    Scenario(
        "degraded",
        "Slow dependency served degraded",
        "0.8x capacity on recommendations; the dependency's latency rises 4x, then recovers. "
        "Protected, the declared mode 'recommendations' serves them from a stale cache while "
        "the dependency is slow; degraded goodput is reported apart (G1-G3).",
        (
            Phase("before", 0.8, RECOMMENDATIONS),
            Phase(
                "4x latency",
                0.8,
                RECOMMENDATIONS,
                dependency=DependencyChange(latency_factor=4.0),
            ),
            Phase("recovered", 0.8, RECOMMENDATIONS, dependency=DependencyChange()),
        ),
        needs_dependency=True,
        outbound=True,
    )
)
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
