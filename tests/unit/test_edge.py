"""Unit tests of the framework-free edge (`brownout._edge`), on virtual time.

Requirements: D2/D3 (budget resolution and route clamp), D5 (cancel at expiry), S2 (problem
bodies, 429 vs 503, jittered Retry-After only when known), S4 (priority claims only from
trusted sources), S5 (over-quota demotion to idle capacity), S6 (slowed rejections),
O1/O3 (accounting: no double counting with a bulkhead; late work not useful), G2 (degraded
modes announced).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
from tests.limits import SpyLimit

import brownout
import brownout.testing
from brownout import (
    Bulkhead,
    Classification,
    EdgePolicy,
    InboundDeadlinePolicy,
    Priority,
    Reason,
    Rejected,
    Route,
    Stats,
    Trust,
)
from brownout._edge import (
    ABANDONED,
    Flight,
    Refusal,
    SlowedRejections,
    compile_template,
    header_getter,
    problem_body,
)
from brownout.events import DeadlineHeaderIgnored, Event, EventHub
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


def observed() -> tuple[EventHub, Stats, Recorder]:
    hub = EventHub()
    stats = Stats()
    rec = Recorder()
    hub.subscribe(stats)
    hub.subscribe(rec)
    return hub, stats, rec


def headers(**values: str) -> Any:
    return header_getter([(k.replace("_", "-").encode(), v.encode()) for k, v in values.items()])


async def run(
    policy: EdgePolicy,
    handler: Any,
    *,
    template: str | None = "/x",
    get: Any = None,
    request: Any = None,
    budget: float | None = None,
) -> tuple[Any, Flight]:
    flight = Flight(asyncio.get_running_loop().time())
    out = await policy.serve(
        request if request is not None else {},
        handler,
        flight,
        route=policy.route(template),
        get=get if get is not None else headers(),
        budget=budget,
    )
    return out, flight


# -- pure parts ---------------------------------------------------------------------------------


def test_problem_body_is_rfc9457_and_names_the_reason() -> None:
    doc = json.loads(problem_body(Reason.QUEUE_FULL, 503, degraded=("search",)))
    assert doc["type"] == "urn:brownout:reason:queue_full"
    assert doc["title"] == "Service Unavailable"
    assert doc["status"] == 503
    assert doc["reason"] == "queue_full"
    assert doc["detail"]
    assert doc["degraded"] == ["search"]
    assert "retry" not in doc


def test_status_mapping_defaults_and_overrides() -> None:
    policy = EdgePolicy()
    assert policy.status_for(Reason.QUOTA) == 429
    assert policy.status_for(Reason.DEADLINE_EXPIRED) == 504
    for reason in Reason:
        if reason not in (Reason.QUOTA, Reason.DEADLINE_EXPIRED, Reason.OUTCOME_UNKNOWN):
            assert policy.status_for(reason) == 503
    custom = EdgePolicy(expired_status=503, statuses={Reason.FAIR_SHARE: 429})
    assert custom.status_for(Reason.DEADLINE_EXPIRED) == 503
    assert custom.status_for(Reason.FAIR_SHARE) == 429


def test_refusal_bodies_are_precomputed_and_retry_after_only_when_known() -> None:
    policy = EdgePolicy()
    a = policy.refusal(Reason.QUEUE_FULL)
    assert a is policy.refusal(Reason.QUEUE_FULL)  # no work per refusal without an estimate
    assert a.retry_after is None and a.retry_after_header() is None
    assert a.status == 503 and json.loads(a.body)["reason"] == "queue_full"


def test_retry_after_is_jittered_upwards_never_earlier() -> None:
    policy = EdgePolicy(retry_after_jitter=0.5)
    values = [policy.refusal(Reason.QUEUE_FULL, 2.0).retry_after for _ in range(200)]
    assert all(v is not None and 2.0 <= v <= 3.0 for v in values)
    assert len({round(v or 0, 3) for v in values}) > 50  # not one value for everyone (S2)
    headers_seen = {policy.refusal(Reason.QUEUE_FULL, 2.0).retry_after_header() for _ in range(200)}
    # Whole seconds over [ceil(estimate), ceil(estimate * 1.5) + 1] (issue 24).
    assert headers_seen == {"2", "3", "4"}
    assert Refusal(503, Reason.QUEUE_FULL, b"", 0.2, False, ()).retry_after_header() == "1"
    odd = {EdgePolicy().refusal(Reason.QUEUE_FULL, 2.3).retry_after_header() for _ in range(200)}
    assert odd == {"3", "4", "5"}  # never earlier than the estimate


def test_do_not_retry_only_for_reasons_that_went_through_a_retry_layer() -> None:
    policy = EdgePolicy()
    assert policy.refusal(Reason.BUDGET_EXHAUSTED, 1.0).do_not_retry
    assert policy.refusal(Reason.BUDGET_EXHAUSTED, 1.0).retry_after is None
    assert policy.refusal(Reason.DO_NOT_RETRY).do_not_retry
    assert json.loads(policy.refusal(Reason.DO_NOT_RETRY).body)["retry"] == "never"
    assert not policy.refusal(Reason.QUEUE_FULL).do_not_retry
    strict = EdgePolicy(do_not_retry={Reason.BREAKER_OPEN})
    assert strict.refusal(Reason.BREAKER_OPEN).do_not_retry
    assert not strict.refusal(Reason.BUDGET_EXHAUSTED).do_not_retry


def test_degraded_modes_are_named_on_refusals() -> None:
    class Modes:
        names: tuple[str, ...] = ()

        def active_names(self) -> tuple[str, ...]:
            return self.names

    modes = Modes()
    policy = EdgePolicy(degraded=modes)
    assert policy.refusal(Reason.OVERLOADED).degraded == ()
    modes.names = ("stale-prices", "no-recommendations")
    r = policy.refusal(Reason.OVERLOADED)
    assert r.degraded == ("stale-prices", "no-recommendations")
    assert json.loads(r.body)["degraded"] == ["stale-prices", "no-recommendations"]


def test_templates_match_paths_and_routes_resolve_their_limits() -> None:
    assert compile_template("/reports/{id}").fullmatch("/reports/42")
    assert not compile_template("/reports/{id}").fullmatch("/reports/42/x")
    assert compile_template("/files/{rest:path}").fullmatch("/files/a/b/c")
    policy = EdgePolicy(
        deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),
        routes={"/reports/{id}": Route(priority=Priority.SHEDDABLE, maximum=10.0)},
    )
    assert policy.match("/reports/7") == "/reports/{id}"
    assert policy.match("/other") is None
    r = policy.route("/reports/{id}")
    assert r.priority is Priority.SHEDDABLE
    assert (r.deadline.default, r.deadline.maximum) == (2.0, 10.0)
    assert policy.route(None).template == "unmatched"
    assert policy.route("/x").deadline is policy.deadline


def test_route_label_set_is_bounded() -> None:
    policy = EdgePolicy()
    for i in range(2000):
        policy.route(f"/t{i}")
    assert policy.route("/t1999").template == "unmatched"


def test_metrics_paths_are_exempt_like_health_paths() -> None:
    """A scrape must be answered while the service sheds: the metrics path is exempt."""
    policy = EdgePolicy()
    assert policy.is_exempt("/metrics") and policy.is_exempt("/healthz")
    assert not policy.is_health("/metrics") and not policy.is_exempt("/work")
    custom = EdgePolicy(health_paths=["/up"], metrics_paths=["/prom"])
    assert custom.exempt_paths == {"/up", "/prom"}
    assert not custom.is_exempt("/metrics")
    assert not EdgePolicy(metrics_paths=()).is_exempt("/metrics")


def test_priority_claims_are_honoured_only_from_trusted_sources() -> None:
    hub, _, rec = observed()
    policy = EdgePolicy(events=hub, max_claimed_priority=Priority.CRITICAL)
    route = policy.route("/x")
    claim = headers(brownout_priority="sheddable")
    assert policy.classify({}, route, "/x", Trust.UNTRUSTED, claim).priority is Priority.CRITICAL
    assert policy.classify({}, route, "/x", Trust.SIGNED, claim).priority is Priority.CRITICAL
    assert policy.classify({}, route, "/x", Trust.TRUSTED, claim).priority is Priority.SHEDDABLE
    up = headers(brownout_priority="critical-plus")
    assert policy.classify({}, route, "/x", Trust.TRUSTED, up).priority is Priority.CRITICAL
    ignored = [e for e in rec.events if isinstance(e, DeadlineHeaderIgnored)]
    assert [e.problem for e in ignored] == ["untrusted source", "untrusted source"]


def test_classifier_has_the_last_word() -> None:
    def classify(request: Any, default: Classification) -> Classification:
        return default._replace(caller=request["user"], priority=Priority.SHEDDABLE_PLUS)

    policy = EdgePolicy(classifier=classify)
    c = policy.classify({"user": "ann"}, policy.route("/x"), "/x", Trust.UNTRUSTED, headers())
    assert c == Classification(Priority.SHEDDABLE_PLUS, "ann", "/x")


# -- the flow, on virtual time ------------------------------------------------------------------


@pytest.mark.looptime
async def test_handler_runs_inside_the_request_context() -> None:
    policy = EdgePolicy(
        deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),
        routes={"/r": Route(priority=Priority.SHEDDABLE, maximum=3.0)},
        trust=Trust.TRUSTED,
    )

    async def handler() -> brownout.RequestContext:
        return brownout.current()

    ctx, flight = await run(policy, handler, template="/r", get=headers(brownout_budget_ms="60000"))
    assert isinstance(ctx, brownout.RequestContext)
    assert ctx.remaining() == pytest.approx(3.0)  # clamped to the route maximum
    assert ctx.priority is Priority.SHEDDABLE
    assert ctx.operation == "/r"
    assert ctx.started_at == flight.started
    grpc_ctx, _ = await run(policy, handler, template="/r", budget=1.25)
    assert grpc_ctx.remaining() == pytest.approx(1.25)
    clamped, _ = await run(policy, handler, template="/r", budget=60.0)
    assert clamped.remaining() == pytest.approx(3.0)


@pytest.mark.looptime
async def test_expiry_cancels_the_handler_and_refuses_with_504() -> None:
    hub, stats, _ = observed()
    policy = EdgePolicy(deadline=InboundDeadlinePolicy(default=1.0, maximum=1.0), events=hub)
    cancelled = []

    async def handler() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "late"

    t0 = asyncio.get_running_loop().time()
    out, _ = await run(policy, handler)
    assert asyncio.get_running_loop().time() - t0 == pytest.approx(1.0)
    assert isinstance(out, Refusal) and out.status == 504
    assert out.reason is Reason.DEADLINE_EXPIRED
    assert cancelled == [True]
    assert stats.count("expired", reason="running") == 1
    assert stats.count("completed") == 0


@pytest.mark.looptime
async def test_expiry_after_the_response_started_propagates() -> None:
    policy = EdgePolicy(deadline=InboundDeadlinePolicy(default=1.0, maximum=1.0))
    flight = Flight(asyncio.get_running_loop().time())

    async def handler() -> None:
        flight.response_started = True
        await asyncio.sleep(10)

    with pytest.raises(brownout.DeadlineExceeded):
        await policy.serve({}, handler, flight, route=policy.route("/x"))


@pytest.mark.looptime
async def test_without_a_bulkhead_the_edge_reports_the_lifecycle() -> None:
    hub, stats, rec = observed()
    policy = EdgePolicy(events=hub)

    async def ok() -> str:
        await asyncio.sleep(0.25)
        return "ok"

    async def boom() -> None:
        raise RuntimeError("boom")

    assert (await run(policy, ok))[0] == "ok"
    with pytest.raises(RuntimeError):
        await run(policy, boom)
    assert rec.kinds() == [
        "RequestOffered",
        "RequestAdmitted",
        "RequestCompleted",
        "RequestOffered",
        "RequestAdmitted",
        "RequestFailed",
    ]
    assert stats.latency().count == 1
    assert stats.latency().max == pytest.approx(0.25)  # measured from the edge's stopwatch
    assert stats.count("failed", reason="RuntimeError") == 1


@pytest.mark.looptime
async def test_with_a_bulkhead_nothing_is_counted_twice() -> None:
    hub, stats, rec = observed()
    bulkhead = Bulkhead("api", FixedLimit(1), FifoQueue(max_size=1, max_wait=0.5), events=hub)
    policy = EdgePolicy(bulkhead=bulkhead, events=hub)

    async def ok() -> str:
        await asyncio.sleep(1.0)
        return "ok"

    results = await asyncio.gather(*(run(policy, ok) for _ in range(3)))
    outs = [r[0] for r in results]
    assert outs.count("ok") == 1
    refusals = [o for o in outs if isinstance(o, Refusal)]
    assert sorted(r.reason.value for r in refusals) == ["queue_full", "queue_timeout"] or sorted(
        r.reason.value for r in refusals
    ) == ["queue_timeout", "queue_timeout"]
    assert stats.count("offered") == 3
    assert stats.count("completed") == 1
    assert stats.count("shed") == 2
    assert rec.kinds().count("RequestCompleted") == 1


@pytest.mark.looptime
async def test_5xx_responses_are_failures_not_goodput() -> None:
    hub, stats, _ = observed()
    policy = EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(2), events=hub), events=hub)
    flight = Flight(asyncio.get_running_loop().time())

    async def handler() -> None:
        flight.status = 502

    await policy.serve({}, handler, flight, route=policy.route("/x"))
    assert stats.count("completed") == 0
    assert stats.count("failed", reason="status_502") == 1


@pytest.mark.looptime
async def test_a_refusal_from_inside_the_handler_becomes_a_refusal() -> None:
    policy = EdgePolicy()

    async def handler() -> None:
        raise Rejected(Reason.BUDGET_EXHAUSTED, "retries spent", retry_after=3.0)

    out, _ = await run(policy, handler)
    assert isinstance(out, Refusal)
    assert out.reason is Reason.BUDGET_EXHAUSTED
    assert out.do_not_retry  # it already went through a retry layer (R1)
    assert out.retry_after is None


@pytest.mark.looptime
async def test_abandonment_is_counted_and_swallowed() -> None:
    hub, stats, _ = observed()
    policy = EdgePolicy(events=hub)
    flight = Flight(asyncio.get_running_loop().time())
    task = asyncio.current_task()
    assert task is not None

    async def handler() -> None:
        loop = asyncio.get_running_loop()

        def client_went_away() -> None:
            flight.abandoned = True
            task.cancel()

        loop.call_later(0.5, client_went_away)
        await asyncio.sleep(10)

    out = await policy.serve({}, handler, flight, route=policy.route("/x"))
    assert out is ABANDONED
    assert task.cancelling() == 0  # our own cancellation was consumed
    assert stats.count("abandoned") == 1
    assert stats.count("completed") == 0


@dataclass
class Decision:
    allowed: bool
    retry_after: float | None = 1.0
    limit: int | None = 100
    remaining: int | None = 0
    reset: float | None = 1.0


@pytest.mark.looptime
async def test_quota_refusal_is_429_and_counted_by_the_edge() -> None:
    hub, stats, _ = observed()

    async def quota(c: Classification) -> Decision:
        return Decision(allowed=c.caller == "paid")

    def classify(request: Any, default: Classification) -> Classification:
        return default._replace(caller=request["caller"])

    policy = EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(2), events=hub),
        classifier=classify,
        quota=quota,
        events=hub,
    )

    async def ok() -> str:
        return "ok"

    refused, _ = await run(policy, ok, request={"caller": "free"})
    served, _ = await run(policy, ok, request={"caller": "paid"})
    assert isinstance(refused, Refusal) and refused.status == 429
    assert refused.quota is not None and refused.quota.limit == 100
    assert served == "ok"
    assert stats.count("offered") == 2
    assert stats.count("shed", reason="quota", caller="free") == 1


@pytest.mark.looptime
async def test_over_quota_callers_use_idle_capacity_at_lowest_priority() -> None:
    hub, stats, _ = observed()

    async def quota(c: Classification) -> Decision:
        return Decision(allowed=False)

    bulkhead = Bulkhead("api", FixedLimit(1), FifoQueue(max_size=4, max_wait=1.0), events=hub)
    policy = EdgePolicy(bulkhead=bulkhead, quota=quota, on_quota_exceeded="demote", events=hub)
    seen: list[Priority] = []

    async def handler() -> str:
        seen.append(brownout.current().priority)
        await asyncio.sleep(1.0)
        return "ok"

    first, second = await asyncio.gather(run(policy, handler), run(policy, handler))
    assert first[0] == "ok"  # idle capacity: served, demoted (S5)
    assert seen == [Priority.SHEDDABLE]
    assert isinstance(second[0], Refusal) and second[0].status == 429  # no idle capacity
    assert bulkhead.in_flight == 0  # the try_admit permit was settled
    assert stats.count("completed") == 1
    assert stats.count("offered") == 2


@pytest.mark.looptime
async def test_slowed_rejections_are_held_until_the_median_success_latency() -> None:
    slowed = SlowedRejections(max_held=2, ceiling=5.0)
    bulkhead = Bulkhead("api", FixedLimit(1), FifoQueue(max_size=1, max_wait=10.0))
    policy = EdgePolicy(bulkhead=bulkhead, slowed=slowed)
    loop = asyncio.get_running_loop()

    async def work() -> str:
        await asyncio.sleep(0.4)
        return "ok"

    for _ in range(3):
        assert (await run(policy, work))[0] == "ok"
    assert slowed.median == pytest.approx(0.4)
    holders = [asyncio.create_task(run(policy, work)) for _ in range(2)]  # one runs, one waits
    await asyncio.sleep(0)
    t0 = loop.time()
    finished: list[float] = []

    async def refused() -> None:
        out, _ = await run(policy, work)
        assert isinstance(out, Refusal)
        finished.append(loop.time() - t0)

    await asyncio.gather(*(refused() for _ in range(4)))
    await asyncio.gather(*holders)
    # Two held for ~the median success latency, the rest answered at once (bounded).
    assert sorted(round(f, 2) for f in finished) == [0.0, 0.0, 0.4, 0.4]
    assert slowed.held == 0


@pytest.mark.looptime
async def test_slowed_rejections_share_one_timer() -> None:
    slowed = SlowedRejections(max_held=100, floor=0.2)
    futures = [slowed.hold() for _ in range(50)]
    assert all(f is not None for f in futures)
    assert slowed.held == 50
    await asyncio.sleep(0.25)
    assert all(f is not None and f.done() for f in futures)
    assert slowed.held == 0


def test_slowed_rejections_hold_nothing_before_any_success() -> None:
    slowed = SlowedRejections()
    assert slowed.hold_time() == 0.0
    assert slowed.hold() is None
    with pytest.raises(ValueError, match="max_held"):
        SlowedRejections(floor=2.0, ceiling=1.0)


@pytest.mark.looptime
async def test_short_and_long_deadlines_are_enforced_exactly() -> None:
    """Deadlines shorter than the sweep period get their timer at once; longer ones from the
    sweep; either way the handler stops at the deadline, not at a sweep tick."""
    loop = asyncio.get_running_loop()
    for budget in (0.03, 0.07, 1.234):
        policy = EdgePolicy(
            deadline=InboundDeadlinePolicy(default=budget, maximum=budget), sweep_period=0.05
        )

        async def forever() -> None:
            await asyncio.sleep(100)

        t0 = loop.time()
        out, _ = await run(policy, forever)
        assert isinstance(out, Refusal) and out.reason is Reason.DEADLINE_EXPIRED
        assert loop.time() - t0 == pytest.approx(budget)
        assert not policy._sweeper.pending  # nothing left behind


async def test_ratelimit_headers_come_from_the_quota_decision() -> None:
    """S2: a real Quota's refusal carries the IETF RateLimit / RateLimit-Policy headers; the
    edge leaves Retry-After to its own jittered value."""
    from brownout import InMemoryQuotaStore, Quota
    from brownout._edge import ratelimit_headers

    quota = Quota(rate=1.0, burst=1, store=InMemoryQuotaStore(clock=brownout.testing.ManualClock()))
    assert (await quota.check("alice")).allowed
    refused = await quota.check("alice")
    assert not refused.allowed
    headers = ratelimit_headers(refused)
    assert set(headers) == {"RateLimit-Policy", "RateLimit"}
    assert ";r=0;" in headers["RateLimit"]


@pytest.mark.looptime
async def test_unknown_outcome_from_a_handler_is_a_504_that_says_do_not_retry() -> None:
    """D6 + R1: the retry layer below gave up on a mutation; callers reconcile, never resend."""
    from brownout import UnknownOutcome

    hub, stats, _ = observed()
    policy = EdgePolicy(events=hub)

    async def handler() -> str:
        raise UnknownOutcome("charge-42")

    out, _ = await run(policy, handler)
    assert isinstance(out, Refusal)
    assert out.status == 504
    assert out.do_not_retry
    assert json.loads(out.body)["reason"] == "outcome_unknown"
    assert stats.count("failed", reason="UnknownOutcome") == 1


@pytest.mark.looptime
async def test_fallback_answers_count_as_goodput_but_never_teach_the_limit() -> None:
    """G1 + A5: a degraded-mode fallback answers fast; fed to an adaptive limit it would drag
    the no-load baseline down and collapse the limit when the mode ends (seen in the lab)."""
    from brownout import Bulkhead, DegradedMode, DegradedModes
    from brownout.queues import FifoQueue

    hub, stats, _ = observed()
    spy = SpyLimit()
    modes = DegradedModes([DegradedMode("recs", "serve recommendations from a default")])
    policy = EdgePolicy(
        bulkhead=Bulkhead("api", limit=spy, queue=FifoQueue(8), events=hub),  # type: ignore[arg-type]
        degraded=modes,
        events=hub,
    )

    @modes.fallback("recs", lambda: "default")
    async def recommendations() -> str:
        await asyncio.sleep(0.02)
        return "personal"

    out, _ = await run(policy, recommendations)
    assert out == "personal"
    assert len(spy.samples) == 1  # a real answer is a sample
    modes.force("recs", on=True)
    out, _ = await run(policy, recommendations)
    assert out == "default"
    assert len(spy.samples) == 1  # the fallback's answer is not
    assert stats.count("completed") == 2  # both are goodput


def test_express_budget_takes_only_what_resolve_would_simply_honour() -> None:
    """D3 on the express path: one unsigned budget header is honoured and clamped exactly as
    `InboundDeadlinePolicy.resolve` does; everything resolve would reject, verify or report
    is left to `serve` (0.0)."""
    deadline = InboundDeadlinePolicy(default=2.0, maximum=5.0)
    policy = EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(4)), deadline=deadline)

    def budget(*headers: tuple[bytes, bytes], p: EdgePolicy = policy) -> float:
        return p.express_budget(p.route("/x"), {}, [(b"host", b"h"), *headers])

    assert budget() == 2.0
    assert budget((b"brownout-budget-ms", b"1500")) == 1.5
    assert budget((b"brownout-budget-ms", b"60000")) == 5.0  # clamped to the maximum
    for needs_serve in (
        [(b"brownout-budget-ms", b"soon")],  # malformed: serve reports it
        [(b"brownout-budget-ms", b"0")],  # spent: serve answers 504
        [(b"brownout-budget-ms", b"100"), (b"brownout-budget-ms", b"200")],
        [(b"brownout-priority", b"sheddable")],
        [(b"brownout-signed-budget", b"x")],
        [(b"brownout-budget-ms", b"100"), (b"brownout-priority", b"critical")],
    ):
        assert budget(*needs_serve) == 0.0, needs_serve
    silent = EdgePolicy(deadline=InboundDeadlinePolicy(default=2.0, honour_untrusted=False))
    assert budget((b"brownout-budget-ms", b"100"), p=silent) == 2.0  # ignored, as resolve does
    trusting = EdgePolicy(deadline=deadline, trust=lambda request: Trust.TRUSTED)
    assert budget((b"brownout-budget-ms", b"100"), p=trusting) == 0.1
    signed = EdgePolicy(deadline=deadline, trust=Trust.SIGNED)
    assert budget((b"brownout-budget-ms", b"100"), p=signed) == 0.0
    envoy = EdgePolicy(deadline=InboundDeadlinePolicy(read_envoy=True))
    assert budget((b"brownout-budget-ms", b"100"), p=envoy) == 0.0


def test_grpc_status_is_read_as_its_http_equivalent_whatever_its_type() -> None:
    """O1: a handler's own gRPC status counts as an answer or a failure by google.rpc.Code's
    HTTP mapping; some grpcio releases return the code as a plain integer (grpc/grpc#35450)."""
    grpc = pytest.importorskip("grpc")
    from brownout.integrations.grpc_server import _status_of

    class Context:
        def __init__(self, code: object) -> None:
            self._code = code

        def code(self) -> object:
            return self._code

    assert _status_of(Context(None)) == 200  # type: ignore[arg-type]
    assert _status_of(Context(grpc.StatusCode.NOT_FOUND)) == 404  # type: ignore[arg-type]
    assert _status_of(Context(grpc.StatusCode.INTERNAL)) == 500  # type: ignore[arg-type]
    assert _status_of(Context(5)) == 404  # type: ignore[arg-type]
    assert _status_of(Context(14)) == 503  # type: ignore[arg-type]
    assert _status_of(Context(99)) == 500  # type: ignore[arg-type]
    assert _status_of(Context("odd")) == 200  # type: ignore[arg-type]


@pytest.mark.looptime
@pytest.mark.parametrize(
    "outcome", ["raises", "status_500", "rejected", "expires", "abandoned", "answers"]
)
async def test_a_demoted_request_is_settled_by_its_outcome(outcome: str) -> None:
    """S5 with ``on_quota_exceeded="demote"``: the over-quota request runs on a permit taken
    with ``try_admit``; whatever its handler does, the permit is settled once and counted
    exactly as the general path counts it (O1): a refusal from inside the handler and a
    client that went away used to leave no outcome, or the wrong one, on this path."""
    hub, stats, _ = observed()

    async def quota(c: Classification) -> Decision:
        return Decision(allowed=False)

    bulkhead = Bulkhead("api", FixedLimit(1), events=hub)
    policy = EdgePolicy(bulkhead=bulkhead, quota=quota, on_quota_exceeded="demote", events=hub)
    flight = Flight(asyncio.get_running_loop().time())

    async def handler() -> str:
        assert brownout.current().priority is Priority.SHEDDABLE
        if outcome == "raises":
            raise RuntimeError("boom")
        if outcome == "status_500":
            flight.status = 500
        if outcome == "rejected":
            raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")
        if outcome in ("expires", "abandoned"):
            await asyncio.sleep(10)
        return "answered"

    call = policy.serve({}, handler, flight, route=policy.route("/x"), get=headers(), budget=1.0)
    if outcome == "raises":
        with pytest.raises(RuntimeError):
            await call
    elif outcome == "abandoned":  # the client went away: the adapter cancels the handler
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0.1)
        flight.abandoned = True
        task.cancel()
        assert await task is ABANDONED
    else:
        answer = await call
        if outcome in ("status_500", "answers"):
            assert answer == "answered"
        else:
            assert isinstance(answer, Refusal)
            assert answer.status == (503 if outcome == "rejected" else 504)
    await asyncio.sleep(0)
    assert bulkhead.in_flight == 0
    assert stats.count("offered") == 1
    settled = {
        "raises": "failed",
        "status_500": "failed",
        "rejected": "failed",
        "expires": "expired",
        "abandoned": "abandoned",
        "answers": "completed",
    }[outcome]
    outcomes = ("completed", "failed", "expired", "abandoned")
    assert {kind: stats.count(kind) for kind in outcomes} == {
        kind: int(kind == settled) for kind in outcomes
    }


