"""Scenario files: a lab run described in TOML, versioned with the user's code.

One format serves the embedded demo's scenarios (package data, ``scenario_files/``) and a
user's own service (``brownout lab --scenario FILE``): endpoints with method, path template,
headers, body, weight and traffic class (priority and client deadline, sent with brownout's
wire headers); the step plan in multiples of a declared or found capacity; invariants with
thresholds. `load_scenario` returns a typed `ScenarioFile` or raises `ScenarioFileError`
naming the field at fault; docs/lab.md is the reference.

``${NAME}`` is replaced by the environment variable ``NAME`` when the file is loaded (so
tokens stay out of the file); ``{name}`` is a placeholder drawn per request from the
endpoint's ``params``.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .._priority import parse_priority
from .faults import Faults, FaultsError
from .system_checks import SYSTEM_CHECKS, parse_system_invariant, system_keys
from .templates import Param, RequestTemplate, placeholders

__all__ = [
    "FORMAT_VERSION",
    "INVARIANT_CHECKS",
    "BaseUrl",
    "CapacitySpec",
    "DemoSpec",
    "Endpoint",
    "Invariant",
    "PlanSpec",
    "ProxySpec",
    "ScenarioFile",
    "ScenarioFileError",
    "ServerSpec",
    "StepSpec",
    "TrafficClassSpec",
    "load_scenario",
    "parse_base_url",
    "parse_scenario",
]

FORMAT_VERSION = 1
INVARIANT_CHECKS = (
    "goodput", "success_p99", "served", "refusals", "class_goodput", "server_agrees",
    *SYSTEM_CHECKS,
)  # fmt: skip
"""The lab verdict's vocabulary (`brownout._lab.verdict`, `brownout._lab.system_checks`),
with thresholds from the file."""
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class ScenarioFileError(ValueError):
    """A scenario file the lab cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class BaseUrl:
    """Where a scenario's traffic goes: ``http(s)://host[:port][/prefix]``."""

    url: str
    host: str
    port: int
    tls: bool
    prefix: str
    """Prepended to every endpoint's path (``""`` or a path without a trailing slash)."""

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def parse_base_url(url: str) -> BaseUrl:
    """An ``http://`` or ``https://`` URL as a `BaseUrl`; `ScenarioFileError` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ScenarioFileError(f"base_url must be an http:// or https:// URL, not {url!r}")
    if not parts.hostname:
        raise ScenarioFileError(f"base_url has no host: {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ScenarioFileError(f"base_url has a bad port: {url!r}") from None
    if parts.query or parts.fragment:
        raise ScenarioFileError(f"base_url takes no query or fragment: {url!r}")
    tls = parts.scheme == "https"
    return BaseUrl(url, parts.hostname, port or (443 if tls else 80), tls, parts.path.rstrip("/"))


@dataclass(frozen=True)
class TrafficClassSpec:
    """A traffic class: the priority claimed and the client deadline its requests carry."""

    name: str
    priority: str | None = None
    """A `brownout.Priority` label, sent as ``brownout-priority`` (None: not sent)."""
    deadline: float | None = None
    """Seconds; sent as ``brownout-budget-ms`` and enforced by the client (None: the plan's)."""


@dataclass(frozen=True)
class Endpoint:
    """One kind of request and its share of the traffic."""

    name: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, Param], ...] = ()
    json_body: Any = None
    text_body: str | None = None
    weight: float = 1.0
    traffic_class: str | None = None

    def template(
        self, prefix: str = "", extra: tuple[tuple[str, str], ...] = ()
    ) -> RequestTemplate:
        """The request, with ``prefix`` before the path and ``extra`` headers after the own."""
        headers = self.headers
        if self.json_body is not None and not any(k == "content-type" for k, _ in headers):
            headers = (*headers, ("content-type", "application/json"))
        return RequestTemplate(
            self.method,
            prefix + self.path,
            (*headers, *extra),
            self.params,
            self.json_body,
            self.text_body,
        )


@dataclass(frozen=True)
class StepSpec:
    """One step of the plan at ``load`` times the capacity."""

    label: str
    load: float
    steps: float = 1.0
    """Length in units of `PlanSpec.step_seconds`."""
    mix: tuple[tuple[str, float], ...] = ()
    """Endpoint shares for this step (empty: the endpoints' weights)."""
    retries: int = 0
    backoff: float = 0.1
    budget: float | None = None
    dependency: Mapping[str, Any] | None = None
    """The embedded demo only: a `brownout._lab.scenarios.DependencyChange`'s fields."""
    faults: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    """The faults each declared proxy injects during this step (a proxy not named: none)."""


