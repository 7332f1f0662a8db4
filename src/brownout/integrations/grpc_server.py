"""grpc.aio server interceptor: brownout's edge for gRPC services.

::

    server = grpc.aio.server(interceptors=[BrownoutServerInterceptor(policy)])

Per RPC (unary and streaming, in both directions):

- the deadline is the call's own (``context.time_remaining()``, from ``grpc-timeout``, D3),
  an unsigned budget the edge honours by trust as the HTTP edges honour theirs, clamped to
  the route maximum; otherwise the policy's budget metadata / default applies;
- the operation is the full method name (``/pkg.Service/Method``): bounded by the services
  registered; `EdgePolicy.routes` is keyed by it;
- ``brownout-priority`` metadata is honoured only from a trusted source (S4);
- refusals end the call with the policy's gRPC code and details for their reason
  (`EdgePolicy.grpc_code_for`: by default ``UNAVAILABLE`` for capacity,
  ``RESOURCE_EXHAUSTED`` for quota, ``DEADLINE_EXCEEDED`` for expiry, following ``statuses``
  and ``expired_status``), trailing metadata ``grpc-retry-pushback-ms`` (jittered estimate;
  ``-1``: do not retry) and ``brownout-reason``;
- a client cancellation cancels the handler and is counted as abandoned;
- a status the handler ends its call with (``context.abort``, ``context.set_code``) is read
  as its HTTP equivalent (google.rpc.Code's mapping): INTERNAL, UNKNOWN, UNAVAILABLE,
  DATA_LOSS, UNIMPLEMENTED and DEADLINE_EXCEEDED are failures of the service, the others
  (NOT_FOUND, INVALID_ARGUMENT, ...) answers;
- health-checking methods pass straight through.

Streaming responses are relayed with ``context.write`` from inside the request scope, so the
permit is held and the deadline enforced for the whole stream; handlers written either as async
generators or with ``context.write`` both work.

Two paths, one behaviour, as in the HTTP middlewares: a call with nothing to decide (no
brownout metadata, a bulkhead with room and nobody queued) is admitted inline (the express
path, `EdgePolicy.express`); everything else goes through `EdgePolicy.serve`
(``tests/integration/test_grpc_express.py`` holds the two to the same answers and counts).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any, NamedTuple, NoReturn

try:
    import grpc
    import grpc.aio
except ModuleNotFoundError as e:  # the extra is not installed
    from .._extras import missing_extra

    raise missing_extra(__name__, "grpc", e) from e

from .._admission.permit import Permit, Untracked
from .._clock import current_task_of, loop_and_time
from .._context import NO_REQUEST, get_current
from .._degrade.markers import fallback_marks
from .._degrade.modes import DEGRADED_HEADER
from .._edge import (
    ABANDONED,
    EXPRESS_HEADERS,
    STATUS_FOR_GRPC_CODE,
    Abandoned,
    Answered,
    Classification,
    EdgePolicy,
    Express,
    ExpressScope,
    Flight,
    Refusal,
    ResolvedRoute,
    announced_modes,
    metadata_getter,
    refusal_trailers,
)
from .._errors import Reason

__all__ = ["BrownoutServerInterceptor", "GrpcCall", "status_code_for"]

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


class GrpcCall(NamedTuple):
    """What a gRPC classifier and trust function receive: the method, its invocation
    metadata and the servicer context (``peer()``, ``auth_context()``)."""

    method: str
    metadata: Sequence[tuple[str, str | bytes]]
    context: grpc.aio.ServicerContext[Any, Any]


def status_code_for(reason: Reason, policy: EdgePolicy | None = None) -> grpc.StatusCode:
    """The gRPC status a refusal with ``reason`` ends its call with under ``policy``
    (`EdgePolicy.grpc_code_for`; by default RESOURCE_EXHAUSTED for quota, DEADLINE_EXCEEDED
    for expiry, UNAVAILABLE otherwise)."""
    return grpc.StatusCode[(policy or _DEFAULT_POLICY).grpc_code_for(reason)]


_DEFAULT_POLICY = EdgePolicy()


_CLAIMS = frozenset(name.decode("latin-1") for name in EXPRESS_HEADERS)
"""Metadata keys the edge decides about (gRPC keys are lower case)."""


def _key(item: Any) -> str:
    key: str = item[0]
    return key


_HTTP_STATUS = {code: STATUS_FOR_GRPC_CODE.get(code.name, 500) for code in grpc.StatusCode}
"""How the status a handler ended its call with (``context.abort``, ``context.set_code``) is
counted: its HTTP equivalent (`brownout._edge.STATUS_FOR_GRPC_CODE`), 5xx a failure."""
_ANSWERS = (grpc.aio.AbortError,)
"""``context.abort`` raises this: the handler's way to answer, settled by its status."""


