"""Celery tasks on a real RabbitMQ (127.0.0.1:5672 or ``BROWNOUT_TEST_RABBITMQ``) through
`brownout.integrations.celery`, with a real Celery worker (threads pool) in a thread: the
envelope and ``expires`` on publish, expired tasks parked (not run, not dropped), transient
failures retried under the budget, the rest parked by reason with their arguments intact.

Each test uses queues of its own (a random name), deleted at teardown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

celery = pytest.importorskip("celery")
aio_pika = pytest.importorskip("aio_pika")

from celery.contrib.testing.worker import start_worker  # noqa: E402
from tests import services  # noqa: E402

import brownout  # noqa: E402
from brownout._retry import ExponentialBackoff  # noqa: E402
from brownout.durable import Envelope, MessagePolicy, ParkedMessage  # noqa: E402
from brownout.events import EventHub, MessageParked, MessageRetried  # noqa: E402
from brownout.integrations.aio_pika import ParkedQueue  # noqa: E402
from brownout.integrations.celery import BrownoutCelery, BrownoutTask, install  # noqa: E402
from brownout.testing import EventRecorder  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("rabbitmq_server")]

AMQP = f"amqp://guest:guest@{services.RABBITMQ.address}/"
WAIT = 20.0
"""Seconds any wait may take on a noisy host before the test fails."""


def fast_policy(**kw: Any) -> MessagePolicy:
    return MessagePolicy(backoff=ExponentialBackoff(0.05, cap=0.1), **kw)


def until(check: Callable[[], bool], timeout: float = WAIT) -> None:
    stop = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < stop, "timed out waiting"
        time.sleep(0.05)


async def _with_channel(fn: Callable[[Any], Any]) -> Any:
    connection = await aio_pika.connect(AMQP)
    try:
        return await fn(await connection.channel())
    finally:
        await connection.close()


def parked(queue: str) -> list[ParkedMessage]:
    async def read(channel: Any) -> list[ParkedMessage]:
        return await ParkedQueue(channel, queue).list()

    return list(asyncio.run(_with_channel(read)))


def depth(name: str) -> int:
    """Ready messages in queue ``name`` (0 when it does not exist yet)."""

    async def read(channel: Any) -> int:
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return 0
        return int(declared.declaration_result.message_count or 0)

    return int(asyncio.run(_with_channel(read)))


def take_one(name: str) -> Any:
    async def read(channel: Any) -> Any:
        queue = await channel.declare_queue(name, passive=True)
        message = await queue.get(no_ack=True, timeout=5)
        return message.headers, message.body

    return asyncio.run(_with_channel(read))


class Setup:
    def __init__(self, queue: str, app: Any, events: EventHub) -> None:
        self.queue = queue
        self.app = app
        self.events = events
        self.recorder = EventRecorder(events).start()
        self.installed: BrownoutCelery | None = None

    def install(self, **kw: Any) -> BrownoutCelery:
        self.installed = install(self.app, events=self.events, **kw)
        return self.installed

    def worker(self) -> Any:
        return start_worker(
            self.app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            shutdown_timeout=30,
        )


@pytest.fixture
def setup() -> Iterator[Setup]:
    queue = f"bo-celery-{secrets.token_hex(4)}"
    app = celery.Celery(f"test-{queue}", broker=AMQP, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options={"confirm_publish": True},
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=False,
    )
    # `start_worker` sets the root logger's level to its own loglevel ("error") even without
    # hijacking the root logger; left so, every later test's warnings would be dropped.
    root = logging.getLogger()
    level = root.level
    s = Setup(queue, app, EventHub())
    try:
        yield s
    finally:
        root.setLevel(level)
    s.recorder.stop()
    if s.installed is not None:
        s.installed.uninstall()

    async def clean(channel: Any) -> None:
        for name in (queue, f"{queue}.parked"):
            await channel.queue_delete(name)

    asyncio.run(_with_channel(clean))


def test_a_task_published_in_a_request_carries_expires_and_the_envelope(setup: Setup) -> None:
    setup.install(ttl=60)

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.noop")
    def noop() -> None: ...

    with brownout.request(
        deadline=0.2, priority=brownout.Priority.SHEDDABLE, caller="web", idempotency_key="k-1"
    ):
        before = time.time()
        noop.apply_async()
    headers, _body = take_one(setup.queue)
    envelope = Envelope.decode(headers)
    assert envelope.valid_until is not None
    assert 0.1 < envelope.valid_until - before <= 0.25
    assert envelope.idempotency_key == "k-1"
    assert (envelope.priority, envelope.caller, envelope.attempt) == (
        brownout.Priority.SHEDDABLE,
        "web",
        1,
    )
    expires = datetime.fromisoformat(headers["expires"]).timestamp()
    assert expires == pytest.approx(envelope.valid_until, abs=1e-3)

    noop.apply_async()  # outside any request: the default ttl and a fresh key
    headers, _ = take_one(setup.queue)
    envelope = Envelope.decode(headers)
    assert envelope.valid_until is not None
    assert 59 < envelope.valid_until - envelope.enqueued_at <= 60
    assert envelope.idempotency_key and envelope.idempotency_key != "k-1"


def test_a_task_delayed_past_its_deadline_is_parked_not_run(setup: Setup) -> None:
    setup.install()
    ran: list[int] = []

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.charge")
    def charge(order: int, *, note: str) -> None:
        ran.append(order)

    with brownout.request(deadline=0.2, idempotency_key="order-7"):
        charge.apply_async((7,), {"note": "late"})
    time.sleep(0.5)  # no worker yet: the queue is backed up past the deadline
    with setup.worker():
        until(lambda: depth(f"{setup.queue}.parked") == 1)
    assert ran == []
    [p] = parked(setup.queue)
    assert p.reason == "expired"
    assert p.envelope is not None and p.envelope.idempotency_key == "order-7"
    args, kwargs, _embed = json.loads(p.body)
    assert (args, kwargs) == ([7], {"note": "late"})
    assert depth(setup.queue) == 0  # acknowledged, not left behind
    [event] = setup.recorder.of(MessageParked)
    assert (event.reason, event.source) == ("expired", setup.queue)


def test_a_transient_failure_is_retried_with_the_same_key_and_succeeds(setup: Setup) -> None:
    setup.install(policy=fast_policy(max_attempts=5), ttl=60)
    seen: list[tuple[int, str | None]] = []
    done = threading.Event()

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.flaky")
    def flaky() -> str:
        ctx = brownout.current()
        seen.append((ctx.attempt, ctx.idempotency_key))
        if len(seen) < 3:
            raise ConnectionError("transient")
        done.set()
        return "ok"

    with brownout.request(idempotency_key="pay-1"):
        flaky.apply_async()
    with setup.worker():
        assert done.wait(WAIT)
    assert seen == [(1, "pay-1"), (2, "pay-1"), (3, "pay-1")]
    retried = setup.recorder.of(MessageRetried)
    assert [e.attempt for e in retried] == [2, 3]
    assert all(e.cause == "ConnectionError" and e.delay <= 0.1 for e in retried)
    assert depth(f"{setup.queue}.parked") == 0


def test_retries_past_the_budget_wait_for_the_longest_backoff(setup: Setup) -> None:
    budget = brownout.RetryBudget(ratio=0.0, min_per_second=0.0)
    setup.install(policy=fast_policy(max_attempts=3, retry_budget=budget), ttl=60)
    attempts: list[int] = []

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.down")
    def down() -> None:
        attempts.append(brownout.current().attempt)
        raise ConnectionError("still down")

    down.apply_async()
    with setup.worker():
        until(lambda: depth(f"{setup.queue}.parked") == 1)
    assert attempts == [1, 2, 3]
    retried = setup.recorder.of(MessageRetried)
    assert [(e.budget_exhausted, e.delay) for e in retried] == [(True, 0.1), (True, 0.1)]
    [p] = parked(setup.queue)
    assert p.reason == "attempts"
    assert p.envelope is not None and p.envelope.attempt == 3


def test_a_failure_past_its_attempts_or_permanent_is_parked_with_its_key(
    setup: Setup,
) -> None:
    setup.install(policy=fast_policy(max_attempts=2), ttl=60)
    keys: list[str | None] = []

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.fails")
    def fails(kind: str) -> None:
        keys.append(brownout.current().idempotency_key)
        raise (ConnectionError if kind == "transient" else ValueError)(kind)

    with brownout.request(idempotency_key="job-1"):
        fails.apply_async(("transient",))
    fails.apply_async(("permanent",))
    with setup.worker():
        until(lambda: depth(f"{setup.queue}.parked") == 2)
    by_reason = {p.reason: p for p in parked(setup.queue)}
    assert set(by_reason) == {"attempts", "failed"}
    assert json.loads(by_reason["attempts"].body)[0] == ["transient"]
    assert keys.count("job-1") == 2  # the same key on both attempts
    assert len(keys) == 3


def test_malformed_brownout_headers_are_parked_never_run_nor_lost(setup: Setup) -> None:
    setup.install(ttl=60)
    ran: list[str] = []

    @setup.app.task(base=BrownoutTask, name=f"{setup.queue}.odd")
    def odd(x: str) -> None:
        ran.append(x)

    odd.apply_async(("a",), headers={"brownout-enqueued-at": "yesterday"})
    odd.apply_async(("b",), headers={"brownout-attempt": "-3", "brownout-enqueued-at": "1"})
    with setup.worker():
        until(lambda: depth(f"{setup.queue}.parked") == 2)
    assert ran == []
    found = parked(setup.queue)
    assert [p.reason for p in found] == ["malformed", "malformed"]
    assert sorted(json.loads(p.body)[0][0] for p in found) == ["a", "b"]
    assert depth(setup.queue) == 0


def test_the_docs_examples_run_against_rabbitmq(setup: Setup) -> None:
    """docs/celery.md's ```python blocks, run in a fresh interpreter on a queue of its own."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "celery.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 2
    host = services.RABBITMQ.address
    script = (
        "\n".join(blocks).replace('"emails"', repr(setup.queue)).replace("127.0.0.1:5672", host)
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{root / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert "sending receipt 42 attempt 1" in out
    assert re.search(r"parked \[\[43\], \{\}, .*\] because expired", out), out
