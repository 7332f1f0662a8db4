"""Routes: the per-route policy a user declares, and its resolved form the edge reads per
request. The operation label is the route template, never the raw path (bounded labels)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from .._admission.protocols import AdmitsWork
from .._priority import Priority
from .._propagation import InboundDeadlinePolicy

__all__ = ["UNMATCHED", "ResolvedRoute", "Route", "compile_template"]

UNMATCHED = "unmatched"
"""The operation label of every request that matches no known route (bounded label sets)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Per-route policy. ``None`` fields fall back to the `EdgePolicy`'s.

    ``default`` and ``maximum`` override the inbound deadline policy's; ``priority`` is the
    route's base priority (a classifier may still change it); ``bulkhead`` gives the route its
    own concurrency budget (A1).
    """

    priority: Priority | None = None
    default: float | None = None
    maximum: float | None = None
    bulkhead: AdmitsWork | None = None


class ResolvedRoute(NamedTuple):
    """A route with every fallback applied; computed once per route template."""

    template: str
    priority: Priority
    deadline: InboundDeadlinePolicy
    bulkhead: AdmitsWork | None


_PARAM = re.compile(r"{([a-zA-Z_][a-zA-Z0-9_]*)(?::([a-zA-Z_]+))?}")


def compile_template(template: str) -> re.Pattern[str]:
    """A regex matching the paths of a Starlette/aiohttp style template (``/a/{id}``,
    ``/files/{rest:path}``)."""
    out: list[str] = []
    pos = 0
    for m in _PARAM.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(".*" if m.group(2) == "path" else "[^/]+")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))