@pytest.mark.parametrize("with_bulkhead", [True, False])
async def test_a_refusal_from_inside_the_handler_is_counted_alike_with_or_without_bulkhead(
    with_bulkhead: bool,
) -> None:
    """O1: the same failure reason whichever of the edge and the bulkhead reports it, so a
    dashboard does not change when a route gets a bulkhead."""
    hub, stats, _ = observed()
    bulkhead = Bulkhead("api", FixedLimit(4), events=hub) if with_bulkhead else None
    policy = EdgePolicy(bulkhead=bulkhead, events=hub)

    async def handler() -> None:
        raise Rejected(Reason.BREAKER_OPEN, "the inventory breaker is open")

    out, _ = await run(policy, handler)
    assert isinstance(out, Refusal) and out.reason is Reason.BREAKER_OPEN
    assert stats.count("failed", reason="Rejected") == 1
    assert stats.count("completed") == 0


@pytest.mark.looptime
async def test_bounded_slowed_rejections_under_a_100k_refusal_flood() -> None:
    """A flood of refusals whose clients hang up while held: at most ``max_held`` futures
    are held (the rest answered at once), cancelled ones leave with the timer, and the
    latency ring keeps ``window`` samples."""
    slowed = SlowedRejections(max_held=1000, floor=0.5, window=64)
    for i in range(100_000):
        slowed.observe(0.001 * (i % 100))
        fut = slowed.hold()
        assert slowed.held <= 1000
        if fut is not None and i % 2:
            fut.cancel()  # the client went away while held
        if i % 10_000 == 0:
            await asyncio.sleep(0)
    assert len(slowed._samples) == 64
    await asyncio.sleep(1.0)
    assert slowed.held == 0


