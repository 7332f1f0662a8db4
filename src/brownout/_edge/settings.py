"""An `EdgePolicy` from the ``[edge]`` settings table (docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from .._admission.settings import bulkhead_from
from .._errors import Reason
from .._propagation import InboundDeadlinePolicy, Trust
from .._settings import ConfigError, Section, as_int, as_str, enum_list, enum_of, enum_table
from .routes import Route
from .slowed import SlowedRejections

__all__ = ["edge_from"]

P = TypeVar("P")

_CONVERTERS = {
    "trust": enum_of(Trust),
    "statuses": enum_table(Reason, as_int),
    "grpc_codes": enum_table(Reason, as_str),
    "details": enum_table(Reason, as_str),
    "do_not_retry": enum_list(Reason),
}
# Built from their own tables below, not read as values.
_TABLES = ("bulkhead", "deadline", "routes", "slowed")


def edge_from(cls: type[P], config: Mapping[str, Any], section: str, code: dict[str, Any]) -> P:
    """``cls`` (an `EdgePolicy`) from table ``section`` of ``config``; ``code`` (classifier,
    quota, degraded, events, rng, a trust function...) wins over the settings."""
    sec, owner = Section.enter(config, section)
    kwargs = sec.kwargs(cls, skip=_TABLES, converters=_CONVERTERS)
    name = kwargs.get("name", code.get("name", "edge"))
    deadline_sec = sec.table("deadline")
    deadline_kwargs = deadline_sec.kwargs(InboundDeadlinePolicy)
    if "maximum" in deadline_kwargs and "default" not in deadline_kwargs:
        # A lower maximum alone lowers the default with it, as a route's maximum does.
        default = InboundDeadlinePolicy.default
        deadline_kwargs["default"] = min(default, deadline_kwargs["maximum"])
    deadline = deadline_sec.build(InboundDeadlinePolicy, **deadline_kwargs)
    if deadline is not None:
        kwargs["deadline"] = deadline
    if sec.has("bulkhead"):
        kwargs["bulkhead"] = bulkhead_from(sec.table("bulkhead"), name)
    if sec.has("slowed"):
        slowed = sec.table("slowed")
        kwargs["slowed"] = slowed.build(SlowedRejections, **slowed.kwargs(SlowedRejections))
    routes: dict[str, Route] = {}
    for template, route_sec in sec.tables("routes").items():
        route_kwargs = route_sec.kwargs(Route, skip=("bulkhead",))
        if route_sec.has("bulkhead"):
            route_kwargs["bulkhead"] = bulkhead_from(
                route_sec.table("bulkhead"), f"{name}:{template}"
            )
        route = route_sec.build(Route, **route_kwargs)
        if route is not None:
            routes[template] = route
    kwargs["routes"] = routes
    kwargs.update(code)
    if owner:
        sec.check()  # every problem, before the constructor's first
    policy = sec.build(cls, **kwargs)
    if owner or policy is None:
        sec.check()  # raises: a policy that could not be built left its problem
    if policy is None:
        raise ConfigError([f"{sec.path}: could not be built"])
    return policy
