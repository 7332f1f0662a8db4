"""ASGI idempotency middleware: `brownout.idempotency.Idempotency` for Starlette, FastAPI and
any ASGI application.

::

    app.add_middleware(IdempotencyMiddleware, idempotency=idempotency)
    app.add_middleware(BrownoutMiddleware, policy=policy)  # the last added runs outermost

Place it *inside* `BrownoutMiddleware`: it reads the caller (keys are bound to it), the
operation (the route template) and the deadline (the lease) from ``brownout.current()``.
It translates only; `Idempotency.begin` decides. Per covered request it reads the body
(bounded by ``max_body``), asks, and then either writes the answer it got (a replay, marked
``idempotent-replayed: true``, or a problem+json refusal) without calling the application, or
calls it holding the key. Such a response is buffered (bounded by ``max_response``: past it,
it streams on and the key is released); on PostgreSQL it is committed *before* the client
sees it, elsewhere it is sent first and stored right after (`Ticket.commits_first`), which
saves the client a round trip. A cancelled application abandons the key, one that raises
releases it (see docs/idempotency.md).
"""

from __future__ import annotations

import asyncio

from .._context import get_current
from .._errors import DeadlineExceeded
from .._idempotency import IDEMPOTENCY_KEY_HEADER, Idempotency, IdempotentAnswer
from ._asgi_exchange import ASGIApp, Message, Receive, Scope, Send

__all__ = ["IdempotencyMiddleware"]

_KEY = IDEMPOTENCY_KEY_HEADER.encode()
_NO_TEMPLATE = frozenset(("unknown", "unmatched"))
"""Operations that name no route (outside the edge, or no template): the path stands in."""


async def _write(answer: IdempotentAnswer, send: Send) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
    if not any(k == b"content-length" for k, _ in headers):
        headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


class IdempotencyMiddleware:
    """Applies an `Idempotency` layer to the HTTP requests of an ASGI application."""

    def __init__(self, app: ASGIApp, idempotency: Idempotency) -> None:
        self.app = app
        self.idempotency = idempotency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        idem = self.idempotency
        ctx = get_current()
        operation = ctx.operation
        if operation in _NO_TEMPLATE:
            operation = scope["path"]
        method: str = scope["method"]
        rule = idem.rule_for(operation, method)
        if rule is None:
            await self.app(scope, receive, send)
            return
        key = None
        for name, value in scope["headers"]:
            if name.lower() == _KEY:
                key = value.decode("latin-1")
                break
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived: nothing to run
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > idem.max_body:
                await _write(idem.too_large(operation), send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        result = await idem.begin(
            method=method,
            target=target.decode("latin-1"),
            operation=operation,
            key=key,
            body=body,
            rule=rule,
        )
        if isinstance(result, IdempotentAnswer):
            await _write(result, send)
            return
        replayed = False

        async def replay_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if result is None:
            await self.app(scope, replay_body, send)
            return
        ticket = result
        start: Message | None = None
        parts: list[bytes] = []
        held = 0
        streaming = False

        async def capture(message: Message) -> None:
            nonlocal start, held, streaming
            kind = message["type"]
            if streaming or kind not in ("http.response.start", "http.response.body"):
                await send(message)
                return
            if kind == "http.response.start":
                start = message
                return
            chunk = message.get("body", b"")
            held += len(chunk)
            parts.append(chunk)
            assert start is not None
            if held > idem.max_response:
                streaming = True
                await ticket.unstorable()
                await send(start)
                await send({**message, "body": b"".join(parts)})
                return
            if message.get("more_body", False):
                return
            raw: list[tuple[bytes, bytes]] = list(start.get("headers", ()))
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
            full = b"".join(parts)
            if not ticket.commits_first:
                await send(start)
                await send({"type": "http.response.body", "body": full})
                await ticket.complete(start["status"], headers, full)
                return
            instead = await ticket.complete(start["status"], headers, full)
            if instead is not None:
                await _write(instead, send)
                return
            await send(start)
            await send({"type": "http.response.body", "body": full})

        try:
            await self.app(scope, replay_body, capture)
        except (asyncio.CancelledError, DeadlineExceeded):
            ticket.abandon()
            raise
        except BaseException:
            await ticket.release()
            raise
        await ticket.release()  # (no-op once completed) an app that never finished its answer