@dataclass(frozen=True)
class PlanSpec:
    """Timing shared by every step."""

    deadline: float = 1.0
    """The client deadline of endpoints whose class declares none, seconds."""
    step_seconds: float = 3.0
    settle_seconds: float = 1.0
    warmup_seconds: float = 1.5
    arrivals: str = "constant"


@dataclass(frozen=True)
class CapacitySpec:
    """The capacity the loads multiply: declared (``rps``), or found by ramping offered load
    until goodput stops following it (the knee, `brownout._lab.knee`)."""

    rps: float | None = None
    find: bool = False
    start_rps: float = 10.0
    factor: float = 1.5
    step_seconds: float = 2.0
    refine: int = 3
    """Bisections between the last rate kept up with and the first that was not."""
    follow: float = 0.95
    """A rate is kept up with when goodput >= this share of offered."""
    latency_factor: float = 4.0
    """...and its success p99 is at most this many times the lowest p99 seen (a queue)."""
    max_rps: float = 100_000.0


@dataclass(frozen=True)
class Invariant:
    """A pass/fail check on the run (`INVARIANT_CHECKS`)."""

    check: str
    threshold: float
    steps: tuple[str, ...] = ()
    """Step labels it applies to (empty: the check's default steps)."""
    traffic_class: str | None = None
    options: Mapping[str, Any] | None = None
    """A whole-system check's other keys (`brownout._lab.system_checks`)."""


@dataclass(frozen=True)
class DemoSpec:
    """What only the embedded demo's files declare."""

    needs_dependency: bool = False
    outbound: bool = False
    hog: bool = False
    configurations: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ServerSpec:
    """Where the service exposes brownout's metrics, for the server's view
    (`brownout._lab.server_view`)."""

    metrics_url: str | None = None
    """A URL, or a path taken on the base URL's host and port (None: no server view)."""
    source: str | None = None
    """Only the metrics of this source (a bulkhead's or edge's name; None: all summed)."""


