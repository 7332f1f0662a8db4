"""grpc.aio idempotency interceptor: `brownout.idempotency.Idempotency` for unary RPCs.

::

    server = grpc.aio.server(interceptors=[
        BrownoutServerInterceptor(policy), IdempotencyServerInterceptor(idempotency)
    ])

List it *after* `BrownoutServerInterceptor` (the first listed runs outermost), so it sees the
caller, the operation and the deadline in ``brownout.current()``. It translates only:
`Idempotency.begin` decides. The key is the ``idempotency-key`` metadata; the method is
``POST`` (what a gRPC call is on the wire) and the target the full method name, and the
fingerprint's body is the serialized request. The stored answer is the serialized response
message: a replay sends those bytes again (through the method's own serializer, untouched)
with initial metadata ``idempotent-replayed: true``. Refusals end the call with the layer's
``grpc_code`` and detail and trailing metadata ``brownout-reason``. Streaming RPCs pass
through untouched. A handler that aborts the call or raises releases the key; one that is
cancelled abandons it (see docs/idempotency.md).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

try:
    import grpc
    import grpc.aio
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "grpc", e) from e

from .._context import get_current
from .._errors import DeadlineExceeded
from .._idempotency import (
    IDEMPOTENCY_KEY_HEADER,
    REPLAYED_HEADER,
    Idempotency,
    IdempotentAnswer,
)
from .._propagation import REFUSAL_REASON_KEY

__all__ = ["IdempotencyServerInterceptor"]


class _Raw:
    """Bytes already serialized: a stored answer, or the handler's answer serialized once."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Request:
    """The deserialized request and the bytes it came from (the fingerprint's body)."""

    __slots__ = ("data", "message")

    def __init__(self, data: bytes, message: Any) -> None:
        self.data = data
        self.message = message


def _metadata_value(context: grpc.aio.ServicerContext[Any, Any], name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


async def _refuse(
    answer: IdempotentAnswer, context: grpc.aio.ServicerContext[Any, Any]
) -> NoReturn:
    context.set_trailing_metadata(((REFUSAL_REASON_KEY, f"idempotency_{answer.outcome}"),))
    await context.abort(getattr(grpc.StatusCode, answer.grpc_code), answer.detail)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


class IdempotencyServerInterceptor(grpc.aio.ServerInterceptor):
    """Applies an `Idempotency` layer to the unary-unary RPCs of a ``grpc.aio`` server."""

    def __init__(self, idempotency: Idempotency) -> None:
        self.idempotency = idempotency
        self._wrapped: dict[
            str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]
        ] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        method: str = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        if len(self._wrapped) < 4096:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        idem = self.idempotency
        des = handler.request_deserializer
        ser = handler.response_serializer
        behavior: Callable[..., Any] | None = handler.unary_unary
        assert behavior is not None

        def deserialize(data: bytes) -> _Request:
            return _Request(data, des(data) if des is not None else data)

        def serialize(message: Any) -> bytes:
            if isinstance(message, _Raw):
                return message.data
            return ser(message) if ser is not None else message

        async def unary(request: _Request, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            ctx = get_current()
            operation = ctx.operation if ctx.operation != "unknown" else method
            rule = idem.rule_for(operation, "POST")

            async def call() -> Any:
                assert behavior is not None
                result = behavior(request.message, context)
                if inspect.isawaitable(result):
                    result = await result
                return result

            if rule is None:
                return await call()
            result = await idem.begin(
                method="POST",
                target=method,
                operation=operation,
                key=_metadata_value(context, IDEMPOTENCY_KEY_HEADER),
                body=request.data,
                rule=rule,
            )
            if result is None:
                return await call()
            if isinstance(result, IdempotentAnswer):
                if not result.replayed:
                    await _refuse(result, context)
                await context.send_initial_metadata(((REPLAYED_HEADER, "true"),))
                return _Raw(result.body)
            ticket = result
            try:
                answer = await call()
            except (asyncio.CancelledError, DeadlineExceeded):
                ticket.abandon()
                raise
            except BaseException:
                await ticket.release()
                raise
            code = context.code() if hasattr(context, "code") else None
            if answer is None or (code is not None and code != grpc.StatusCode.OK):
                await ticket.release()  # the handler ended the call with a status: not done
                return answer
            data = serialize(answer)
            instead = await ticket.complete(200, (), data)
            if instead is not None:
                await _refuse(instead, context)
            return _Raw(data)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserialize, response_serializer=serialize
        )
