"""Run the lab: calibrate, then every scenario against every configuration.

The result is a plain, JSON-ready dict (see `run_lab`), so the report can be rendered, tested
and re-rendered from the raw JSON without running anything.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from .._priority import parse_priority
from .._propagation import PRIORITY_HEADER
from .generator import (
    AdminCall,
    Calibration,
    LoadPlan,
    LoadStep,
    PlanResult,
    StepResult,
    TrafficClass,
)
from .hog import cpu_hog
from .hostcpu import cpu_shares, host_bound
from .knee import KneeStep, find_knee
from .process import GeneratorProcess, usable_cpus
from .protect import FIXED_LIMIT
from .scenario_file import BaseUrl, ProxySpec, ScenarioFile
from .scenarios import SCENARIOS, Phase, Scenario, from_file
from .server_view import ServerWatch, add_server_view, resolve_metrics_url
from .servers import start_demo
from .system_checks import HERD_BIN_SECONDS, SystemObserver
from .tally import Tally

__all__ = [
    "CONFIGURATIONS",
    "Configuration",
    "LabSettings",
    "Target",
    "file_classes",
    "host_bound_steps",
    "plan_for",
    "run_lab",
    "run_scenario_file",
    "settings_for",
    "summarize_plan",
]

HEALTH = "health"
"""The traffic class of health checks, reported apart from the work."""
SYNC_SCENARIOS = ("ramp",)
"""What the sync configurations run: the plateau (brownout's also the health flood)."""
UVICORN_LIMIT = 2 * FIXED_LIMIT
"""``--limit-concurrency`` for the uvicorn configuration (counts connections, not requests)."""


@dataclass(frozen=True)
class Configuration:
    """One way of running the front service."""

    name: str
    title: str
    mode: str
    limit_concurrency: int | None = None
    brownout: bool = False
    """True when brownout protects it: the lab's pass/fail invariants apply."""
    sync: bool = False
    """The front is the Flask app under gunicorn gthread (`brownout._lab.sync_front`)."""
    scenarios: tuple[str, ...] | None = None
    """The scenarios it runs (None: every one asked for)."""

    def runs(self, scenario: Scenario) -> bool:
        """True when ``scenario`` is measured on this configuration (both must agree)."""
        mine = self.scenarios is None or scenario.name in self.scenarios
        return mine and scenario.runs_on(self.name)


CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("unprotected", "unprotected", "unprotected"),
        Configuration(
            "uvicorn-limit",
            f"uvicorn --limit-concurrency {UVICORN_LIMIT}",
            "unprotected",
            limit_concurrency=UVICORN_LIMIT,
        ),
        Configuration("brownout-fixed", f"brownout FixedLimit({FIXED_LIMIT})", "fixed", None, True),
        Configuration("brownout-adaptive", "brownout Gradient2Limit()", "adaptive", None, True),
        # The sync front costs more CPU per request: the ramp and the flood are its figure.
        Configuration(
            "sync-unprotected",
            "Flask + gunicorn, unprotected",
            "unprotected",
            sync=True,
            scenarios=SYNC_SCENARIOS,
        ),
        Configuration(
            "sync-brownout",
            f"Flask + gunicorn, brownout FixedLimit({FIXED_LIMIT})",
            "fixed",
            brownout=True,
            sync=True,
            scenarios=(*SYNC_SCENARIOS, "health"),
        ),
    )
}


@dataclass(frozen=True)
class LabSettings:
    """Timing of a run: by default each step's steady state lasts 5 s (step less settle)."""

    deadline: float = 1.0
    """Client deadline per request, seconds."""
    step_seconds: float = 6.0
    settle_seconds: float = 1.0
    """Seconds at the start of each step excluded from steady-state figures."""
    warmup_seconds: float = 1.5
    calibration_seconds: float = 1.0
    """Per concurrency level of the closed-loop calibration."""
    arrivals: str = "constant"
    max_connections: int = 1024
    reruns: int = 2
    """Scenario runs measured again because a step was host-bound (per lab run)."""
    backend_concurrency: int = 8
    backend_latency: float = 0.040
    seed: int = 1
    drill: str | None = None
    """A declared degraded mode of the demo front forced on for the whole run (``--drill``)."""
    server_view: bool = False
    """The demo's protected async fronts serve brownout's metrics, scraped for the server's
    view (``--server-view``; off by default: the front then tallies its events)."""

    @classmethod
    def quick(cls) -> LabSettings:
        return cls(
            deadline=0.5,
            step_seconds=1.5,
            settle_seconds=0.5,
            warmup_seconds=0.5,
            calibration_seconds=0.3,
            reruns=1,
        )


