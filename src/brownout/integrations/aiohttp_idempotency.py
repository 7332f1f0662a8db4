"""aiohttp idempotency middleware: `brownout.idempotency.Idempotency` for ``aiohttp.web``.

::

    app = web.Application(
        middlewares=[brownout_middleware(policy), idempotency_middleware(idempotency)]
    )

List it *after* the brownout middleware (aiohttp runs the first listed outermost), so it sees
the caller, the operation and the deadline in ``brownout.current()``. It translates only:
`Idempotency.begin` decides. A covered request's body is read (aiohttp keeps it for the
handler) and bounded by ``max_body``; a replay or refusal is answered without calling the
handler; otherwise the handler runs holding the key, and its ``web.Response`` is stored (or
committed, on PostgreSQL) before it is returned. A prepared ``StreamResponse`` or a streamed
payload cannot be replayed: the key is released (``unstorable``). ``web.HTTPException``
responses raised by the handler are answers like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

try:
    from aiohttp import web
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "aiohttp", e) from e

from .._context import get_current
from .._errors import DeadlineExceeded
from .._idempotency import IDEMPOTENCY_KEY_HEADER, Idempotency, IdempotentAnswer, Ticket

__all__ = ["idempotency_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _answer(answer: IdempotentAnswer) -> web.Response:
    headers = [(k, v) for k, v in answer.headers if k != "content-length"]
    return web.Response(status=answer.status, body=answer.body, headers=headers)


async def _settle(ticket: Ticket, response: web.StreamResponse) -> web.StreamResponse:
    body = getattr(response, "body", None) if not response.prepared else None
    if isinstance(body, (bytes, bytearray)) or (
        body is None and isinstance(response, web.Response)
    ):
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-length"]
        instead = await ticket.complete(response.status, headers, bytes(body or b""))
        if instead is not None:
            return _answer(instead)
        return response
    await ticket.unstorable()
    return response


def idempotency_middleware(
    idempotency: Idempotency,
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """An aiohttp middleware applying ``idempotency`` to every request it covers."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        ctx = get_current()
        operation = ctx.operation
        if operation in ("unknown", "unmatched"):
            info = request.match_info.route.resource
            operation = info.canonical if info is not None else request.path
        rule = idempotency.rule_for(operation, request.method)
        if rule is None:
            return await handler(request)
        if request.content_length is not None and request.content_length > idempotency.max_body:
            return _answer(idempotency.too_large(operation))
        body = await request.read()
        result = await idempotency.begin(
            method=request.method,
            target=request.raw_path,
            operation=operation,
            key=request.headers.get(IDEMPOTENCY_KEY_HEADER),
            body=body,
            rule=rule,
        )
        if result is None:
            return await handler(request)
        if isinstance(result, IdempotentAnswer):
            return _answer(result)
        ticket = result
        try:
            response = await handler(request)
        except web.HTTPException as answer:
            await _settle(ticket, answer)
            raise
        except (asyncio.CancelledError, DeadlineExceeded):
            ticket.abandon()
            raise
        except BaseException:
            await ticket.release()
            raise
        return await _settle(ticket, response)

    return middleware