@dataclass(frozen=True)
class ProxySpec:
    """A `brownout proxy` between the service and one of its dependencies, driven by the
    steps' ``faults`` through its control endpoint (``--control``)."""

    name: str
    host: str
    port: int

    @property
    def control(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ScenarioFile:
    """A loaded scenario file."""

    name: str
    title: str
    description: str
    base_url: BaseUrl | None
    endpoints: tuple[Endpoint, ...]
    classes: tuple[TrafficClassSpec, ...]
    steps: tuple[StepSpec, ...]
    plan: PlanSpec
    capacity: CapacitySpec
    invariants: tuple[Invariant, ...]
    demo: DemoSpec
    tls_verify: bool = True
    source: str = "<string>"
    server: ServerSpec = ServerSpec()
    proxies: tuple[ProxySpec, ...] = ()

    def traffic_class(self, endpoint: Endpoint) -> TrafficClassSpec:
        """The class of ``endpoint`` (a class with no priority and no deadline if none)."""
        for c in self.classes:
            if c.name == endpoint.traffic_class:
                return c
        return TrafficClassSpec(endpoint.traffic_class or "")

    def deadline(self, endpoint: Endpoint) -> float:
        """The client deadline of ``endpoint``'s requests, seconds."""
        return self.traffic_class(endpoint).deadline or self.plan.deadline

    @property
    def mix(self) -> tuple[tuple[str, float], ...]:
        """The endpoints' weights as a mix."""
        return tuple((e.name, e.weight) for e in self.endpoints)


# -- reading ----------------------------------------------------------------------------------


class _Reader:
    """Typed access to one TOML table, every error naming ``where``."""

    def __init__(self, source: str, where: str, table: Any) -> None:
        self.source = source
        self.where = where
        if not isinstance(table, dict):
            raise self.error("", f"must be a table, not {type(table).__name__}")
        self.table: dict[str, Any] = table

    def error(self, key: str, problem: str) -> ScenarioFileError:
        field = f"{self.where}.{key}" if self.where and key else self.where or key
        return ScenarioFileError(f"{self.source}: {field}: {problem}")

    def sub(self, key: str) -> _Reader:
        return _Reader(self.source, f"{self.where}.{key}" if self.where else key, self.table[key])

    def known(self, *keys: str) -> None:
        for key in self.table:
            if key not in keys:
                raise self.error(key, f"unknown field (known: {', '.join(keys)})")

    def string(self, key: str, default: str | None = None) -> str:
        value = self.table.get(key, default)
        if value is None:
            raise self.error(key, "is required")
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {type(value).__name__}")
        return value

    def optional_string(self, key: str) -> str | None:
        return self.string(key) if key in self.table else None

    def number(
        self, key: str, default: float | None = None, *, low: float = 0.0, strict: bool = True
    ) -> float:
        value = self.table.get(key, default)
        if value is None:
            raise self.error(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, not {type(value).__name__}")
        ok = value > low if strict else value >= low
        if not math.isfinite(value) or not ok:
            raise self.error(key, f"must be a finite number {'>' if strict else '>='} {low:g}")
        return float(value)

    def integer(self, key: str, default: int, *, low: int = 0) -> int:
        value = self.table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, not {type(value).__name__}")
        if value < low:
            raise self.error(key, f"must be >= {low}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.table.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {type(value).__name__}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        return tuple(value)

    def tables(self, key: str) -> list[_Reader]:
        value = self.table.get(key, [])
        if not isinstance(value, list):
            raise self.error(key, "must be an array of tables ([[" + key + "]])")
        return [_Reader(self.source, f"{key}[{i}]", v) for i, v in enumerate(value)]


def _substitute(text: str, env: Mapping[str, str], r: _Reader, key: str) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in env:
            raise r.error(key, f"environment variable {name} is not set")
        return env[name]

    return _ENV.sub(one, text)


def _substitute_json(node: Any, env: Mapping[str, str], r: _Reader, key: str) -> Any:
    if isinstance(node, str):
        return _substitute(node, env, r, key)
    if isinstance(node, dict):
        return {k: _substitute_json(v, env, r, f"{key}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_json(v, env, r, f"{key}[{i}]") for i, v in enumerate(node)]
    return node


def _json_strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _json_strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _json_strings(v)]
    return []


def _param(r: _Reader) -> Param:
    r.known("int", "choice", "uuid")
    kinds = [k for k in ("int", "choice", "uuid") if k in r.table]
    if len(kinds) != 1:
        raise r.error("", "declare exactly one of int = [low, high], choice = [...], uuid = true")
    kind = kinds[0]
    value = r.table[kind]
    if kind == "int":
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or value[0] > value[1]
        ):
            raise r.error("int", "must be [low, high]: two integers, low <= high")
        return Param("int", value[0], value[1])
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str | int | float | bool) for v in value)
        ):
            raise r.error("choice", "must be a non-empty list of strings or numbers")
        return Param("choice", choices=tuple(value))
    if value is not True:
        raise r.error("uuid", "must be true")
    return Param("uuid")


def _endpoint(r: _Reader, env: Mapping[str, str], classes: set[str]) -> Endpoint:
    r.known("name", "method", "path", "headers", "params", "json", "body", "weight", "class")
    name = r.string("name")
    if not _NAME.fullmatch(name):
        raise r.error("name", "letters, digits and . _ : - only")
    method = r.string("method", "GET").upper()
    if method not in _METHODS:
        raise r.error("method", f"must be one of {', '.join(_METHODS)}")
    path = _substitute(r.string("path"), env, r, "path")
    if not path.startswith("/") or any(c in path for c in " \r\n\t#"):
        raise r.error("path", "must start with / and contain no spaces, # or line breaks")
    headers: list[tuple[str, str]] = []
    if "headers" in r.table:
        h = r.sub("headers")
        for key, value in h.table.items():
            if not _TOKEN.fullmatch(key):
                raise h.error(key, "is not a valid header name")
            if not isinstance(value, str):
                raise h.error(key, f"must be a string, not {type(value).__name__}")
            value = _substitute(value, env, h, key)
            if any(c in value for c in "\r\n\0"):
                raise h.error(key, "must not contain line breaks")
            headers.append((key.lower(), value))
    params: list[tuple[str, Param]] = []
    if "params" in r.table:
        p = r.sub("params")
        for key in p.table:
            params.append((key, _param(p.sub(key))))
    json_body: Any = None
    text_body: str | None = None
    if "json" in r.table and "body" in r.table:
        raise r.error("json", "give json or body, not both")
    if "json" in r.table:
        json_body = _substitute_json(r.table["json"], env, r, "json")
    elif "body" in r.table:
        text_body = _substitute(r.string("body"), env, r, "body")
    if (json_body is not None or text_body is not None) and method in ("GET", "HEAD"):
        raise r.error("method", f"{method} sends no body; use POST, PUT or PATCH")
    declared = {k for k, _ in params}
    used: list[tuple[str, str]] = [("path", n) for n in placeholders(path)]
    used += [(f"headers.{k}", n) for k, v in headers for n in placeholders(v)]
    if text_body is not None:
        used += [("body", n) for n in placeholders(text_body)]
    used += [("json", n) for s in _json_strings(json_body) for n in placeholders(s)]
    for where, n in used:
        if n not in declared:
            raise r.error(where, f"placeholder {{{n}}} has no params.{n}")
    for n in sorted(declared - {n for _, n in used}):
        raise r.error(f"params.{n}", "is declared but no path, header or body uses it")
    traffic_class = r.optional_string("class")
    if traffic_class is not None and traffic_class not in classes:
        known = ", ".join(sorted(classes)) or "none declared"
        raise r.error("class", f"unknown traffic class {traffic_class!r} ([classes]: {known})")
    return Endpoint(
        name,
        method,
        path,
        tuple(headers),
        tuple(params),
        json_body,
        text_body,
        r.number("weight", 1.0, strict=False),
        traffic_class,
    )