@dataclass(frozen=True)
class Target:
    """Where the traffic goes: the demo's front, or a user's own service (``--target``)."""

    host: str
    port: int
    path: str
    health_path: str | None = None
    tls: bool = False
    tls_verify: bool = True
    host_header: str | None = None
    """The ``host`` header (None: ``host:port``)."""
    metrics_url: str | None = None
    """brownout's Prometheus metrics of the service, scraped for the server's view (None: none)."""
    metrics_source: str | None = None
    """Only the metrics of this source (a bulkhead's or edge's name; None: all summed)."""


def classes_for(target: Target) -> tuple[TrafficClass, ...]:
    """Traffic classes: the demo has separate routes; a user's service gets one path."""
    if target.path == "":
        return (
            TrafficClass("interactive", "/api/interactive"),
            TrafficClass("batch", "/api/batch"),
            TrafficClass("health", "/healthz"),
            TrafficClass("outbound", "/api/outbound"),
            TrafficClass("recommendations", "/api/recommendations"),
        )
    classes = [TrafficClass("interactive", target.path)]
    if target.health_path:
        classes.append(TrafficClass("health", target.health_path))
    return tuple(classes)


def plan_for(
    scenario: Scenario,
    settings: LabSettings,
    capacity: float,
    target: Target,
    backend: tuple[str, int] | None,
    classes: tuple[TrafficClass, ...] = (),
    proxy: tuple[str, int] | None = None,
) -> LoadPlan:
    """The generator's plan for ``scenario``: a warm-up, then each phase at its load.

    ``classes``: a scenario file's endpoints (default: `classes_for` ``target``); the warm-up
    then offers the first phase's mix rather than the demo's interactive route.
    ``backend``: the demo backend's admin address; ``proxy``: the control endpoint of the
    `brownout proxy` in front of it, where each phase's network faults are set."""
    if backend is not None and proxy is None and scenario.proxied:
        raise ValueError(f"{scenario.name}: its network faults need the proxy's control address")
    warmup = LoadStep(
        "warm-up",
        0.5 * capacity,
        settings.warmup_seconds,
        scenario.phases[0].mix if classes else (("interactive", 1.0),),
        measured=False,
        arrivals=settings.arrivals,
        actions=_proxy_calls(scenario, None),
    )

    def step(phase: Phase) -> LoadStep:
        actions: tuple[AdminCall, ...] = ()
        if phase.dependency is not None and backend is not None:
            body = phase.dependency.body(settings.backend_latency, settings.backend_concurrency)
            actions = (AdminCall(backend[0], backend[1], "/admin", dict(body)),)
            if proxy is not None:
                faults = dict(phase.dependency.faults())
                actions += (AdminCall(proxy[0], proxy[1], "/faults", faults),)
        actions += _proxy_calls(scenario, phase)
        client = phase.client
        budget = client.get("budget")
        return LoadStep(
            phase.label,
            phase.load * capacity,
            settings.step_seconds * phase.steps,
            phase.mix,
            settle=settings.settle_seconds,
            arrivals=settings.arrivals,
            actions=actions,
            retries=int(client.get("retries", 0)),
            retry_backoff=float(client.get("backoff", 0.1)),
            retry_budget=float(budget) if budget is not None else None,
        )

    return LoadPlan(
        target.host,
        target.port,
        classes or classes_for(target),
        (warmup, *(step(p) for p in scenario.phases)),
        settings.deadline,
        max_connections=settings.max_connections,
        seed=settings.seed,
        tls=target.tls,
        tls_verify=target.tls_verify,
        host_header=target.host_header,
    )


class ProxyUnreachable(RuntimeError):
    """A proxy the scenario file declares does not answer on its control endpoint."""


