"""gRPC accounting under concurrency: the conservation laws of ``test_edge_accounting`` (server
side) and ``test_outbound_accounting`` (client side) over grpc.aio (O1, D5, D6, R1-R5).

Server side: a real grpc.aio server with `BrownoutServerInterceptor` in front of the same small
bulkhead (4 running, 4 waiting for at most 0.25 s, ``test_edge_accounting.service``), unary
and streaming methods, and many concurrent real grpc.aio clients sending a seeded mix: fast
answers, handlers slower than the call's timeout (unary, and streams cut mid-way), handlers
that raise, abort with INTERNAL or NOT_FOUND, clients that cancel mid-call, short timeouts,
trusted priority claims and health checks. Each call's status is read as the edge reads it
(docs/grpc.md): OK and NOT_FOUND are answers (200: completed + late), INTERNAL and UNKNOWN
failures (500), UNAVAILABLE a refusal by its ``brownout-reason`` (503), DEADLINE_EXCEEDED
expiry (504), a cancelled call abandoned; then ``test_edge_accounting.check_laws`` holds it to
the same laws (conservation per operation and priority and per request, what the clients saw,
the bulkhead and its ledger empty again, Prometheus == Stats).

Client side: see ``test_concurrent_grpc_calls_through_a_dependency_are_accounted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.integration.servers import serve_grpc
from tests.integration.test_edge_accounting import (
    DEADLINE,
    PRIORITIES,
    SLOW,
    Ask,
    Service,
    check_laws,
    service,
    settle,
)
from tests.integration.test_outbound_accounting import (
    CALL,
    ending,
    instrumented_dependency,
    prom_total,
)

import brownout
from brownout import Classification, EdgePolicy, InboundDeadlinePolicy, RetryBudget
from brownout.events import AttemptRetried, OutcomeUnknown
from brownout.integrations.grpc_client import brownout_interceptors
from brownout.integrations.grpc_server import BrownoutServerInterceptor, GrpcCall
from brownout.wire import REFUSAL_REASON_KEY

pytestmark = pytest.mark.integration

SVC = "acct.Svc"
HEALTH = "/grpc.health.v1.Health/Check"


def _ident(b: bytes) -> bytes:
    return b


# -- the server ----------------------------------------------------------------------------------


class Delivered(grpc.aio.ServerInterceptor):
    """Outside brownout's: notes the id of every call grpc hands to a handler. grpc core
    itself ends a call whose deadline passes (or whose client cancels) before the server's
    loop gets to it, and no interceptor ever sees that call: it was sent, never offered."""

    def __init__(self) -> None:
        self.calls: set[str] = set()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        kind = ("stream" if handler.request_streaming else "unary") + (
            "_stream" if handler.response_streaming else "_unary"
        )
        inner = getattr(handler, kind)

        async def noted(request: Any, context: Any) -> Any:  # brownout's are all async
            for key, value in context.invocation_metadata() or ():
                if key == "x-call":
                    self.calls.add(str(value))
            return await inner(request, context)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(noted, handler.request_deserializer, handler.response_serializer)


@contextlib.asynccontextmanager
async def grpc_server(svc: Service, delivered: Delivered) -> AsyncIterator[str]:
    async def fast(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(float(request or b"0"))
        return b"ok"

    async def slow(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(SLOW)
        return b"too late"

    async def raises(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.005)
        raise RuntimeError("boom")

    async def internal(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.005)
        await context.abort(grpc.StatusCode.INTERNAL, "broken")
        raise AssertionError("abort raises")

    async def not_found(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.005)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        raise AssertionError("abort raises")

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        pause = float(request or b"0")
        for i in range(4):
            yield str(i).encode()
            await asyncio.sleep(pause)

    async def writer(request: bytes, context: Any) -> None:
        pause = float(request or b"0")
        for i in range(3):
            await context.write(str(i).encode())
            await asyncio.sleep(pause)

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        async for r in requests:
            n += len(r)
        return str(n).encode()

    async def doubled(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            await asyncio.sleep(float(r or b"0"))
            yield r + r

    async def health(request: bytes, context: Any) -> bytes:
        svc.handled["/health"] += 1
        return b"SERVING"

    def classify(call: GrpcCall, default: Classification) -> Classification:
        for key, value in call.metadata:
            if key == "x-caller":
                return default._replace(caller=str(value))
        return default

    def uu(fn: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(fn, _ident, _ident)

    svc.policy.classifier = classify
    server = grpc.aio.server(interceptors=[delivered, BrownoutServerInterceptor(svc.policy)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SVC,
                {
                    "Fast": uu(fast),
                    "Slow": uu(slow),
                    "Hang": uu(slow),
                    "Raise": uu(raises),
                    "Internal": uu(internal),
                    "NotFound": uu(not_found),
                    "Stream": grpc.unary_stream_rpc_method_handler(stream, _ident, _ident),
                    "Writer": grpc.unary_stream_rpc_method_handler(writer, _ident, _ident),
                    "Total": grpc.stream_unary_rpc_method_handler(total, _ident, _ident),
                    "Doubled": grpc.stream_stream_rpc_method_handler(doubled, _ident, _ident),
                },
            ),
            grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": uu(health)}),
        )
    )
    async with serve_grpc(server) as target:
        yield target


# -- the clients ----------------------------------------------------------------------------------


@dataclass
class Rpc(Ask):
    """One planned call (``path`` is the full method name) and what its client saw, read as
    the edge reads a status (``status``: the HTTP equivalent; ``code``: gRPC's)."""

    arg: bytes = b""
    timeout: float = 5.0
    shape: str = "uu"  # uu, us, su, ss
    code: str | None = None


def plan(seed: int, n: int, unique_callers: bool) -> list[Rpc]:
    rng = random.Random(seed)
    kinds = [
        "fast", "slow", "raise", "internal", "not_found", "hang", "short", "priority",
        "stream", "stream_slow", "writer", "total", "doubled", "cancel_stream", "health",
    ]  # fmt: skip
    weights = [30, 5, 5, 5, 5, 7, 12, 12, 5, 3, 3, 3, 3, 3, 6]
    rpcs = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        caller = f"r{i}" if unique_callers else f"c{rng.randrange(3)}"
        headers = {"x-caller": caller, "x-call": str(i)}
        arg = str(rng.choice((0, 0, 0, 0.005, 0.02, 0.05))).encode()
        path, shape, timeout, hang_up = f"/{SVC}/Fast", "uu", 5.0, 0.0
        if kind in ("slow", "raise", "internal"):
            path = f"/{SVC}/" + kind.capitalize()
        elif kind == "not_found":
            path = f"/{SVC}/NotFound"
        elif kind == "hang":
            path = f"/{SVC}/Hang"
            hang_up = rng.choice((0.08, 0.4))  # in the queue (max 0.25 s) or while running
        elif kind == "short":
            timeout = rng.choice((0.03, 0.06, 0.12))
            arg = str(rng.choice((0.0, 0.02, 0.05, 0.2))).encode()
        elif kind == "priority":
            headers["brownout-priority"] = rng.choice(PRIORITIES)
            if rng.random() < 0.2:
                path = f"/{SVC}/Slow"
        elif kind in ("stream", "stream_slow", "cancel_stream"):
            path, shape = f"/{SVC}/Stream", "us"
            if kind == "stream_slow":
                arg = b"0.4"  # 4 messages 0.4 s apart: cut mid-stream at 0.8 s
            elif kind == "cancel_stream":
                arg, hang_up = b"0.2", rng.choice((0.1, 0.3))
        elif kind == "writer":
            path, shape = f"/{SVC}/Writer", "us"
        elif kind == "total":
            path, shape = f"/{SVC}/Total", "su"
        elif kind == "doubled":
            path, shape = f"/{SVC}/Doubled", "ss"
        elif kind == "health":
            path = HEALTH
        if rng.random() < 0.1 and kind not in ("health", "priority"):
            headers["brownout-priority"] = rng.choice(PRIORITIES)  # the general path too
        rpcs.append(
            Rpc(caller, kind, path, headers, hang_up, arg=arg, timeout=timeout, shape=shape)
        )
    return rpcs


HTTP_EQUIVALENT = {
    # as the edge reads a status (docs/grpc.md): NOT_FOUND is an answer, like OK
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.NOT_FOUND: 200,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

EXPECTED_CODE = {
    "/acct.Svc/NotFound": grpc.StatusCode.NOT_FOUND,
    "/acct.Svc/Internal": grpc.StatusCode.INTERNAL,
    "/acct.Svc/Raise": grpc.StatusCode.UNKNOWN,
}


async def ask_grpc(channel: grpc.aio.Channel, r: Rpc) -> None:
    metadata = tuple(r.headers.items())
    call: Any
    if r.shape == "uu":
        call = channel.unary_unary(r.path)(r.arg, timeout=r.timeout, metadata=metadata)
    elif r.shape == "us":
        call = channel.unary_stream(r.path)(r.arg, timeout=r.timeout, metadata=metadata)
    elif r.shape == "su":
        call = channel.stream_unary(r.path)(iter([r.arg] * 3), timeout=r.timeout, metadata=metadata)
    else:
        call = channel.stream_stream(r.path)(
            iter([r.arg] * 3), timeout=r.timeout, metadata=metadata
        )

    async def consume() -> None:
        if r.shape in ("us", "ss"):
            async for _ in call:
                pass
        else:
            await call

    consuming = asyncio.ensure_future(consume())
    if r.hang_up:
        done, _ = await asyncio.wait([consuming], timeout=r.hang_up)
        if not done:
            call.cancel()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await consuming
    code = await call.code()
    r.code = code.name
    if (
        code is grpc.StatusCode.INTERNAL
        and r.shape in ("su", "ss")
        and await call.details() == "Internal error from Core"
    ):
        # grpcio's client failed to send a request message because the server had already
        # ended the call (a refusal at once): the client never read the server's answer.
        r.code = "LOST_ANSWER"
        r.status = None
        return
    if code is grpc.StatusCode.CANCELLED:
        r.status = None  # the client went away without an answer
        return
    r.status = HTTP_EQUIVALENT.get(code, 1000 + code.value[0])
    if code is grpc.StatusCode.UNAVAILABLE:
        trailers = await call.trailing_metadata()
        r.reason = dict(trailers or ()).get(REFUSAL_REASON_KEY)


async def drive(target: str, rpcs: list[Rpc], concurrency: int) -> None:
    queue = list(reversed(rpcs))
    channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
    try:

        async def worker(i: int) -> None:
            think = random.Random(i)  # a pause between calls: not every call is refused
            while queue:
                await asyncio.sleep(think.uniform(0, 0.06))
                if queue:
                    await ask_grpc(channels[i % len(channels)], queue.pop())

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(concurrency))), 40)
    finally:
        for ch in channels:
            await ch.close()