def _faults(r: _Reader, proxies: Set[str]) -> tuple[tuple[str, Mapping[str, Any]], ...]:
    f = r.sub("faults")
    out = []
    for name in f.table:
        if name not in proxies:
            raise f.error(name, f"no [proxies.{name}] is declared (declared: {sorted(proxies)})")
        setting = f.sub(name)
        try:
            faults = Faults.from_mapping(setting.table)
        except FaultsError as e:
            raise setting.error("", str(e)) from None
        out.append((name, faults.as_dict()))
    return tuple(out)


def _steps(
    r: _Reader, endpoints: set[str], plan: PlanSpec, proxies: Set[str] = frozenset()
) -> list[StepSpec]:
    r.known(
        "label", "load", "loads", "seconds", "steps", "mix",
        "retries", "backoff", "budget", "dependency", "faults",
    )  # fmt: skip
    if ("load" in r.table) == ("loads" in r.table):
        raise r.error("load", "give load = X (one step) or loads = [X, ...] (a ramp)")
    if "seconds" in r.table and "steps" in r.table:
        raise r.error("seconds", "give seconds or steps, not both")
    length = (
        r.number("seconds") / plan.step_seconds if "seconds" in r.table else r.number("steps", 1.0)
    )
    mix: list[tuple[str, float]] = []
    if "mix" in r.table:
        m = r.sub("mix")
        for key in m.table:
            if key not in endpoints:
                raise m.error(key, f"no endpoint is named {key!r}")
            mix.append((key, m.number(key, strict=False)))
        if not any(w > 0 for _, w in mix):
            raise r.error("mix", "needs a weight > 0")
    dependency: dict[str, Any] | None = None
    if "dependency" in r.table:
        d = r.sub("dependency")
        d.known("latency_factor", "concurrency_factor", "error_rate", "down")
        dependency = {}
        for key in ("latency_factor", "concurrency_factor"):
            if key in d.table:
                dependency[key] = d.number(key)
        if "error_rate" in d.table:
            dependency["error_rate"] = d.number("error_rate", strict=False)
        if "down" in d.table:
            dependency["down"] = d.boolean("down", False)
    budget = r.number("budget") if "budget" in r.table else None
    common: dict[str, Any] = {
        "steps": length,
        "mix": tuple(mix),
        "retries": r.integer("retries", 0),
        "backoff": r.number("backoff", 0.1),
        "budget": budget,
        "dependency": dependency,
        "faults": _faults(r, proxies) if "faults" in r.table else (),
    }
    if "load" in r.table:
        load = r.number("load")
        return [StepSpec(r.string("label", f"{load:g}x"), load, **common)]
    if "label" in r.table:
        raise r.error("label", "a ramp (loads = [...]) labels its steps itself (2x, 4x, ...)")
    value = r.table["loads"]
    if not isinstance(value, list) or not value:
        raise r.error("loads", "must be a non-empty list of numbers")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0:
            raise r.error(f"loads[{i}]", "must be a number > 0")
        out.append(StepSpec(f"{x:g}x", float(x), **common))
    return out