def clear_proxies(
    proxies: Sequence[ProxySpec], stage: Callable[[str], None], *, strict: bool = True
) -> None:
    """Set every declared proxy to no fault (``PUT /faults {}``): before a run, which also
    checks each answers (`ProxyUnreachable` when ``strict``), and after it."""
    for x in proxies:
        request = urllib.request.Request(
            x.control + "/faults", data=b"{}", method="PUT",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                r.read()
        except (OSError, ValueError) as e:
            if strict:
                raise ProxyUnreachable(
                    f"proxy {x.name!r}: its control endpoint {x.control} did not answer"
                    f" ({e}); start it with `brownout proxy ... --control {x.host}:{x.port}`"
                ) from None
            stage(f"proxy {x.name!r}: could not clear its faults after the run ({e})")
            continue
        stage(f"proxy {x.name!r} ({x.control}): no fault")


def _proxy_calls(scenario: Scenario, phase: Phase | None) -> tuple[AdminCall, ...]:
    """Set every proxy a scenario file declares to ``phase``'s faults (None: no fault)."""
    faults = phase.faults if phase is not None else {}
    return tuple(
        AdminCall(host, port, "/faults", dict(faults.get(name, {})))
        for name, host, port in scenario.proxies
    )


def summarize_step(
    step: StepResult, load: float, on_front_core: Sequence[str] = ()
) -> dict[str, Any]:
    """A step as JSON: steady-state figures overall and per class, whole-step accounting,
    CPU shares over the steady state (``on_front_core``: the roles pinned to the front's
    core, see `brownout._lab.hostcpu.cpu_shares`) and why the step is host-bound, if it is."""
    seconds = step.steady_seconds
    # Health checks are not work: they appear per class, never in goodput or % of capacity.
    steady = Tally.merged(t for name, t in step.steady.items() if name != HEALTH)
    whole = Tally.merged(t for name, t in step.whole.items() if name != HEALTH)
    cpu = cpu_shares(*step.cpu, on_front_core) if step.cpu is not None else None
    lateness_ms = round(step.lateness_p99 * 1000, 2)
    return {
        "label": step.label,
        "load": load,
        "rate": round(step.rate, 1),
        "duration": step.duration,
        "settle": step.settle,
        "start": round(step.start, 3),
        "steady_seconds": round(seconds, 3),
        "valid": step.valid,
        "lateness_p99_ms": lateness_ms,
        "cpu": cpu,
        "host_bound": host_bound(cpu, not step.valid, lateness_ms),
        "connections_opened": step.connections_opened,
        "steady": steady.summary(seconds),
        "classes": {name: t.summary(seconds) for name, t in sorted(step.steady.items())},
        "whole": whole.summary(step.duration),
        "retries": step.retries_steady.summary(seconds),
        "retries_withheld": step.retries_withheld,
        "failed_actions": step.failed_actions,
    }


def summarize_plan(
    result: PlanResult, scenario: Scenario, on_front_core: Sequence[str] = ()
) -> dict[str, Any]:
    """The measured steps of a plan, each labelled with its load, plus the timeline."""
    measured = [s for s in result.steps if s.measured]
    steps = [summarize_step(s, p.load, on_front_core) for s, p in zip(measured, scenario.phases)]
    return {
        "steps": steps,
        "timeline": result.timeline,
        "bin_seconds": result.bin_seconds,
        "connections_opened": result.connections_opened,
        "unresolved": result.unresolved,
        "origin": result.origin,
    }


def add_dependency_figures(run: dict[str, Any], backend: dict[str, Any]) -> None:
    """Attach what reached the dependency to ``run`` (from the backend's per-bin arrivals).

    Per step: ``attempts_per_s`` in steady state, ``amplification`` (attempts per original
    request offered), ``peak_1s`` (the busiest one-second window of the whole step, per
    second), ``peak_100ms`` (arrivals in its busiest `HERD_BIN_SECONDS` bin), and for the run
    a ``dependency_timeline`` of attempts/s per timeline bin. The backend's bins are slices
    of ``time.monotonic()``, the clock the generator's ``origin`` comes from (one clock per
    machine on Linux).
    """
    width = float(backend.get("arrival_bin", 0.0) or 0.0)
    arrivals = {int(k): int(n) for k, n in backend.get("arrivals", [])}
    if width <= 0 or "origin" not in run:
        return
    origin = float(run["origin"])

    def count(start: float, end: float) -> int:
        first = round((origin + start) / width)
        last = round((origin + end) / width)
        return sum(arrivals.get(k, 0) for k in range(first, last))

    per_window = max(1, round(1.0 / width))
    per_herd_bin = max(1, round(HERD_BIN_SECONDS / width))
    for step in run["steps"]:
        start = float(step["start"])
        duration = float(step["duration"])
        settle = float(step["settle"])
        steady_seconds = max(duration - settle, 1e-9)
        attempts = count(start + settle, start + duration)
        originals = float(step["steady"]["offered_per_s"])
        per_s = attempts / steady_seconds
        first = round((origin + start) / width)
        last = round((origin + start + duration) / width)
        bins = [arrivals.get(k, 0) for k in range(first, last)]
        windows = [sum(bins[i : i + per_window]) for i in range(max(1, len(bins) - per_window + 1))]
        step["dependency"] = {
            "attempts": attempts,
            "attempts_per_s": round(per_s, 1),
            "amplification": round(per_s / originals, 2) if originals > 0 else None,
            "peak_1s": round(max(windows) / (per_window * width), 1) if bins else 0.0,
            "peak_100ms": max(
                (sum(bins[i : i + per_herd_bin]) for i in range(0, len(bins), per_herd_bin)),
                default=0,
            ),
        }
    bin_seconds = float(run["bin_seconds"])
    run["dependency_timeline"] = [
        round(count(i * bin_seconds, (i + 1) * bin_seconds) / bin_seconds, 1)
        for i in range(len(run["timeline"]))
    ]


def _backend_stats(url: str, path: str = "/admin/stats") -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + path, timeout=2) as r:
            stats: dict[str, Any] = json.loads(r.read())
            return stats
    except (OSError, ValueError):
        return {}


