"""Celery (RabbitMQ): tasks carry the request's deadline and idempotency key; a worker parks
what expired instead of running it, and retries under a budget.

::

    app = Celery("shop", broker="amqp://guest:guest@127.0.0.1:5672//")
    app.conf.broker_transport_options = {"confirm_publish": True}
    install(app, policy=MessagePolicy(max_attempts=5), ttl=300)

    @app.task(base=BrownoutTask, brownout_ttl=30)
    def send_receipt(order_id: int) -> None: ...   # runs inside brownout's request context

This module only translates between Celery and the durable-queue core (`brownout.durable`):
every decision (run, retry later, park) is `brownout.durable.MessagePolicy`'s, taken by a
`brownout.durable.SyncMessageRunner`, and is a typed event.

- **publish** (`install`'s ``before_task_publish`` handler): the message's headers get the
  envelope (enqueued-at, valid-until, attempt, idempotency key, priority, caller, operation)
  stamped from the current request context; valid-until is the request's remaining budget
  or the task's ``brownout_ttl`` (else ``ttl``), whichever is shorter. Celery's own
  ``expires`` is set to valid-until (or kept when earlier), so a worker without brownout
  drops the task too. A publish that already carries an envelope (a retry) keeps it.
- **worker** (`BrownoutTask`): Celery discards a task past its ``expires`` before the task
  runs, acknowledged and gone. `BrownoutTask`'s request class leaves a task that carries
  an envelope to brownout, which parks it (reason ``expired``) in ``<queue>.parked``,
  the aio-pika adapter's layout, so `brownout.integrations.aio_pika.ParkedQueue` and
  ``brownout queue`` list and replay it. A task that runs does so inside brownout's request
  context; a failure is retried later (Celery's ``retry`` with ``countdown``, the next
  attempt in the envelope) or parked, as the policy says.
- **at least once**: tasks are acknowledged late (``acks_late``, ``reject_on_worker_lost``);
  the parked or retried copy is published before the task returns, so the original is
  acknowledged only after its copy is stored. With ``confirm_publish`` (py-amqp) the publish
  waits for RabbitMQ's confirm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

try:
    import celery
    from celery.exceptions import Ignore, Reject, Retry
    from celery.signals import before_task_publish
    from celery.worker.request import Request
    from kombu.entity import Queue
except ModuleNotFoundError as _error:  # pragma: no cover - depends on the environment
    from .._extras import missing_extra

    raise missing_extra(__name__, "celery", _error) from _error

from .._clock import Clock
from .._context import current
from .._durable import (
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    Envelope,
    EnvelopeError,
    MessagePolicy,
    Park,
    RetryLater,
    SyncMessageRunner,
)
from .._durable.envelope import ENQUEUED_AT_FIELD, KEY_FIELD
from ..events import EventHub, MessagePublished, hub
from ._amqp import PARK_ID_FIELD, parked_queue

__all__ = ["PARKED_STATE", "BrownoutCelery", "BrownoutRequest", "BrownoutTask", "install"]

PARKED_STATE = "PARKED"
"""The result state of a parked task (stored when the task keeps results)."""


class BrownoutCelery:
    """What `install` set up for one app: the publish handler and the workers' runners.
    One per process (the last `install` wins); `uninstall` disconnects it."""

    def __init__(
        self,
        app: celery.Celery,
        *,
        policy: MessagePolicy | None,
        ttl: float | None,
        events: EventHub,
        wall: Callable[[], float],
        clock: Clock | None,
    ) -> None:
        if ttl is not None and not 0 < ttl < float("inf"):
            raise ValueError("ttl must be None or positive and finite")
        self.app = app
        self.policy = policy if policy is not None else MessagePolicy()
        self.ttl = ttl
        self.events = events
        self.wall = wall
        self.clock = clock
        self._runners: dict[str, SyncMessageRunner] = {}
        self._declared: set[str] = set()

    def runner(self, queue: str) -> SyncMessageRunner:
        """The runner of ``queue`` (one per queue, sharing the policy and its budget)."""
        found = self._runners.get(queue)
        if found is None:
            found = self._runners[queue] = SyncMessageRunner(
                _Broker(self),
                queue=queue,
                policy=self.policy,
                passthrough=(Retry, Ignore, Reject),
                events=self.events,
                wall=self.wall,
                clock=self.clock,
            )
        return found

    # -- publish ---------------------------------------------------------------------------
    def stamp(self, sender: str, headers: dict[str, Any], routing_key: str) -> None:
        """Stamp the envelope on a task message's ``headers`` (in place)."""
        if PARK_REASON_FIELD in headers:
            return  # a parked copy: brownout's own, left as it is
        if ENQUEUED_AT_FIELD in headers:
            try:
                envelope = Envelope.decode(headers)
            except EnvelopeError:
                return  # a worker parks it as malformed
        else:
            task = self.app.tasks.get(sender)
            ttl = getattr(task, "brownout_ttl", None)
            key = headers.get(KEY_FIELD)
            envelope = Envelope.stamp(
                self.wall(),
                current(),
                ttl=ttl if ttl is not None else self.ttl,
                idempotency_key=key if isinstance(key, str) and key else None,
                operation=sender,
            )
            headers.update(envelope.encode())
            if self.events.enabled:
                self.events.emit(
                    MessagePublished(
                        self.events_clock(),
                        routing_key,
                        envelope.operation,
                        envelope.priority,
                        envelope.caller,
                        valid_for=envelope.remaining(envelope.enqueued_at),
                    )
                )
        if envelope.valid_until is not None:
            headers["expires"] = _earlier(headers.get("expires"), envelope.valid_until)

    def events_clock(self) -> float:
        return self.clock.now() if self.clock is not None else time.monotonic()

    def _on_publish(
        self,
        sender: str | None = None,
        headers: dict[str, Any] | None = None,
        routing_key: str | None = None,
        **_: Any,
    ) -> None:
        if headers is not None and sender is not None:
            self.stamp(sender, headers, routing_key or "")

    def connect(self) -> None:
        before_task_publish.connect(self._on_publish, weak=False, dispatch_uid=_UID)

    def uninstall(self) -> None:
        """Stop stamping publishes (workers fall back to a default policy)."""
        before_task_publish.disconnect(dispatch_uid=_UID)
        global _installed
        if _installed is self:
            _installed = None

    # -- park ------------------------------------------------------------------------------
    def publish_parked(
        self, task: celery.Task, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        """Publish a copy of ``task``'s current message to ``<queue>.parked`` (returns once
        published; confirmed with ``confirm_publish``)."""
        request = task.request
        queue = _queue_of(request)
        name = parked_queue(queue)
        app = self.app
        message = app.amqp.as_task_v2(
            request.id,
            task.name,
            args=request.args,
            kwargs=request.kwargs,
            group_id=request.group,
            group_index=request.group_index,
            retries=request.retries or 0,
            chord=request.chord,
            callbacks=request.callbacks,
            errbacks=request.errbacks,
            reply_to=request.reply_to,
            root_id=request.root_id,
            parent_id=request.parent_id,
            shadow=request.shadow,
            chain=request.chain,
            origin=request.origin,
            ignore_result=bool(request.ignore_result),
        )
        headers = dict(message.headers)
        own = dict(request.headers or {})
        if envelope is None:  # unreadable: keep what came, for whoever inspects it
            headers.update(own)
        else:
            headers.update({k: v for k, v in own.items() if not k.startswith("brownout-")})
            headers.update(envelope.encode())
        headers[PARK_REASON_FIELD] = reason
        headers[PARK_DETAIL_FIELD] = detail[:1000]
        headers[PARKED_AT_FIELD] = repr(self.wall())
        headers[PARK_ID_FIELD] = request.id or ""
        declare = [] if name in self._declared else [Queue(name, durable=True)]  # type: ignore[no-untyped-call]
        with app.producer_or_acquire() as producer:
            producer.publish(
                message.body,
                exchange="",
                routing_key=name,
                headers=headers,
                serializer=task.serializer or app.conf.task_serializer,
                delivery_mode=2,
                declare=declare,
                retry=True,
                **message.properties,
            )
        self._declared.add(name)

    def __repr__(self) -> str:
        return f"BrownoutCelery(app={self.app.main!r}, policy={self.policy!r})"


_UID = "brownout.integrations.celery"
_installed: BrownoutCelery | None = None


def install(
    app: celery.Celery,
    *,
    policy: MessagePolicy | None = None,
    ttl: float | None = None,
    events: EventHub = hub,
    wall: Callable[[], float] = time.time,
    clock: Clock | None = None,
) -> BrownoutCelery:
    """Stamp every task published in this process with the envelope, and run `BrownoutTask`
    tasks by ``policy``. ``ttl``: the valid-until of a task published outside any request
    (and the longest of one inside), unless the task declares ``brownout_ttl``; ``None``:
    no deadline of its own."""
    global _installed
    if _installed is not None:
        _installed.uninstall()
    installed = BrownoutCelery(app, policy=policy, ttl=ttl, events=events, wall=wall, clock=clock)
    installed.connect()
    _installed = installed
    return installed


def _current_install(app: celery.Celery) -> BrownoutCelery:
    global _installed
    if _installed is None:  # a worker that never called install(): the default policy
        _installed = BrownoutCelery(
            app, policy=None, ttl=None, events=hub, wall=time.time, clock=None
        )
    return _installed


class BrownoutRequest(Request):  # type: ignore[misc]
    """Celery's worker request, except that a task carrying brownout's envelope is not
    discarded at its ``expires``: `BrownoutTask` parks it instead."""

    def maybe_expire(self) -> bool | None:
        if ENQUEUED_AT_FIELD in self._request_dict:
            return None
        result: bool | None = super().maybe_expire()
        return result


class _Delivery:
    """A Celery task's current message as the core's `brownout.durable.Delivery`."""

    __slots__ = ("body", "headers", "redeliveries", "retry", "task")

    def __init__(self, task: celery.Task) -> None:
        request = task.request
        self.task = task
        self.body = b""  # (the task's arguments are its own: args and kwargs)
        self.headers: Mapping[str, Any] = request.headers or {}
        info = request.delivery_info or {}
        self.redeliveries = 1 if info.get("redelivered") else 0
        self.retry: Retry | None = None


class _Broker:
    """The core's `brownout.durable.SyncMessageBroker` on Celery: Celery acknowledges the
    message itself once the task returns (``acks_late``)."""

    def __init__(self, installed: BrownoutCelery) -> None:
        self.installed = installed

    def ack(self, delivery: _Delivery) -> None:
        return None

    def retry_later(self, delivery: _Delivery, envelope: Envelope, delay: float) -> None:
        own = {k: v for k, v in delivery.headers.items() if not k.startswith("brownout-")}
        delivery.retry = delivery.task.retry(
            countdown=delay, headers={**own, **envelope.encode()}, throw=False
        )

    def park(
        self, delivery: _Delivery, envelope: Envelope | None, reason: str, detail: str
    ) -> None:
        self.installed.publish_parked(delivery.task, envelope, reason, detail)


class BrownoutTask(celery.Task):  # type: ignore[misc]
    """A Celery task base (``@app.task(base=BrownoutTask)``) whose messages are run, retried
    or parked by the installed `brownout.durable.MessagePolicy`.

    ``brownout_ttl``: the task's own valid-until when published (seconds). Celery's
    ``max_retries`` is off (the policy's ``max_attempts`` counts); messages are acknowledged
    late and requeued when the worker is lost. A parked task raises Celery's ``Ignore``
    after storing the `PARKED_STATE` result (when results are kept).
    """

    Request = BrownoutRequest
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None
    brownout_ttl: float | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return self.run(*args, **kwargs)
        installed = _current_install(self.app)
        delivery = _Delivery(self)
        outcome = installed.runner(_queue_of(request)).process(
            delivery, lambda _message: self.run(*args, **kwargs)
        )
        decision = outcome.decision
        if isinstance(decision, RetryLater) and delivery.retry is not None:
            raise delivery.retry
        if isinstance(decision, Park):
            if not self.ignore_result and not request.ignore_result:
                self.update_state(
                    state=PARKED_STATE,
                    meta={"reason": decision.reason.value, "detail": decision.detail},
                )
            raise Ignore()
        return outcome.result


def _queue_of(request: Any) -> str:
    info = request.delivery_info or {}
    key = info.get("routing_key")
    return key if isinstance(key, str) and key else "celery"


def _earlier(existing: object, valid_until: float) -> str:
    """Celery's ``expires`` (ISO 8601): ``valid_until``, or ``existing`` when earlier."""
    ours = datetime.fromtimestamp(valid_until, UTC)
    if isinstance(existing, str):
        try:
            theirs = datetime.fromisoformat(existing)
        except ValueError:
            theirs = None
        if theirs is not None and theirs.tzinfo is not None and theirs < ours:
            return existing
    return ours.isoformat()
