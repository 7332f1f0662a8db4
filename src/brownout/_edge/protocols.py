"""The edge's vocabulary for who is asking, and the hooks it calls: classification, quota
answers, degraded modes and trust.

Admission is `brownout._admission.protocols.AdmitsWork`, shared with `Dependency`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .._priority import Priority
from .._propagation import Trust

__all__ = [
    "ActiveModes",
    "Classification",
    "QuotaAnswer",
    "QuotaCheck",
    "RequestClassifier",
    "TrustSource",
]


class Classification(NamedTuple):
    """Who is asking, for what, and how much it matters. A classifier returns a new one."""

    priority: Priority
    caller: str
    operation: str
    in_progress: bool = False


class RequestClassifier(Protocol):
    """Maps a framework request (ASGI scope, aiohttp request, `GrpcCall`) and the edge's
    default classification to the final one. It runs after authentication, so it may trust
    what the authentication layer established (e.g. ``scope["user"]``).

    Not `brownout._retry.classify.Classifier`, which sorts a dependency's errors."""

    def __call__(self, request: Any, default: Classification, /) -> Classification: ...


@runtime_checkable
class QuotaAnswer(Protocol):
    """What the edge reads from a quota check's answer (`brownout.QuotaDecision` is one); the
    RateLimit fields are optional (``None``)."""

    @property
    def allowed(self) -> bool: ...

    @property
    def retry_after(self) -> float | None: ...

    @property
    def limit(self) -> int | None: ...

    @property
    def remaining(self) -> int | None: ...

    @property
    def reset(self) -> float | None: ...


QuotaCheck = Callable[[Classification], Awaitable[QuotaAnswer]]
"""An async hook deciding whether a classified request is within its caller's quota."""


@runtime_checkable
class ActiveModes(Protocol):
    """Anything that can name the degraded modes active now (G2; `brownout.DegradedModes`
    is one)."""

    def active_names(self) -> tuple[str, ...]: ...


TrustSource = Trust | Callable[[Any], Trust]
"""A fixed trust level, or a function of the framework request that decides it."""
