"""One request in flight: what an adapter and the edge share about it (`Flight`), how it
ends when its client goes away (`ABANDONED`), and the one loop timer per policy that arms
deadlines and disconnect watches for requests that outlive a sweep period (`Sweeper`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._deadline import Deadline
from .protocols import Classification, QuotaAnswer

__all__ = ["ABANDONED", "ANSWERED", "Abandoned", "Answered", "Flight", "Sweeper", "expire"]


class Flight:
    """What an adapter and the edge share about one request.

    The adapter sets ``response_started`` (and ``status``) when the first byte of a response
    leaves, and ``abandoned`` when it sees the client go away before cancelling the handler.
    ``on_old`` is the adapter's hook for requests that outlive the policy's ``sweep_period``
    (start watching for a disconnect); it returns True once it needs no further calls.
    """

    __slots__ = (
        "abandoned",
        "admitted",
        "answered",
        "classification",
        "deadline",
        "expired",
        "on_old",
        "quota",
        "reports",
        "response_started",
        "started",
        "status",
        "task",
        "timer",
    )

    def __init__(self, started: float, on_old: Callable[[], bool] | None = None) -> None:
        self.started = started
        self.on_old = on_old
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: Deadline | None = None
        self.classification: Classification | None = None
        self.quota: QuotaAnswer | None = None
        self.admitted = False
        self.response_started = False
        self.status = 0
        self.abandoned = False
        self.expired = False
        self.answered = False
        """True once the edge answered for the handler at its deadline (`answer_now`): the
        handler's own answer, whenever it comes, is discarded."""
        self.reports = True
        """True when the edge, not a bulkhead, reports this request's lifecycle events."""

    def answer_now(self, refusal: Any) -> bool:
        """The adapter's hook: start writing ``refusal`` (a `Refusal`) to the client now, while
        the handler may still be running (its deadline passed and it was cancelled; it may
        not stop). True when the adapter can, which then discards the handler's own answer
        (``answered`` is set); the default cannot."""
        return False

    def old(self) -> bool:
        """Called by the sweep once the request is older than the sweep period: runs the
        ``on_old`` hook. True once no further calls are needed."""
        on_old = self.on_old
        return True if on_old is None else on_old()


class Sweeper:
    """One loop timer for every request in flight through a policy (per event loop).

    Every ``period`` seconds it visits the requests older than ``period``: it arms the
    request's deadline timer (a request that ends sooner never pays for one) and calls the
    adapter's ``on_old`` hook (start watching for a client disconnect). Each request costs a
    dictionary insert and delete.
    """

    __slots__ = ("loop", "on_expired", "pending", "period", "timer")

    def __init__(self, period: float, on_expired: Callable[[Flight], None] | None = None) -> None:
        self.period = period
        self.on_expired = on_expired
        """The policy's answer to a request whose deadline passed (after its cancellation)."""
        self.pending: dict[Flight, None] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, flight: Flight, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self.loop:  # used from another loop (tests, a new server): start afresh
            if self.timer is not None:
                self.timer.cancel()
            self.pending.clear()
            self.timer = None
            self.loop = loop
        self.pending[flight] = None
        if self.timer is None:
            self.timer = loop.call_later(self.period, self._sweep)

    def track(
        self, flight: Flight, task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Watch ``flight`` (its ``deadline`` set) until `forget`: a deadline within one sweep
        period gets its timer now, since the sweep would come too late for it; the sweep arms
        the others once their request is old."""
        deadline = flight.deadline
        if deadline is not None and deadline.at - flight.started <= self.period:
            flight.timer = loop.call_at(deadline.at, self.expire, flight, task)
        if loop is self.loop:  # `add`, inlined: once per request
            self.pending[flight] = None
            if self.timer is None:
                self.timer = loop.call_later(self.period, self._sweep)
        else:
            self.add(flight, loop)

    def expire(self, flight: Flight, task: asyncio.Task[Any]) -> None:
        """Deadline timer: cancel the request's task (`expire`), then let the policy answer
        at once, whether or not the handler stops."""
        if expire(flight, task):
            on_expired = self.on_expired
            if on_expired is not None:
                on_expired(flight)

    def forget(self, flight: Flight) -> None:
        """The request ended: stop watching it and cancel its deadline timer."""
        self.pending.pop(flight, None)
        timer = flight.timer
        if timer is not None:
            timer.cancel()

    def _sweep(self) -> None:
        self.timer = None
        pending = self.pending
        if not pending:
            return
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - self.period
        for flight in list(pending):
            if flight.started > cutoff:
                break  # insertion order is arrival order: the rest are younger
            if flight.timer is None and flight.deadline is not None and flight.task is not None:
                flight.timer = loop.call_at(flight.deadline.at, self.expire, flight, flight.task)
            if flight.old():
                del pending[flight]
        if pending:
            self.timer = loop.call_later(self.period, self._sweep)


class Abandoned:
    """The type of `ABANDONED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABANDONED"


ABANDONED = Abandoned()
"""What `EdgePolicy.serve` returns when the client went away and the handler was cancelled."""


class Answered:
    """The type of `ANSWERED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ANSWERED"


ANSWERED = Answered()
"""What `EdgePolicy.serve` returns when the edge already answered for the handler (504 at its
deadline, `Flight.answer_now`): the adapter writes nothing more."""


def expire(flight: Flight, task: asyncio.Task[Any]) -> bool:
    """Deadline timer: cancel the request's task (turned into `DeadlineExceeded`). True when
    it was still running."""
    if not task.done():
        flight.expired = True
        task.cancel()
        return True
    return False