def _proxy_stats(control: tuple[str, int]) -> dict[str, Any]:
    """What the proxy in front of the demo's dependency did (requests, faults injected)."""
    stats = _backend_stats(f"http://{control[0]}:{control[1]}", "/stats")
    keep = ("requests", "connections", "upstream_failures", "faults_injected")
    return {k: stats[k] for k in keep if k in stats}


def cpu_layout() -> tuple[list[int], list[int], list[int]]:
    """(generator, front, backend) cores: the generator alone on one core where possible."""
    cpus = usable_cpus()
    if len(cpus) >= 3:
        return [cpus[0]], [cpus[1]], cpus[2:]
    if len(cpus) == 2:
        return [cpus[0]], [cpus[1]], [cpus[1]]
    return cpus, cpus, cpus


ProgressHook = Callable[[str, str, float, float], None]
"""(configuration, scenario, seconds of schedule done, seconds of schedule in the plan)."""


@dataclass(frozen=True)
class _Bench:
    """What every measurement of one lab run shares."""

    gen: GeneratorProcess
    settings: LabSettings
    capacity: float
    target: Target | None
    front_cpus: list[int]
    backend_cpus: list[int]
    on_progress: ProgressHook | None
    classes: tuple[TrafficClass, ...] = ()
    """A scenario file's endpoints (empty: `classes_for` the target)."""


def _execute(
    bench: _Bench,
    config: Configuration,
    scenario: Scenario,
    plan: LoadPlan,
    server: ServerWatch | None = None,
) -> PlanResult:
    """Run ``plan``; ``server``: told each measured step's steady-window edges as it starts."""
    starts = [0.0]
    for st in plan.steps:
        starts.append(starts[-1] + st.duration)
    begun: set[int] = set()

    def progress(index: int, elapsed: float, counts: dict[str, int]) -> None:
        step = plan.steps[index]
        if server is not None and index not in begun and step.measured:
            begun.add(index)
            began = time.monotonic() - elapsed
            server.expect(began + step.settle, began + step.duration)
        if bench.on_progress is not None:
            done = starts[index] + min(elapsed, plan.steps[index].duration)
            bench.on_progress(config.name, scenario.name, done, starts[-1])

    return bench.gen.run(plan, progress)