@pytest.mark.parametrize(
    ("estimate", "window"),
    [(0.3, (1, 2)), (0.9, (1, 3)), (1.0, (1, 3)), (2.0, (2, 4)), (10.0, (10, 16))],
)
def test_retry_after_headers_spread_over_a_window_of_whole_seconds(
    estimate: float, window: tuple[int, int]
) -> None:
    """Issue 24: whole seconds lost the jitter (0.3 s and 0.9 s estimates: 1,000 refusals all
    said 1). The header is uniform over [ceil(estimate), ceil(estimate * (1 + jitter)) + 1],
    drawn with the same random number as the jittered estimate (gRPC's pushback in ms)."""
    policy = EdgePolicy(retry_after_jitter=0.5, rng=random.Random(24))
    lo, hi = window
    seconds = []
    for _ in range(1000):
        refusal = policy.refusal(Reason.QUEUE_FULL, estimate)
        s = refusal.retry_after_seconds()
        assert s is not None and refusal.retry_after_header() == str(s)
        assert refusal.retry_after is not None
        assert lo <= s <= hi and s >= math.ceil(estimate)  # never earlier than the estimate
        assert s >= math.floor(refusal.retry_after)  # one draw: ordered with the ms value
        seconds.append(s)
    assert set(seconds) == set(range(lo, hi + 1))  # every value of the window is used
    mean = sum(seconds) / len(seconds)
    assert abs(mean - (lo + hi) / 2) < 0.15 * (hi - lo + 1)  # uniform: a bounded mean
