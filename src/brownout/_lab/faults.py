"""What `brownout proxy` injects, and when: `Faults` (one setting) and `Timeline` (settings
over time), read from Python or a small TOML file.

Every figure is in seconds or a probability in [0, 1]; a setting replaces the previous one
whole (a field a step leaves out is no fault), so a step reads on its own.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["Faults", "FaultsError", "Timeline", "TimelineStep", "load_timeline"]

MAX_SECONDS = 3600.0
"""A delay longer than an hour is a typo, not a fault."""


class FaultsError(ValueError):
    """A fault setting or a timeline the proxy refuses."""


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultsError(f"{name} must be a number of seconds, not {value!r}")
    if not (0.0 <= value <= MAX_SECONDS):  # also false for NaN
        raise FaultsError(f"{name} must be between 0 and {MAX_SECONDS:g} seconds, not {value!r}")
    return float(value)


def _rate(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultsError(f"{name} must be a probability, not {value!r}")
    if not (0.0 <= value <= 1.0):
        raise FaultsError(f"{name} must be between 0 and 1, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Faults:
    """One fault setting. ``latency`` + uniform(0, ``jitter``) is added to each request (http
    mode) or to each chunk sent towards the upstream (tcp mode, order kept);
    ``connect_latency`` once per connection before the upstream is dialled. The rates are
    drawn per request in http mode, per connection in tcp mode (drawn again on a connection's
    next chunk after the setting changes): ``error_rate`` answers ``error_status`` with
    ``error_body`` without asking the upstream (http only); ``reset_rate`` closes the client's
    connection with a RST; ``stall_rate`` keeps it open and silent until the client gives up;
    ``loss_rate`` holds a chunk (either direction) back ``loss_delay`` seconds, as a lost
    segment's retransmission would, delaying what follows it too."""

    latency: float = 0.0
    jitter: float = 0.0
    connect_latency: float = 0.0
    error_rate: float = 0.0
    error_status: int = 503
    error_body: str = "fault injected by brownout proxy\n"
    reset_rate: float = 0.0
    stall_rate: float = 0.0
    loss_rate: float = 0.0
    loss_delay: float = 0.2

    def __post_init__(self) -> None:
        for name in ("latency", "jitter", "connect_latency", "loss_delay"):
            _seconds(name, getattr(self, name))
        for name in ("error_rate", "reset_rate", "stall_rate", "loss_rate"):
            _rate(name, getattr(self, name))
        status = self.error_status
        if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
            raise FaultsError(f"error_status must be an HTTP status 200..599, not {status!r}")
        if not isinstance(self.error_body, str) or len(self.error_body) > 65536:
            raise FaultsError("error_body must be a string of at most 64 KiB")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Faults:
        """From a TOML table or a JSON object; an unknown key is an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise FaultsError(
                f"unknown fault setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**values)
        except TypeError as e:  # a wrong type the checks above did not name
            raise FaultsError(str(e)) from None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active(self) -> bool:
        """Anything injected at all."""
        return any(
            (
                self.latency,
                self.jitter,
                self.connect_latency,
                self.error_rate,
                self.reset_rate,
                self.stall_rate,
                self.loss_rate,
            )
        )


NO_FAULTS = Faults()


@dataclass(frozen=True)
class TimelineStep:
    at: float
    """Seconds after the proxy starts."""
    faults: Faults


@dataclass(frozen=True)
class Timeline:
    """Fault settings over time, in order of ``at``; before the first step, no fault."""

    steps: tuple[TimelineStep, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        previous = -1.0
        for step in self.steps:
            if not (math.isfinite(step.at) and step.at >= 0.0):
                raise FaultsError(f"a step's 'at' must be a number of seconds >= 0: {step.at!r}")
            if step.at <= previous:
                raise FaultsError("timeline steps must be in increasing order of 'at'")
            previous = step.at

    @classmethod
    def of(cls, *steps: tuple[float, Faults]) -> Timeline:
        return cls(tuple(TimelineStep(float(at), faults) for at, faults in steps))

    def at(self, elapsed: float) -> tuple[int, Faults]:
        """(index of the step in force, its faults) ``elapsed`` seconds in; (-1, none) before."""
        current = (-1, NO_FAULTS)
        for i, step in enumerate(self.steps):
            if step.at > elapsed:
                break
            current = (i, step.faults)
        return current

    def as_list(self) -> list[dict[str, Any]]:
        return [{"at": s.at, **s.faults.as_dict()} for s in self.steps]


def parse_timeline(data: dict[str, Any]) -> Timeline:
    """A timeline from a parsed TOML document: ``[[step]]`` tables, each ``at`` plus faults."""
    unknown = sorted(set(data) - {"step"})
    if unknown:
        raise FaultsError(f"unknown top-level key(s) {', '.join(unknown)}; expected [[step]]")
    raw = data.get("step", [])
    if not isinstance(raw, list) or not raw:
        raise FaultsError("a timeline needs at least one [[step]] table")
    steps = []
    for n, table in enumerate(raw, 1):
        if not isinstance(table, dict) or "at" not in table:
            raise FaultsError(f"step {n} needs 'at' (seconds after the proxy starts)")
        settings = dict(table)
        at = settings.pop("at")
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise FaultsError(f"step {n}: 'at' must be a number of seconds, not {at!r}")
        try:
            steps.append(TimelineStep(float(at), Faults.from_mapping(settings)))
        except FaultsError as e:
            raise FaultsError(f"step {n}: {e}") from None
    return Timeline(tuple(steps))


def load_timeline(path: Path | str) -> Timeline:
    """Read a timeline TOML file (`parse_timeline`); `FaultsError` names what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise FaultsError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise FaultsError(f"{path}: {e.strerror or e}") from None
    try:
        return parse_timeline(data)
    except FaultsError as e:
        raise FaultsError(f"{path}: {e}") from None