async def run(seed: int, n: int, concurrency: int, unique: bool) -> dict[str, int]:
    svc = service()
    rpcs = plan(seed, n, unique)
    delivered = Delivered()
    async with grpc_server(svc, delivered) as target:
        await drive(target, rpcs, concurrency)
        await settle(svc)
        problems = []
        for r in rpcs:
            want = EXPECTED_CODE.get(r.path)
            if want is not None and r.code not in (want.name, "UNAVAILABLE", "DEADLINE_EXCEEDED"):
                problems.append(f"{r.caller} {r.path}: {r.code}")
        # Ended by grpc core before any handler ran: only an expiry or a cancellation.
        lost = [r for r in rpcs if r.headers["x-call"] not in delivered.calls]
        problems += [
            f"{r.caller} {r.path} never delivered, yet {r.code}"
            for r in lost
            if r.code not in ("DEADLINE_EXCEEDED", "CANCELLED")
        ]
        # A call with a 30-120 ms timeout or an early hang-up may expire in grpc core on a
        # busy host; one with 5 s and no hang-up must reach the server.
        patient = [r for r in rpcs if r.timeout >= 5.0 and not r.hang_up]
        lost_patient = [r for r in lost if r.timeout >= 5.0 and not r.hang_up]
        if len(lost_patient) > len(patient) // 20:
            problems.append(f"{len(lost_patient)} of {len(patient)} 5 s calls never delivered")
        assert not problems, problems
        assert svc.stats.count("offered", operation=HEALTH) == 0
        # grpc ends a call at the client's deadline whatever the server does: an answer that
        # left the server in time can still arrive too late (seen once in a full suite run).
        delivered_rpcs = [r for r in rpcs if r.headers["x-call"] in delivered.calls]
        summary = check_laws(svc, delivered_rpcs, client_deadline=True)
        summary["never_delivered"] = len(lost)
    assert summary.get("queued", 0) > 0 and summary.get("shed", 0) > 0, summary
    return summary


