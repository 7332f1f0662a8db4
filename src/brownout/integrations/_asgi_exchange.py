"""One HTTP request through the ASGI middleware, and what the edge writes on it.

`Exchange` is the `Flight` the edge shares with the middleware, plus the tracked ``send``
(status, ``brownout-degraded`` on the response head) and, when watching for disconnects, the
``receive`` the application reads through. `write_refusal` encodes a `Refusal` for ASGI.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .._degrade.markers import fallback_marks
from .._degrade.modes import DEGRADED_HEADER
from .._edge import (
    ActiveModes,
    Flight,
    Refusal,
    Repeated,
    announced_modes,
    header_value,
    refusal_headers,
)

__all__ = [
    "DEGRADED_BYTES",
    "WATCH_READ_AHEAD",
    "ASGIApp",
    "Exchange",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "declares_no_body",
    "refusal_head",
    "write_answer",
    "write_refusal",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEGRADED_BYTES = DEGRADED_HEADER.encode("latin-1")

_WRITING: set[asyncio.Task[None]] = set()
"""Answers written at a deadline while their handler still runs (held until written)."""


async def _discarded() -> None:
    return None


WATCH_READ_AHEAD = 64 * 1024
"""Bytes of request body the disconnect watch reads ahead of the application (held for its
``receive``) before it stops and waits for the application to catch up."""


class Exchange(Flight):
    """One HTTP request through the middleware: the `Flight` the edge shares, the tracked
    ``send``, the call of the application and, when watching for disconnects, the wrapped
    ``receive``. One object instead of a flight, a receiver and closures over both: the
    hot path allocates less.

    As ``receive``, it lets the middleware listen for ``http.disconnect`` while the
    application may still call ``receive`` itself (messages are handed over, never lost)."""

    __slots__ = (
        "answering",
        "app",
        "body_done",
        "buffered",
        "degraded",
        "disconnected",
        "reading",
        "response_done",
        "resume_watch",
        "scope",
        "send",
        "server_receive",
        "waiter",
        "watch",
        "watcher",
        "watching",
    )

    def __init__(
        self,
        started: float,
        app: ASGIApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        degraded: ActiveModes | None,
        watch: bool,
    ) -> None:
        # A request for `EdgePolicy.serve`, which sets what it decides (classification,
        # deadline, task) and reports the lifecycle when there is no bulkhead. The express
        # path (`BrownoutMiddleware.__call__`) builds its exchanges inline, field by field.
        # Flight's fields, set here rather than through Flight.__init__ (one call less).
        # ``on_old`` stays None: the sweep calls `old` (no bound method, no reference cycle).
        self.started = started
        self.on_old = None
        self.task = None
        self.timer = None
        self.deadline = None
        self.classification = None
        self.quota = None
        self.admitted = False
        self.response_started = False
        self.status = 0
        self.abandoned = False
        self.expired = False
        self.answered = False
        self.answering: asyncio.Task[None] | None = None
        """The refusal being written at the deadline (`answer_now`)."""
        self.reports = True
        self.app = app
        self.scope = scope
        self.server_receive = receive
        self.watch = watch
        """Listen for ``http.disconnect`` once old: the application's ``receive`` is then
        this exchange (`__call__`), never the server's directly."""
        self.send = send
        self.degraded = degraded
        self.watcher: asyncio.Task[None] | None = None
        self.buffered: deque[Message] | None = None
        self.waiter: asyncio.Future[Message] | None = None
        self.body_done = False
        self.disconnected = False
        self.reading = False
        self.watching = False
        self.resume_watch = False
        """The watch stopped at a body message the application had not read yet: it resumes
        once the application has read the body (`__call__`)."""
        self.response_done = False
        """Set once the last response byte left: servers answer ``receive`` with
        ``http.disconnect`` after that, which is not the client going away."""

    def header(self, name: str) -> bytes | Repeated | None:
        """The request's header ``name`` (lower case), as `EdgePolicy.serve` reads them (the
        edge's lookup, repeated values included): a bound method of the exchange instead of
        a closure built per request."""
        return header_value(self.scope["headers"], name)

    def run(self) -> Awaitable[None]:
        """The application's call, as `EdgePolicy.serve` wants it."""
        return self.app(self.scope, self if self.watch else self.server_receive, self.tracked_send)

    def tracked_send(self, message: Message) -> Awaitable[None]:
        # Not a coroutine: it notes the message and returns the server's ``send`` awaitable,
        # so the response path has no extra coroutine frame per message.
        if self.answered:
            return _discarded()  # the edge answered at the deadline: this answer is late
        kind = message["type"]
        if kind == "http.response.start":
            self.response_started = True
            self.status = message["status"]
            modes = self.degraded
            if modes is not None:
                self._announce_degraded(message, modes)
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.response_done = True
        send = self.send  # (a slot read, then a call: ``self.send(...)`` is not specialized)
        return send(message)

    def answer_now(self, refusal: Any) -> bool:
        """`Flight.answer_now`: write the refusal from a task of its own, while the handler
        (which ignored its cancellation) may still run; its later messages are discarded."""
        task = asyncio.get_running_loop().create_task(write_refusal(refusal, self.send))
        _WRITING.add(task)
        task.add_done_callback(_WRITING.discard)
        self.answering = task
        return True

    async def answered_at_deadline(self) -> None:
        """Wait until the answer `answer_now` started is written: the application's call
        must not end before it (a server answers 500 for a call that ends unanswered)."""
        task = self.answering
        if task is not None:
            await asyncio.shield(task)

    @staticmethod
    def _announce_degraded(start: Message, modes: ActiveModes) -> None:
        # Read as the head leaves, not when the request arrived (the marks are this request's
        # context's: the send runs in the application's task).
        names = announced_modes(modes, fallback_marks())
        if names:
            headers = list(start.get("headers", ()))
            headers.append((DEGRADED_BYTES, ", ".join(names).encode()))
            start["headers"] = headers

    async def __call__(self) -> Message:
        buffer = self.buffered
        if buffer:
            msg = buffer.popleft()
            if not buffer and self.resume_watch and not self.watching:
                # The watch stopped at its read-ahead bound: the application has caught up.
                self.resume_watch = False
                self._start_watch()
            return msg
        if self.watching:
            fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            self.waiter = fut
            return await fut
        self.reading = True
        try:
            msg = await self.server_receive()
        finally:
            self.reading = False
        kind = msg["type"]
        if kind == "http.request":
            if not msg.get("more_body", False):
                self.body_done = True
                if self.resume_watch:
                    self.resume_watch = False
                    self._start_watch()
        elif kind == "http.disconnect":
            self.disconnected = True
        return msg

    def _deliver(self, msg: Message) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(msg)
        else:
            if self.buffered is None:
                self.buffered = deque()
            self.buffered.append(msg)

    def old(self) -> bool:
        """The request is old: listen for a disconnect if the body is consumed. True when
        no further sweeps are needed."""
        if not self.watch or self.response_done:
            return True  # answered; whatever runs now (background tasks) is not abandoned
        if self.disconnected:
            self._disconnected()
            return True
        if not self.reading:
            # Whether or not the application has read (or will ever read) its body: the
            # watch reads what is left of it ahead of the application, bounded
            # (`WATCH_READ_AHEAD`), and replays it to the application's ``receive``.
            self._start_watch()
            return True
        return False  # the application is waiting on the server: try again next sweep

    def _start_watch(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch(self._disconnected))

    def _disconnected(self) -> None:
        if self.abandoned:
            return
        self.abandoned = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    def close(self) -> None:
        """Stop the disconnect watch, if one started (it holds the exchange)."""
        w = self.watcher
        if w is not None:
            self.watcher = None
            if not w.done():
                w.cancel()

    async def _watch(self, on_disconnect: Callable[[], None]) -> None:
        self.watching = True
        ahead = 0
        try:
            while True:
                msg = await self.server_receive()
                if msg["type"] == "http.disconnect":
                    self.disconnected = True
                    self._deliver(msg)
                    if not self.response_done:
                        on_disconnect()
                    return
                was_done = self.body_done
                if not msg.get("more_body", False):
                    self.body_done = True
                self._deliver(msg)
                if was_done:
                    return  # a server that repeats body messages: nothing to watch for
                if not self.body_done:
                    # More body to come, which the application may never read (a handler that
                    # ignores its body must still hear its client leave). Read ahead of it up
                    # to `WATCH_READ_AHEAD` bytes, then hold: reading on would buffer a body of
                    # any size with no backpressure. The watch resumes once the application
                    # has drained the buffer or read the rest itself.
                    ahead += len(msg.get("body", b""))
                    if ahead >= WATCH_READ_AHEAD:
                        self.resume_watch = True
                        return
        finally:
            self.watching = False