def _invariant(
    r: _Reader, classes: set[str], labels: set[str], endpoints: frozenset[str] = frozenset()
) -> Invariant:
    check = r.string("check")
    if check not in INVARIANT_CHECKS:
        raise r.error("check", f"unknown check {check!r} (known: {', '.join(INVARIANT_CHECKS)})")
    if check in SYSTEM_CHECKS:
        # A system check's class may name one endpoint (the demo declares no classes).
        return _system_invariant(r, check, classes | endpoints, labels)
    r.known("check", "min", "max", "steps", "class")
    bound = "max" if check in ("success_p99", "refusals", "server_agrees") else "min"
    other = "min" if bound == "max" else "max"
    if other in r.table:
        raise r.error(other, f"{check} takes {bound} = ..., not {other}")
    threshold = r.number(bound, strict=check != "refusals")
    if check != "success_p99" and threshold > 1:
        raise r.error(bound, "is a share: between 0 and 1")
    steps = r.strings("steps")
    for label in steps:
        if label not in labels:
            raise r.error("steps", f"no step is labelled {label!r} (labels: {sorted(labels)})")
    traffic_class = r.optional_string("class")
    if check == "class_goodput":
        if traffic_class is None:
            raise r.error("class", "class_goodput needs class = NAME")
        if traffic_class not in classes:
            raise r.error("class", f"unknown traffic class {traffic_class!r}")
    elif traffic_class is not None:
        raise r.error("class", f"only class_goodput takes a class, not {check}")
    return Invariant(check, threshold, steps, traffic_class)


def _system_invariant(r: _Reader, check: str, classes: set[str], labels: set[str]) -> Invariant:
    r.known("check", "steps", *system_keys(check))
    threshold, options = parse_system_invariant(check, r.table, r.error, labels)
    steps = r.strings("steps")
    for label in steps:
        if label not in labels:
            raise r.error("steps", f"no step is labelled {label!r} (labels: {sorted(labels)})")
    traffic_class = r.optional_string("class")
    if check == "priority_goodput_stable" and traffic_class is None:
        raise r.error("class", f"{check} needs class = NAME")
    if traffic_class is not None and traffic_class not in classes:
        raise r.error("class", f"no traffic class or endpoint is named {traffic_class!r}")
    return Invariant(check, threshold, steps, traffic_class, options)