@pytest.mark.parametrize(
    ("seed", "n", "concurrency", "unique"),
    [
        (3, 400, 48, False),  # three callers: the aggregate laws only
        (5, 500, 64, True),
        (8, 600, 32, True),
    ],
)
async def test_grpc_edge_counts_are_conserved_under_concurrency(
    seed: int, n: int, concurrency: int, unique: bool
) -> None:
    summary = await run(seed, n, concurrency, unique)
    print(seed, n, concurrency, summary)


# -- a call whose deadline is spent on arrival --------------------------------------------------


class _SpentContext:
    """A servicer context as grpc.aio hands over a call whose deadline passed while it waited
    for the server's loop: ``time_remaining()`` is 0."""

    def __init__(self) -> None:
        self.status: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-caller", "late"),)

    def time_remaining(self) -> float:
        return 0.0

    def code(self) -> grpc.StatusCode | None:
        return self.status

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> None:
        self.status = code
        raise grpc.aio.AbortError()


@pytest.mark.parametrize("guarded", [True, False], ids=["bulkhead", "no-bulkhead"])
async def test_a_call_arriving_with_its_deadline_spent_is_offered_and_shed(guarded: bool) -> None:
    """On a busy server a call can reach the interceptor with no time left (grpc core gives it
    to the handler late). The edge answered it DEADLINE_EXCEEDED from a check of its own ahead
    of the bulkhead, so it was counted nowhere: not offered, not shed (O1; the bulkhead counts
    an entry with a spent deadline as offered and shed ``deadline_expired``, admission.md).
    Found by `test_grpc_edge_counts_are_conserved_under_concurrency`: offered 465 of 466
    delivered calls, a 30 ms call's DEADLINE_EXCEEDED counted nowhere."""
    svc = service()
    if not guarded:  # the edge counts the lifecycle itself
        svc.policy = EdgePolicy(
            deadline=InboundDeadlinePolicy(default=DEADLINE, maximum=DEADLINE, events=svc.hub),
            events=svc.hub,
        )
    ran: list[bytes] = []

    async def handler(request: bytes, context: Any) -> bytes:
        ran.append(request)
        return b"ok"

    async def continuation(details: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(handler, _ident, _ident)

    details = SimpleNamespace(method=f"/{SVC}/Fast", invocation_metadata=())
    wrapped = await BrownoutServerInterceptor(svc.policy).intercept_service(continuation, details)
    assert wrapped is not None and wrapped.unary_unary is not None
    context = _SpentContext()
    with pytest.raises(grpc.aio.AbortError):
        await wrapped.unary_unary(b"x", context)
    assert context.status is grpc.StatusCode.DEADLINE_EXCEEDED and ran == []
    svc.stats.sync()
    counted = {k: svc.stats.count(k) for k in ("offered", "shed", "admitted")}
    assert counted == {"offered": 1, "shed": 1, "admitted": 0}
    assert svc.stats.count("shed", reason="deadline_expired") == 1


# -- the client side ------------------------------------------------------------------------------

OUT_RATIO, OUT_MIN_PER_SECOND, OUT_WINDOW = 0.05, 0.2, 30.0
OUT_TIMEOUT, OUT_RESERVE, OUT_MARGIN = 0.3, 0.05, 0.15
OUT_ACTIONS = {
    # action: weight, by phase
    "mixed": [("ok", 55), ("unavailable", 8), ("pushback", 10), ("deadline", 7), ("slow", 8),
              ("internal", 5), ("refused", 7)],
    "outage": [("unavailable", 40), ("pushback", 15), ("slow", 15), ("deadline", 10), ("ok", 20)],
}  # fmt: skip


@dataclass
class OutHit:
    call: int
    key: str | None
    attempt: int
    received: float
    remaining: float | None
    action: str


def out_pick(seed: int, phase: str, call: int, attempt: int) -> str:
    rng = random.Random(f"{seed}:{call}:{attempt}")
    actions, weights = zip(*OUT_ACTIONS[phase], strict=True)
    return rng.choices(actions, weights)[0]


@contextlib.asynccontextmanager
async def scripted_grpc(seed: int, hits: list[OutHit]) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()

    async def handle(request: bytes, context: Any) -> bytes:
        md = {k: v for k, v in context.invocation_metadata() or ()}
        call, attempt = int(md["x-call"]), int(md.get("brownout-attempt", "1"))
        action = out_pick(seed, md["x-phase"], call, attempt)
        hit = OutHit(
            call, md.get("idempotency-key"), attempt, loop.time(), context.time_remaining(), action
        )
        hits.append(hit)
        if action == "slow":
            await asyncio.sleep(2.0)
        elif action == "unavailable":  # no pushback: maybe applied (a lost stream looks so)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "unavailable")
        elif action == "pushback":
            ms = "0" if attempt % 2 else "30"
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "busy", (("grpc-retry-pushback-ms", ms),)
            )
        elif action == "refused":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "queue_full", ((REFUSAL_REASON_KEY, "queue_full"),)
            )
        elif action == "deadline":  # a server's own DEADLINE_EXCEEDED, well before ours
            await asyncio.sleep(0.01)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "downstream timed out")
        elif action == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "broken")
        return b"done"

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "acct.Out",
                {
                    "Do": grpc.unary_unary_rpc_method_handler(handle, _ident, _ident),
                    "Read": grpc.unary_unary_rpc_method_handler(handle, _ident, _ident),
                },
            ),
        )
    )
    async with serve_grpc(server) as target:
        yield target