_HTTP_STATUS_BY_VALUE = {code.value[0]: status for code, status in _HTTP_STATUS.items()}


def _status_of(context: grpc.aio.ServicerContext[Any, Any]) -> int:
    """The HTTP equivalent of the status the handler set (200 when it set none).

    ``code()`` gives a `grpc.StatusCode` on the grpcio releases tested here, but some releases
    returned the plain integer (grpc/grpc#35450): both are read. Anything else cannot be told
    apart from success, so it counts as one rather than as a failure nobody caused."""
    code = context.code()
    if code is None:
        return 200
    if isinstance(code, grpc.StatusCode):
        return _HTTP_STATUS.get(code, 500)
    if isinstance(code, int):
        return _HTTP_STATUS_BY_VALUE.get(code, 500)
    return 200


Behavior = Callable[[Any, Any], Any] | None

_WRITING: set[asyncio.Task[None]] = set()
"""Calls ended at their deadline while their handler still runs (held until ended)."""


class _Flight(Flight):
    """A `Flight` that can end its call at the deadline while the handler still runs."""

    __slots__ = ("abort_error", "context", "ending")

    def __init__(self, started: float, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        super().__init__(started)
        self.context = context
        self.ending: asyncio.Task[None] | None = None
        self.abort_error: BaseException | None = None

    def answer_now(self, refusal: Any) -> bool:
        """`Flight.answer_now`: end the call with the refusal's status now, from a task of
        its own; whatever the handler returns later is dropped (`_ended`)."""
        task = self.ending = asyncio.get_running_loop().create_task(_abort(refusal, self))
        _WRITING.add(task)
        task.add_done_callback(_WRITING.discard)
        return True


async def _abort(refusal: Refusal, flight: _Flight) -> None:
    try:
        await flight.context.abort(
            grpc.StatusCode[refusal.grpc_code], refusal.grpc_details(), refusal_trailers(refusal)
        )
    except grpc.aio.AbortError as e:
        flight.abort_error = e  # raised by design: the status is on its way


async def _ended(flight: Flight) -> NoReturn:
    """The edge ended the call at its deadline (`_Flight.answer_now`): the handler's task
    ends with the same `AbortError` (grpc.aio checks it is the one its abort raised)."""
    assert isinstance(flight, _Flight)
    if flight.ending is not None:
        await flight.ending
    if flight.abort_error is not None:
        raise flight.abort_error
    raise asyncio.CancelledError


class BrownoutServerInterceptor(grpc.aio.ServerInterceptor):
    """Applies an `EdgePolicy` to every RPC of a ``grpc.aio`` server."""

    def __init__(
        self, policy: EdgePolicy, *, health_methods: Collection[str] = HEALTH_METHODS
    ) -> None:
        self.policy = policy
        self.health_methods = frozenset(health_methods)
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
        if handler is None:
            return handler
        method: str = handler_call_details.method
        if method in self.health_methods:
            return handler
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
        route = self.policy.route(method)
        express = self.policy.express(route)
        des = handler.request_deserializer
        ser = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(method, route, express, handler.stream_stream),
                request_deserializer=des,
                response_serializer=ser,
            )
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(method, route, express, handler.stream_unary),
                request_deserializer=des,
                response_serializer=ser,
            )
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(method, route, express, handler.unary_stream),
                request_deserializer=des,
                response_serializer=ser,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(method, route, express, handler.unary_unary),
            request_deserializer=des,
            response_serializer=ser,
        )

    def _unary(
        self, method: str, route: ResolvedRoute, express: Express | None, behavior: Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        policy = self.policy

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async def call() -> Any:
                assert behavior is not None
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result

            return await _run(policy, method, route, express, context, call)

        return unary

    def _streaming(
        self, method: str, route: ResolvedRoute, express: Express | None, behavior: Behavior
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]:
        policy = self.policy

        async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            async def call() -> None:
                assert behavior is not None
                result = behavior(request, context)
                if inspect.isawaitable(result):  # the handler writes with context.write
                    await result
                    return
                if hasattr(result, "__aiter__"):
                    agen: AsyncIterator[Any] = result
                    async for message in agen:
                        await context.write(message)
                    return
                for message in result:  # a plain generator
                    await context.write(message)

            await _run(policy, method, route, express, context, call)

        return streaming


async def _run(
    policy: EdgePolicy,
    method: str,
    route: ResolvedRoute,
    express: Express | None,
    context: grpc.aio.ServicerContext[Any, Any],
    call: Callable[[], Awaitable[Any]],
) -> Any:
    loop, started = loop_and_time()  # one clock-cache lookup, not asyncio's system call
    metadata: Any = context.invocation_metadata() or ()
    remaining = context.time_remaining()
    if (
        express is not None
        and get_current() is NO_REQUEST
        and _CLAIMS.isdisjoint(map(_key, metadata))
    ):
        # The call's own deadline, as `serve` takes it (trust decides); a spent one is serve's (it
        # answers DEADLINE_EXCEEDED before the work starts).
        request = GrpcCall(method, metadata, context)
        seconds = policy.carried_budget(route, request, remaining)
        admitted = policy.express_admit(express, request, started, seconds)
        if admitted is not None:
            permit, cls = admitted
            return await _express(
                policy, express, context, call, loop, started, seconds, cls, permit
            )
    flight = _Flight(started, context)
    budget = None if remaining is None else max(remaining, 0.0)
    named: tuple[str, ...] | None = None

    async def noted() -> Any:
        nonlocal named
        task = current_task_of(loop)
        assert task is not None
        cancelling = task.cancelling()
        try:
            result = await call()
        except grpc.aio.AbortError:
            flight.status = _status_of(context)
            raise
        flight.status = _status_of(context)
        flight.abandoned = _swallowed(task, cancelling, flight)  # `serve` counts it abandoned
        if policy.degraded is not None:  # here, where this call's fallback marks are set
            named = announced_modes(policy.degraded, fallback_marks())
        return result

    try:
        outcome = await policy.serve(
            GrpcCall(method, metadata, context),
            noted,
            flight,
            route=route,
            get=metadata_getter(metadata),
            budget=budget,
            answers=_ANSWERS,
            loop=loop,
        )
    except asyncio.CancelledError:
        if context.cancelled() or context.done():
            policy.record_abandoned(flight)
        raise
    if isinstance(outcome, Answered):
        await _ended(flight)
    if isinstance(outcome, Refusal) or outcome is ABANDONED:
        await _end(outcome, context)
    if named is None:
        named = policy.degraded_names() if policy.degraded is not None else ()
    _announce_degraded(named, context)
    return outcome


async def _express(
    policy: EdgePolicy,
    express: Express,
    context: grpc.aio.ServicerContext[Any, Any],
    call: Callable[[], Awaitable[Any]],
    loop: asyncio.AbstractEventLoop,
    started: float,
    seconds: float,
    cls: Classification,
    permit: Permit | Untracked,
) -> Any:
    """The express path (`EdgePolicy.express`): what `serve` does for a call with no
    metadata to decide about at an uncontended bulkhead, inline."""
    scope = ExpressScope(policy, express, _Flight(started, context), cls, seconds, loop, "protocol")
    flight = scope.flight
    try:
        try:
            result = await call()
        finally:
            scope.close()
    except grpc.aio.AbortError:
        # ``context.abort``: the handler's way to answer, settled by its status.
        flight.status = _status_of(context)
        scope.settle(permit)
        if flight.answered:
            await _ended(flight)
        raise
    except (asyncio.CancelledError, Exception) as e:
        # Settled, and answered as `serve` would; re-raised when there is no answer (a
        # client's cancellation: the bulkhead counts it as abandoned).
        outcome = policy.express_raised(e, permit, flight, scope.task, scope.cancelling)
        if isinstance(outcome, Answered):
            await _ended(flight)
        await _end(outcome, context)
    flight.status = _status_of(context)
    flight.abandoned = _swallowed(scope.task, scope.cancelling, flight)
    scope.settle(permit)
    if flight.answered:
        await _ended(flight)
    if flight.abandoned:
        raise asyncio.CancelledError  # nobody is listening (`serve`'s ABANDONED)
    modes = express.degraded
    _announce_degraded(() if modes is None else announced_modes(modes, scope.marks), context)
    return result


def _swallowed(task: asyncio.Task[Any], cancelling: int, flight: Flight) -> bool:
    """True when the handler swallowed its call's cancellation (the client's: grpc.aio cancels
    the task without marking the context) and answered anyway: nobody hears the answer, so it
    is abandoned (O1), not a success. ``cancelling``: the task's count before the call."""
    return task.cancelling() > cancelling and not flight.expired


async def _end(
    outcome: Refusal | Abandoned, context: grpc.aio.ServicerContext[Any, Any]
) -> NoReturn:
    """End the call with what the edge answered instead of the handler (always raises)."""
    if isinstance(outcome, Refusal):
        await context.abort(
            grpc.StatusCode[outcome.grpc_code], outcome.grpc_details(), refusal_trailers(outcome)
        )
    raise asyncio.CancelledError  # ABANDONED: nobody is listening


def _announce_degraded(
    degraded: tuple[str, ...], context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    if degraded:
        context.set_trailing_metadata(((DEGRADED_HEADER, ", ".join(degraded)),))
