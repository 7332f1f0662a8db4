"""Issue 24, the adapters: what every server adapter must do the same way, over loopback.

- Long-lived connections (ASGI websocket scopes, aiohttp websocket upgrades) go through the
  edge: admitted at connect, refused with 503 while full, no request deadline on their
  lifetime; ``lifespan`` scopes still pass through.
- A client that leaves is noticed even when the handler never reads the request body.
- A handler that ignores its cancellation does not answer late: the edge answers 504 at the
  deadline, counts the overrun and keeps the slot until the handler really returns.
- A grpc.aio refusal has the same status and trailers for every RPC shape.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from tests.integration.servers import serve

from brownout import Bulkhead, EdgePolicy, InboundDeadlinePolicy, Stats
from brownout.events import EventHub
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

pytestmark = pytest.mark.integration


def _hub() -> tuple[EventHub, Stats, list[Any]]:
    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    seen: list[Any] = []

    class Keep:
        def emit(self, event: Any) -> None:
            seen.append(event)

    hub.subscribe(Keep())
    return hub, stats, seen


def _one_slot(hub: EventHub) -> Bulkhead:
    return Bulkhead("api", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.05), events=hub)


# -- 3. a client that leaves while its body is unread ---------------------------------------


async def test_asgi_disconnect_noticed_while_the_body_is_unread() -> None:
    hub, stats, _ = _hub()
    cancelled: list[float] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        started = time.monotonic()
        try:
            await asyncio.sleep(2.0)  # never reads its body
        except asyncio.CancelledError:
            cancelled.append(time.monotonic() - started)
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), events=hub),
        deadline=InboundDeadlinePolicy(default=2.0, maximum=2.0),
        events=hub,
        sweep_period=0.02,
    )
    async with serve(BrownoutMiddleware(app, policy=policy)) as base:
        host, port = base.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await writer.wait_closed()
        for _ in range(300):
            if cancelled:
                break
            await asyncio.sleep(0.01)
    assert cancelled and cancelled[0] < 1.0, cancelled
    assert stats.count("abandoned") == 1