def _measure(bench: _Bench, config: Configuration, scenario: Scenario) -> dict[str, Any]:
    """One scenario on one configuration, on fresh demo processes (or the user's target)."""
    settings = bench.settings
    backend_stats: dict[str, Any] = {}
    on_front_core: list[str] = []
    server: ServerWatch | None = None
    if bench.target is not None:
        plan = plan_for(scenario, settings, bench.capacity, bench.target, None, bench.classes)
        if bench.target.metrics_url:
            server = ServerWatch(bench.target.metrics_url, bench.target.metrics_source)
        with server.running() if server is not None else contextlib.nullcontext():
            result = _execute(bench, config, scenario, plan, server)
    else:
        with contextlib.ExitStack() as stack:
            demo = stack.enter_context(
                start_demo(
                    config.mode,
                    limit_concurrency=config.limit_concurrency,
                    concurrency=settings.backend_concurrency,
                    latency=settings.backend_latency,
                    backend_cpus=bench.backend_cpus,
                    front_cpus=bench.front_cpus,
                    drill=settings.drill,
                    sync=config.sync,
                    metrics=settings.server_view and config.brownout and not config.sync,
                    proxy=scenario.proxied,
                )
            )
            watch = [("front", demo.front.serving_pid), ("dependency", demo.backend.proc.pid)]
            on_front_core = ["front"]
            if bench.backend_cpus == bench.front_cpus:
                on_front_core.append("dependency")
            if scenario.hog:
                # The hog is part of the scenario: its share counts with the lab's processes.
                watch.append(("hog", stack.enter_context(cpu_hog(bench.front_cpus))))
                on_front_core.append("hog")
            front = Target("127.0.0.1", demo.front.port, "")
            backend = ("127.0.0.1", demo.backend.port)
            plan = plan_for(
                scenario, settings, bench.capacity, front, backend, proxy=demo.proxy_control
            )
            # The core's busy share means one core: with several front cores it is not read.
            core = bench.front_cpus[0] if len(bench.front_cpus) == 1 else None
            plan = replace(plan, watch=tuple(watch), watch_core=core)
            if settings.server_view and config.brownout and not config.sync:
                server = ServerWatch(demo.front.url + "/metrics")
            with server.running() if server is not None else contextlib.nullcontext():
                result = _execute(bench, config, scenario, plan, server)
            backend_stats = _backend_stats(demo.backend.url)
            if demo.proxy_control is not None:
                backend_stats["proxy"] = _proxy_stats(demo.proxy_control)
    run: dict[str, Any] = {"configuration": config.name, "scenario": scenario.name}
    run |= summarize_plan(result, scenario, on_front_core)
    run["on_front_core"] = on_front_core
    if server is not None:
        add_server_view(run, server, result.origin)
    if scenario.outbound:
        add_dependency_figures(run, backend_stats)
    backend_stats.pop("arrivals", None)  # summarized above; raw bins would bloat the JSON
    run["backend"] = backend_stats
    return run


