"""Retry pieces from settings tables (docs/configuration.md): a `RetryPolicy` with its
`RetryBudget` and backoff, a `CircuitBreaker`, a `ClientThrottle`."""

from __future__ import annotations

from typing import Any, TypeVar

from .._settings import Section, build_in
from .backoff import Backoff, DecorrelatedJitterBackoff, ExponentialBackoff
from .breaker import CircuitBreaker
from .budget import RetryBudget
from .throttle import ClientThrottle

__all__ = ["BACKOFFS", "backoff_from", "breaker_from", "retry_from", "throttle_from"]

R = TypeVar("R")

BACKOFFS: dict[str, type[Backoff]] = {
    "exponential": ExponentialBackoff,
    "decorrelated_jitter": DecorrelatedJitterBackoff,
}


def backoff_from(sec: Section, key: str = "backoff") -> Backoff | None:
    table = sec.variant(key, None)
    if table is None:
        return None
    cls = table.kind(BACKOFFS)
    return None if cls is None else build_in(table, cls, {})


def retry_from(cls: type[R], sec: Section, code: dict[str, Any]) -> R | None:
    """``cls`` (a `RetryPolicy`) from ``sec``: ``[..budget]`` is a `RetryBudget`, ``backoff``
    a backoff's name or a table with ``kind``."""
    built: dict[str, Any] = {}
    if sec.has("budget"):
        built["budget"] = build_in(sec.table("budget"), RetryBudget, {})
    backoff = backoff_from(sec)
    if backoff is not None:
        built["backoff"] = backoff
    return build_in(sec, cls, code, skip=("budget", "backoff"), built=built)


def breaker_from(sec: Section, name: str) -> CircuitBreaker | None:
    return build_in(sec, CircuitBreaker, {}, built={} if sec.has("name") else {"name": name})


def throttle_from(sec: Section, name: str) -> ClientThrottle | None:
    return build_in(sec, ClientThrottle, {}, built={} if sec.has("name") else {"name": name})