def declares_no_body(scope: Scope) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            return bool(v.strip() == b"0")
        if k == b"transfer-encoding":
            return False
    return True


async def write_answer(outcome: Any, send: Send) -> None:
    """Write ``outcome`` if it is a `Refusal` (an abandoned request gets nothing)."""
    if isinstance(outcome, Refusal):
        await write_refusal(outcome, send)


async def write_refusal(refusal: Refusal, send: Send) -> None:
    """Write a refusal as one complete response (the connection stays open)."""
    await send(
        {"type": "http.response.start", "status": refusal.status, "headers": refusal_head(refusal)}
    )
    await send({"type": "http.response.body", "body": refusal.body})


_PAIRS: dict[tuple[str, str], tuple[bytes, bytes]] = {}
"""Encoded header pairs that recur (content type, do-not-retry, common Retry-After values)."""
_LENGTHS: dict[int, tuple[bytes, bytes]] = {}
"""``content-length`` headers by body length (the problem bodies come in a few lengths)."""


def refusal_head(refusal: Refusal) -> list[tuple[bytes, bytes]]:
    """The refusal's response headers (`brownout._edge.refusal_headers`, encoded, with
    ``content-length``): a new list each time (middleware outside may add to it in place),
    of pairs encoded once where they recur."""
    n = len(refusal.body)
    length = _LENGTHS.get(n)
    if length is None:
        length = (b"content-length", b"%d" % n)
        if len(_LENGTHS) < 256:
            _LENGTHS[n] = length
    headers = []
    for pair in refusal_headers(refusal):
        encoded = _PAIRS.get(pair)
        if encoded is None:
            encoded = (pair[0].encode("latin-1"), pair[1].encode("latin-1"))
            if len(_PAIRS) < 512:
                _PAIRS[pair] = encoded
        headers.append(encoded)
    headers.insert(1, length)  # after the content type
    return headers
