"""Long-lived connections (websockets) through the edge: one policy for every adapter.

A websocket is not a request: it lives as long as its client wants, so a request deadline
must not cut it, and its lifetime says nothing about the service's latency. It still takes
capacity, so it is admitted like a request:

- **at connect**, through the policy's ``connections`` admission (a bulkhead or cap of its
  own) or, without one, the route's bulkhead: classified as a request is (trust, priority
  claim, classifier), quota checked, queued and refused by the same rules;
- **refused** with the refusal a request would get (503 capacity, 429 quota), before the
  upgrade: the adapter refuses the handshake (an HTTP response where the server allows one,
  else a websocket close with code 1013, "try again later");
- **the handshake has a deadline** (the route's default budget): a handler that has neither
  accepted nor refused by then is cancelled and the upgrade refused (504);
- **the connection has none**: the request context carries priority, caller and operation
  but no deadline (per-message deadlines are the application's, ``brownout.deadline``);
- **counted as a connection**: offered, admitted or shed at connect, like a request; its end
  releases the slot without teaching the limit or the latency estimate anything
  (``permit.ignore()``): a connection's lifetime is not a service time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .._clock import current_task_of, running_loop
from .._context import get_current, make_context, reset_current, set_current
from .._errors import Reason, Rejected
from .._propagation import HeaderGetter
from .flight import Flight
from .refusals import Refusal
from .routes import ResolvedRoute

__all__ = ["serve_connection"]


async def serve_connection(
    policy: Any,
    request: Any,
    call: Callable[[], Awaitable[Any]],
    flight: Flight,
    *,
    route: ResolvedRoute,
    get: HeaderGetter,
    handshaken: Callable[[], bool],
) -> Refusal | None:
    """Admit a long-lived connection and run ``call`` (the handler, for the connection's
    whole life) inside its context. ``policy``: the `EdgePolicy`. ``handshaken``: true once
    the adapter has seen the handshake answered (accepted or refused by the handler).

    Returns a `Refusal` for the adapter to refuse the handshake with, or ``None`` once the
    handler returned. A cancellation from outside (the server, the client) propagates."""
    trust = policy.trust_of(request)
    cls = policy.classify(request, route, route.template, trust, get)
    flight.classification = cls
    admission = policy.connections if policy.connections is not None else route.bulkhead
    flight.reports = False  # a connection's lifecycle is its admission's to report
    if policy.quota is not None:
        refused = await policy._check_quota(cls, flight, admission)
        if refused is not None:
            return refused  # type: ignore[no-any-return]
        cls = flight.classification
    loop = running_loop()
    task = flight.task = current_task_of(loop)
    assert task is not None
    parent = get_current()
    ctx = make_context(
        None,
        cls.priority,
        cls.caller,
        cls.operation,
        parent.attempt,
        parent.idempotency_key,
        cls.in_progress,
        flight.started,
    )
    cancelling = task.cancelling()

    def handshake_expired() -> None:
        if not handshaken() and not task.done():
            flight.expired = True
            task.cancel()

    timer = loop.call_at(flight.started + route.deadline.default, handshake_expired)
    token = set_current(ctx)
    try:
        if admission is None:
            flight.admitted = True
            await call()
            return None
        async with admission.admit() as permit:
            flight.admitted = True
            await call()
            permit.ignore()  # a connection's lifetime teaches the limit nothing
        return None
    except Rejected as e:
        if flight.admitted:
            raise
        return policy.refusal(e.reason, e.retry_after)  # type: ignore[no-any-return]
    except asyncio.CancelledError:
        if flight.expired and task.uncancel() <= cancelling and not handshaken():
            return policy.refusal(Reason.DEADLINE_EXPIRED)  # type: ignore[no-any-return]
        raise
    finally:
        timer.cancel()
        reset_current(token)
        flight.task = None