def run_lab(
    settings: LabSettings,
    configurations: Sequence[Configuration],
    scenarios: Sequence[Scenario],
    *,
    target: Target | None = None,
    on_progress: ProgressHook | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Calibrate, run every scenario on every configuration, and return the raw results.

    With ``target`` (a user's service) there is one configuration, ``target``, and no demo.
    A scenario with a host-bound step (the generator late, or a process saturated: see
    `brownout._lab.hostcpu`) is measured once more, up to ``settings.reruns`` times per lab
    run; the attempt with fewer host-bound steps is kept and ``attempts`` says how many were
    made. A scenario limited to some configurations (`Scenario.runs_on`) skips the others, and
    a configuration limited to some scenarios (`Configuration.scenarios`) those it does not run.
    """
    gen_cpus, front_cpus, backend_cpus = cpu_layout()
    stage = on_stage or (lambda _msg: None)
    runs: list[dict[str, Any]] = []
    reruns_left = settings.reruns
    with GeneratorProcess(gen_cpus) as gen:
        stage("calibrating capacity (closed loop, doubling concurrency)")
        if target is None:
            with start_demo(
                "unprotected",
                concurrency=settings.backend_concurrency,
                latency=settings.backend_latency,
                backend_cpus=backend_cpus,
                front_cpus=front_cpus,
            ) as demo:
                calibration = gen.calibrate(
                    host="127.0.0.1",
                    port=demo.front.port,
                    path="/api/interactive",
                    level_seconds=settings.calibration_seconds,
                )
        else:
            calibration = gen.calibrate(
                host=target.host,
                port=target.port,
                path=target.path,
                level_seconds=settings.calibration_seconds,
            )
        if calibration.capacity <= 0:
            raise RuntimeError("calibration saw no successful response: is the service up?")
        stage(
            f"capacity {calibration.capacity:.0f} requests/s, "
            f"service time {calibration.service_time:.4f}s"
        )
        bench = _Bench(
            gen, settings, calibration.capacity, target, front_cpus, backend_cpus, on_progress
        )
        for config in configurations:
            for scenario in scenarios:
                if not config.runs(scenario):
                    stage(f"{config.title}: {scenario.title}: not run on this configuration")
                    continue
                stage(f"{config.title}: {scenario.title}")
                run, reruns_left = _measure_again_if_bound(
                    bench, config, scenario, stage, reruns_left
                )
                runs.append(run)
    return {
        "settings": asdict(settings),
        "target": asdict(target) if target is not None else None,
        "calibration": _calibration_dict(calibration),
        "configurations": [asdict(c) for c in configurations],
        "scenarios": [
            {
                "name": s.name,
                "title": s.title,
                "description": s.description,
                "outbound": s.outbound,
            }
            for s in scenarios
        ],
        "runs": runs,
    }


def _measure_again_if_bound(
    bench: _Bench,
    config: Configuration,
    scenario: Scenario,
    stage: Callable[[str], None],
    reruns_left: int,
) -> tuple[dict[str, Any], int]:
    """One measurement, repeated once when a step was host-bound and reruns are left; the
    run kept and the reruns left."""
    run = _measure(bench, config, scenario)
    run["attempts"] = 1
    bound = host_bound_steps(run)
    if bound and reruns_left > 0:
        # The host, not the server, bounded these steps (see brownout._lab.hostcpu):
        # measure once more on fresh processes and keep the attempt with fewer.
        reruns_left -= 1
        stage(f"host-bound: {'; '.join(bound)}: measuring again")
        again = _measure(bench, config, scenario)
        if len(host_bound_steps(again)) < len(bound):
            run = again
        run["attempts"] = 2
    return run, reruns_left


def host_bound_steps(run: dict[str, Any]) -> list[str]:
    """The run's host-bound steps, each as "label (reasons)"."""
    return [f"{s['label']} ({', '.join(s['host_bound'])})" for s in run["steps"] if s["host_bound"]]


def _calibration_dict(c: Calibration) -> dict[str, Any]:
    return {
        "capacity": round(c.capacity, 1),
        "service_time": round(c.service_time, 5),
        "levels": [
            {"concurrency": n, "throughput": round(t, 1), "p50_ms": round(p * 1000, 2)}
            for n, t, p in c.levels
        ],
    }


def pick_scenarios(names: Sequence[str]) -> list[Scenario]:
    """Scenarios by name, in the order given; `KeyError` names the unknown one."""
    return [SCENARIOS[n] for n in names]


# -- scenario files --------------------------------------------------------------------------


def file_classes(sf: ScenarioFile, base: BaseUrl) -> tuple[TrafficClass, ...]:
    """The generator's classes for a scenario file's endpoints: one per endpoint, its path
    under ``base``'s prefix, its class's priority sent as `PRIORITY_HEADER` and its deadline
    as the budget (the generator adds that header)."""
    out = []
    for e in sf.endpoints:
        priority = parse_priority(sf.traffic_class(e).priority)
        extra = ((PRIORITY_HEADER, priority.label),) if priority is not None else ()
        t = e.template(base.prefix, extra)
        out.append(TrafficClass(e.name, t.path, t.method, t.headers, sf.deadline(e), t))
    return tuple(out)


def settings_for(sf: ScenarioFile) -> LabSettings:
    """The run's timing from the file's ``[plan]``."""
    p = sf.plan
    return LabSettings(
        deadline=p.deadline,
        step_seconds=p.step_seconds,
        settle_seconds=p.settle_seconds,
        warmup_seconds=p.warmup_seconds,
        arrivals=p.arrivals,
        reruns=1,
    )


def run_scenario_file(
    sf: ScenarioFile,
    base: BaseUrl,
    settings: LabSettings,
    *,
    find_capacity: bool = False,
    metrics_url: str | None = None,
    on_progress: ProgressHook | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run a scenario file against ``base``: its declared capacity, or the knee found first
    (``find_capacity``, or no ``rps`` declared), then its steps; the lab's raw results with
    ``scenario_file`` (its endpoints and invariants) and ``knee`` added. ``metrics_url``
    (default: the file's ``[server]``): brownout's metrics of the service, scraped for the
    server's view (a path is taken on ``base``)."""
    stage = on_stage or (lambda _msg: None)
    scenario = from_file(sf)
    metrics = metrics_url or sf.server.metrics_url
    target = Target(
        base.host,
        base.port,
        base.prefix or "/",
        None,
        base.tls,
        sf.tls_verify,
        base.host_header,
        resolve_metrics_url(metrics, base.url) if metrics else None,
        sf.server.source,
    )
    classes = file_classes(sf, base)
    spec = sf.capacity
    weighted = [e for e in sf.endpoints if e.weight > 0]
    deadline_ms = max(sf.deadline(e) for e in weighted) * 1000
    gen_cpus, front_cpus, backend_cpus = cpu_layout()
    clear_proxies(sf.proxies, stage)  # before the knee too: it is measured without faults
    with contextlib.ExitStack() as cleanup, GeneratorProcess(gen_cpus) as gen:
        cleanup.callback(clear_proxies, sf.proxies, stage, strict=False)

        def measure(rate: float) -> tuple[float, float, float | None]:
            step = LoadStep(
                f"{rate:.1f}/s",
                rate,
                spec.step_seconds,
                sf.mix,
                settle=min(0.5, spec.step_seconds / 4),
                arrivals=settings.arrivals,
            )
            plan = plan_for(scenario, settings, 0.0, target, None, classes)
            plan = replace(plan, steps=(step,))
            steady = summarize_step(gen.run(plan).steps[0], 0.0)["steady"]
            offered, goodput = steady["offered_per_s"], steady["goodput_per_s"]
            if goodput < spec.follow * offered:
                time.sleep(settings.deadline)  # let the work it abandoned drain
            return offered, goodput, steady["success_p99_ms"]

        def on_step(k: KneeStep) -> None:
            verdict = "kept up" if k.kept_up else "did not keep up"
            stage(
                f"knee: offered {k.offered_per_s:.0f}/s, goodput {k.goodput_per_s:.0f}/s, "
                f"p99 {k.success_p99_ms} ms: {verdict}"
            )

        knee = None
        if spec.rps is not None and not find_capacity:
            capacity = spec.rps
            stage(f"capacity {capacity:g} requests/s (declared)")
        else:
            stage(f"finding the knee from {spec.start_rps:g} requests/s (x{spec.factor:g})")
            knee = find_knee(measure, spec, deadline_ms, on_step)
            capacity = knee.capacity
            stage(f"knee {capacity:.0f} requests/s ({knee.why})")
        bench = _Bench(
            gen, settings, capacity, target, front_cpus, backend_cpus, on_progress, classes
        )
        config = Configuration("target", base.url, "target", None, True)
        stage(f"{base.url}: {scenario.title}")
        invariants = [asdict(i) for i in sf.invariants]
        metrics = f"{'https' if base.tls else 'http'}://{base.host_header}/metrics"
        with SystemObserver(invariants, metrics) as observer:
            run, _ = _measure_again_if_bound(bench, config, scenario, stage, settings.reruns)
        observer.attach(run)
    return {
        "settings": asdict(settings),
        "target": asdict(target),
        "calibration": {
            "capacity": round(capacity, 1),
            "service_time": 0.0,
            "levels": [],
            "source": "knee" if knee is not None else "declared",
        },
        "knee": knee.as_dict() if knee is not None else None,
        "scenario_file": {
            "name": sf.name,
            "source": sf.source,
            "base_url": base.url,
            # Paths as templates and no header values: secrets stay out of the report.
            "endpoints": [
                {
                    "name": e.name,
                    "method": e.method,
                    "path": e.path,
                    "weight": e.weight,
                    "class": e.traffic_class,
                    "priority": sf.traffic_class(e).priority,
                    "deadline": sf.deadline(e),
                }
                for e in sf.endpoints
            ],
            "invariants": invariants,
        },
        "configurations": [asdict(config)],
        "scenarios": [
            {
                "name": scenario.name,
                "title": scenario.title,
                "description": scenario.description,
                "outbound": False,
            }
        ],
        "runs": [run],
    }
