"""Deadlines: one end-to-end deadline per operation (D1), measured on a monotonic clock (D2).

A `Deadline` is an absolute instant on a monotonic clock. It travels between processes only as
a *duration* (the remaining time, see `brownout._propagation`), so clock skew between machines
never matters. Each hop sees the remaining time, never a fresh local timeout.
"""

from __future__ import annotations

import math

from ._clock import Clock, default_clock
from ._errors import Reason, Rejected

__all__ = ["Deadline", "DeadlineBuilder", "call_budget", "new_deadline"]

_DEFAULT_CLOCK = default_clock()


class _DeadlineSlots:
    __slots__ = ("at", "clock", "origin")

    at: float
    clock: Clock
    origin: str


class Deadline(_DeadlineSlots):
    """An immutable point in monotonic time by which an operation must be finished.

    >>> d = Deadline.after(1.5)
    >>> 0 < d.remaining() <= 1.5
    True
    """

    __slots__ = ()

    at: float
    """The instant, in the clock's time base (the loop's time for the default clock)."""
    clock: Clock
    origin: str
    """Where the request's deadline came from (`brownout.InboundBudget.origin` at the edge:
    ``header``, ``signed``, ``envoy``, ``protocol``, ``default``), kept by the scopes that
    shorten it; ``local`` for a deadline set with no request deadline above it."""

    def __init__(self, at: float, clock: Clock = _DEFAULT_CLOCK, origin: str = "local") -> None:
        if math.isnan(at):
            raise ValueError("a deadline cannot be NaN")
        object.__setattr__(self, "at", at)
        object.__setattr__(self, "clock", clock)
        object.__setattr__(self, "origin", origin)

    @classmethod
    def after(cls, seconds: float, *, clock: Clock = _DEFAULT_CLOCK) -> Deadline:
        """A deadline ``seconds`` from now (negative or zero: already expired)."""
        if math.isnan(seconds):
            raise ValueError("a timeout cannot be NaN")
        return cls(clock.now() + seconds, clock)

    def remaining(self) -> float:
        """Seconds left, never negative (0.0 once expired)."""
        left = self.at - self.clock.now()
        return left if left > 0.0 else 0.0

    @property
    def expired(self) -> bool:
        """True once the instant has passed."""
        return self.clock.now() >= self.at

    def earliest(self, other: Deadline | None) -> Deadline:
        """The earlier of two deadlines (a scope can only shorten a deadline, never extend it)."""
        if other is None:
            return self
        if self.clock is other.clock:
            return self if self.at <= other.at else other
        # Instants on different clocks are not comparable; the time left on each is.
        return self if self.remaining() <= other.remaining() else other

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Deadline is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Deadline is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Deadline) and other.at == self.at and other.clock is self.clock

    def __lt__(self, other: Deadline) -> bool:
        return self.at < other.at

    def __le__(self, other: Deadline) -> bool:
        return self.at <= other.at

    def __hash__(self) -> int:
        return hash(self.at)

    def __repr__(self) -> str:
        return f"Deadline(remaining={self.remaining():.3f}s)"

    def __reduce__(self) -> tuple[object, ...]:
        # A monotonic instant means nothing in another process; refuse silently wrong pickles.
        raise TypeError("a Deadline cannot cross a process boundary; send remaining() instead")


_NEW = object.__new__


class DeadlineBuilder(_DeadlineSlots):
    __slots__ = ()


def new_deadline(at: float, origin: str = "local") -> Deadline:
    """A Deadline on the default clock, skipping validation (``at`` is known good).

    Built as a layout-identical mutable twin whose class is then switched (the same trick as
    `brownout._context.make_context`): about half the cost of two ``object.__setattr__`` calls.
    """
    d = _NEW(DeadlineBuilder)
    d.at = at
    d.clock = _DEFAULT_CLOCK
    d.origin = origin
    d.__class__ = Deadline  # type: ignore[assignment]
    return d  # type: ignore[return-value]


# The old name, until `_edge` imports `new_deadline`.
_new_deadline = new_deadline


def call_budget(
    normal_timeout: float,
    *,
    reserve: float = 0.0,
    min_useful: float = 0.0,
    deadline: Deadline | None,
) -> float:
    """How long a dependency call may take (D4): ``min(normal_timeout, remaining - reserve)``.

    ``reserve`` is kept back for the response path and local cleanup. When what is left is
    below ``min_useful`` (what the call normally needs, e.g. a latency estimate per operation,
    D7) the call is refused *before it starts* with ``Rejected(Reason.DEADLINE_TOO_SHORT)``:
    with 40 ms left, a call that needs 150 ms is not worth sending. An already expired deadline
    raises ``Rejected(Reason.DEADLINE_EXPIRED)``. With ``deadline=None`` the normal timeout
    applies. The deadline is given, never read from the request context (a layer above this
    one): `brownout.call_budget` (in `_context`) defaults it to the current request's.
    """
    if deadline is None:
        return normal_timeout
    left = deadline.at - deadline.clock.now()
    if left <= 0.0:
        raise Rejected(Reason.DEADLINE_EXPIRED, "the deadline has already passed")
    # A negative reserve would let the call outlive the deadline, a NaN one return NaN.
    budget = left - reserve if reserve > 0.0 else left
    if budget > normal_timeout:
        budget = normal_timeout
    if budget <= 0.0 or budget < min_useful:
        raise Rejected(
            Reason.DEADLINE_TOO_SHORT,
            f"{max(budget, 0.0) * 1000:.0f} ms usable, the call needs {min_useful * 1000:.0f} ms",
        )
    return budget