def parse_scenario(
    text: str, source: str = "<string>", env: Mapping[str, str] | None = None
) -> ScenarioFile:
    """Parse a scenario file's text; `ScenarioFileError` names the field at fault."""
    env = os.environ if env is None else env
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioFileError(f"{source}: not valid TOML: {e}") from None
    r = _Reader(source, "", data)
    r.known(
        "version", "name", "title", "description", "base_url", "tls_verify",
        "plan", "capacity", "classes", "endpoints", "steps", "invariants", "demo", "server",
        "proxies",
    )  # fmt: skip
    version = r.integer("version", 0)
    if version != FORMAT_VERSION:
        raise r.error("version", f"must be {FORMAT_VERSION} (this brownout reads version 1)")
    name = r.string("name")
    if not _NAME.fullmatch(name):
        raise r.error("name", "letters, digits and . _ : - only")
    base_url = None
    if "base_url" in r.table:
        try:
            base_url = parse_base_url(_substitute(r.string("base_url"), env, r, "base_url"))
        except ScenarioFileError as e:
            raise r.error("base_url", str(e).removeprefix("base_url ")) from None

    plan = PlanSpec()
    if "plan" in r.table:
        p = r.sub("plan")
        p.known("deadline", "step_seconds", "settle_seconds", "warmup_seconds", "arrivals")
        arrivals = p.string("arrivals", "constant")
        if arrivals not in ("constant", "poisson"):
            raise p.error("arrivals", "must be constant or poisson")
        plan = PlanSpec(
            p.number("deadline", 1.0),
            p.number("step_seconds", 3.0),
            p.number("settle_seconds", 1.0, strict=False),
            p.number("warmup_seconds", 1.5, strict=False),
            arrivals,
        )
        if plan.settle_seconds >= plan.step_seconds:
            raise p.error("settle_seconds", "must be shorter than step_seconds")

    capacity = CapacitySpec()
    if "capacity" in r.table:
        c = r.sub("capacity")
        c.known(
            "rps",
            "find",
            "start_rps",
            "factor",
            "step_seconds",
            "refine",
            "follow",
            "latency_factor",
            "max_rps",
        )
        capacity = CapacitySpec(
            c.number("rps") if "rps" in c.table else None,
            c.boolean("find", False),
            c.number("start_rps", 10.0),
            c.number("factor", 1.5, low=1.0),
            c.number("step_seconds", 2.0),
            c.integer("refine", 3),
            c.number("follow", 0.95),
            c.number("latency_factor", 4.0, low=1.0),
            c.number("max_rps", 100_000.0),
        )
        if capacity.follow > 1:
            raise c.error("follow", "is a share: between 0 and 1")
        if capacity.rps is not None and capacity.find:
            raise c.error("find", "declare rps or find = true, not both")

    classes: list[TrafficClassSpec] = []
    if "classes" in r.table:
        cs = r.sub("classes")
        for key in cs.table:
            t = cs.sub(key)
            t.known("priority", "deadline")
            priority = t.optional_string("priority")
            if priority is not None and parse_priority(priority) is None:
                raise t.error(
                    "priority",
                    f"unknown priority {priority!r} "
                    "(critical_plus, critical, sheddable_plus, sheddable)",
                )
            deadline = t.number("deadline") if "deadline" in t.table else None
            classes.append(TrafficClassSpec(key, priority, deadline))
    class_names = {c.name for c in classes}

    endpoints = [_endpoint(e, env, class_names) for e in r.tables("endpoints")]
    if not endpoints:
        raise r.error("endpoints", "declare at least one [[endpoints]]")
    names = [e.name for e in endpoints]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise r.error(f"endpoints[{i}].name", f"{n!r} is already an endpoint's name")
    if not any(e.weight > 0 for e in endpoints):
        raise r.error("endpoints", "at least one endpoint needs a weight > 0")

    proxies = _proxies(r, env) if "proxies" in r.table else ()
    proxy_names = {x.name for x in proxies}
    steps = [s for t in r.tables("steps") for s in _steps(t, set(names), plan, proxy_names)]
    if not steps:
        raise r.error("steps", "declare at least one [[steps]]")
    labels = [s.label for s in steps]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise r.error("steps", f"two steps are labelled {label!r}: give each a label")
    invariants = tuple(
        _invariant(t, class_names, set(labels), frozenset(names)) for t in r.tables("invariants")
    )

    demo = DemoSpec()
    if "demo" in r.table:
        d = r.sub("demo")
        d.known("needs_dependency", "outbound", "hog", "configurations")
        demo = DemoSpec(
            d.boolean("needs_dependency", False),
            d.boolean("outbound", False),
            d.boolean("hog", False),
            d.strings("configurations") or None if "configurations" in d.table else None,
        )
    server = ServerSpec()
    if "server" in r.table:
        v = r.sub("server")
        v.known("metrics_url", "source")
        url = v.optional_string("metrics_url")
        if url is not None:
            url = _substitute(url, env, v, "metrics_url")
            parts = urlsplit(url)
            absolute = parts.scheme in ("http", "https") and parts.hostname
            if not url.startswith("/") and not absolute:
                raise v.error("metrics_url", "must be a path (/metrics) or an http(s):// URL")
        server = ServerSpec(url, v.optional_string("source"))
    return ScenarioFile(
        name,
        r.string("title", name),
        r.string("description", ""),
        base_url,
        tuple(endpoints),
        tuple(classes),
        tuple(steps),
        plan,
        capacity,
        invariants,
        demo,
        r.boolean("tls_verify", True),
        source,
        server,
        proxies,
    )


def _proxies(r: _Reader, env: Mapping[str, str]) -> tuple[ProxySpec, ...]:
    t = r.sub("proxies")
    out = []
    for name in t.table:
        if not _NAME.fullmatch(name):
            raise t.error(name, "letters, digits and . _ : - only")
        x = t.sub(name)
        x.known("control")
        control = _substitute(x.string("control"), env, x, "control")
        parts = urlsplit(control if "//" in control else f"http://{control}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if (
            parts.scheme != "http"
            or not parts.hostname
            or port is None
            or parts.path not in ("", "/")
        ):
            raise x.error(
                "control", "must be HOST:PORT or http://HOST:PORT (the proxy's --control)"
            )
        out.append(ProxySpec(name, parts.hostname, port))
    return tuple(out)


def load_scenario(path: str | Path, env: Mapping[str, str] | None = None) -> ScenarioFile:
    """Read and parse a scenario file; `ScenarioFileError` for a missing or bad one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioFileError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ScenarioFileError(f"{path}: not UTF-8 text") from None
    return parse_scenario(text, str(path), env)