@dataclass
class OutCall:
    id: int
    method: str
    key: str | None
    phase: str
    deadline: float
    deadline_at: float = 0.0
    ending: tuple[str, ...] = ()
    ended: float = 0.0


@pytest.mark.parametrize("seed", [13, 29])
async def test_concurrent_grpc_calls_through_a_dependency_are_accounted(seed: int) -> None:
    """300 concurrent calls (reads, keyed and unkeyed mutations) through
    `brownout_interceptors` around ONE `Dependency` (retries, `RetryBudget`, `CircuitBreaker`,
    ``max_concurrent_retries``, ledger), each in its own request deadline, against a server
    scripted to fail (UNAVAILABLE with and without pushback or a refusal's reason, its own
    DEADLINE_EXCEEDED, slow past every budget, INTERNAL). Laws: the server saw attempts
    1..n of each call, with one idempotency key on every attempt of a mutation and none on
    reads (R5); attempts seen == 1 + AttemptRetried (or one fewer when the last retry was
    refused locally) per call and in total; retries within the budget's bound (R3); no attempt
    received after its caller's deadline nor given time past it (R4, D1); unknown outcomes
    raised == OutcomeUnknown events == ledger entries, each a mutation sent and unanswered
    (D6), except a call whose request deadline fired with its attempt's on a lagging loop
    (the request's DeadlineExceeded wins; the event and ledger entry remain); Stats ==
    events == Prometheus; afterwards nothing active, no retry slot held."""
    out = instrumented_dependency(
        "out",
        seed,
        timeout=OUT_TIMEOUT,
        reserve=OUT_RESERVE,
        min_useful=0.1,
        budget=RetryBudget(OUT_RATIO, min_per_second=OUT_MIN_PER_SECOND, window=OUT_WINDOW),
        probes=2,
        max_retries=2,
    )
    stats, by_call, registry, ledger, dep = (
        out.stats,
        out.by_call,
        out.registry,
        out.ledger,
        out.dep,
    )
    rng = random.Random(seed)
    calls = []
    for i in range(300):
        method, key = rng.choice(
            [("/acct.Out/Read", None), ("/acct.Out/Do", f"k-{seed}-{i}"), ("/acct.Out/Do", None)]
        )
        calls.append(
            OutCall(i, method, key, "outage" if i % 3 == 1 else "mixed", rng.uniform(0.45, 1.4))
        )
    hits: list[OutHit] = []
    loop = asyncio.get_running_loop()

    async def run_call(call: OutCall, channel: grpc.aio.Channel, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - loop.time()))
        CALL.set(call.id)
        md = [("x-call", str(call.id)), ("x-phase", call.phase)]
        if call.key is not None:
            md.append(("idempotency-key", call.key))
        try:
            async with brownout.request(deadline=call.deadline, operation="out"):
                d = brownout.current().deadline
                assert d is not None
                call.deadline_at = d.at
                await channel.unary_unary(call.method)(b"x", metadata=tuple(md))
                call.ending = ("ok",)
        except grpc.aio.AioRpcError as e:
            call.ending = ("grpc", e.code().name)
        except Exception as e:
            call.ending = ending(e)
        call.ended = loop.time()

    async with scripted_grpc(seed, hits) as target:
        interceptors = brownout_interceptors(dep, idempotent_methods={"/acct.Out/Read"})
        async with grpc.aio.insecure_channel(target, interceptors=interceptors) as channel:
            t0 = loop.time() + 0.05
            starts = sorted(t0 + 3.0 * i / len(calls) + rng.uniform(0, 0.1) for i in range(300))
            await asyncio.wait_for(
                asyncio.gather(*(run_call(c, channel, s) for c, s in zip(calls, starts))), 30
            )
        await asyncio.sleep(0.05)

    problems: list[str] = []
    by_id: dict[int, list[OutHit]] = {}
    for h in hits:
        by_id.setdefault(h.call, []).append(h)
    retried_total = 0
    lost_keys: set[str] = set()
    raced: set[str] = set()  # lost, and the request's own DeadlineExceeded won
    for call in calls:
        seen = sorted(by_id.get(call.id, []), key=lambda h: h.attempt)
        retried = [e for e in by_call.events[call.id] if isinstance(e, AttemptRetried)]
        retried_total += len(retried)
        if [h.attempt for h in seen] != list(range(1, len(seen) + 1)):
            problems.append(f"call {call.id}: attempts {[h.attempt for h in seen]}")
        if not len(seen) <= 1 + len(retried) <= len(seen) + 1:
            problems.append(f"call {call.id}: {len(seen)} seen, {len(retried)} retries counted")
        keys = {h.key for h in seen}
        if call.method == "/acct.Out/Read":
            if keys - {None}:
                problems.append(f"call {call.id}: a read carried {keys}")
        elif seen and (len(keys) != 1 or None in keys or (call.key and keys != {call.key})):
            problems.append(f"call {call.id}: keys {keys} (caller's {call.key})")
        for h in seen:
            if h.received > call.deadline_at + OUT_MARGIN:
                problems.append(f"call {call.id}: attempt {h.attempt} received late")
            if h.remaining is None or h.received + h.remaining > call.deadline_at + 0.002:
                problems.append(
                    f"call {call.id}: attempt {h.attempt} given {h.remaining} s, "
                    f"{h.received + (h.remaining or 0) - call.deadline_at:.4f} s past the deadline"
                )
        lost = [h for h in seen if h.action in ("slow", "unavailable", "deadline")]
        if call.method == "/acct.Out/Do" and lost and seen[-1].action != "ok":
            lost_keys.add(str(seen[0].key))  # sent, never answered, not settled later (D6)
            if call.ending[:2] == ("other", "DeadlineExceeded") and (
                call.ended >= call.deadline_at
            ):
                # The request's deadline fired in the same loop iteration as the attempt's
                # (the loop lagged past the reserve): the request's DeadlineExceeded wins,
                # and the ledger and the event still have it (D6).
                raced.add(str(seen[0].key))
        if call.ending[:1] == ("unknown",) and not lost:
            problems.append(f"call {call.id}: unknown without a lost attempt: {seen}")
    if not retried_total <= OUT_RATIO * len(calls) + OUT_MIN_PER_SECOND * OUT_WINDOW + 1:
        problems.append(f"{retried_total} retries over the budget's bound")
    unknown = sorted(c.ending[1] for c in calls if c.ending[:1] == ("unknown",))
    events_unknown = sorted(str(e.idempotency_key) for e in by_call.of(OutcomeUnknown))
    ledger_keys = sorted(r.key for r in await ledger.pending())
    if not (unknown == sorted(lost_keys - raced) and events_unknown == ledger_keys):
        problems.append(f"unknown {unknown}, events {events_unknown}, ledger {ledger_keys}")
    if events_unknown != sorted(lost_keys):
        problems.append(f"events {events_unknown}, sent and unanswered {sorted(lost_keys)}")
    slots = dep.retry_slots
    if dep.active or (slots is not None and slots.in_use):
        problems.append(f"active {dep.active}, retry slots {slots and slots.in_use}")
    for kind, prom in (
        ("retried", "brownout_retries_total"),
        ("outcome_unknown", "brownout_outcome_unknown_total"),
    ):
        n = retried_total if kind == "retried" else len(events_unknown)
        if not n == stats.count(kind) == prom_total(registry, prom):
            problems.append(f"{kind}: events {n}, stats {stats.count(kind)}, prometheus")
    endings = Counter(c.ending[:2] if c.ending[0] != "unknown" else c.ending[:1] for c in calls)
    summary = (
        f"seed {seed}: {len(hits)} attempts, {retried_total} retries, {len(raced)} raced, {endings}"
    )
    print(summary)
    assert not problems, summary + "\n" + "\n".join(problems[:30])
    assert retried_total and unknown and len(endings) > 4, summary
