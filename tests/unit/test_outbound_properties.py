"""Property tests of the whole outbound path: a `Dependency` on virtual time (looptime).

Hypothesis draws a dependency (timeout, reserve, min_useful, attempts, retry budget, backoff,
pushback cap, breaker, throttle, max_active, concurrent-retry cap, idempotency-key
generation) and a set of concurrent calls (arrival time, request deadline, idempotent or
mutation, explicit key or not, a caller that goes away), each with a script of per-attempt
outcomes of a fake *transport*: success after a delay, refused (never sent), lost after
sending, a hang past every deadline, 422 / 500 (not retryable), 503 with Retry-After, 502,
429, gRPC UNAVAILABLE with no answer, and a do-not-retry marker. The transport is the plain
async function the
Dependency wraps, so the scripted callable is the real thing, not a mock. It records what
each attempt saw (attempt number, key, deadline, breaker state, concurrency); a sink records
every event. After the run every invariant below is checked, each tied to a MISSION ID.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import looptime
from hypothesis import given, settings
from hypothesis import strategies as st

import brownout
from brownout import (
    BreakerState,
    CircuitBreaker,
    ClientThrottle,
    DeadlineExceeded,
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    Reason,
    Rejected,
    ResponseError,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    Stats,
    StopReason,
    TransientError,
    UnknownOutcome,
)
from brownout.events import (
    AttemptRetried,
    BreakerStateChanged,
    Event,
    EventHub,
    OutcomeUnknown,
    RequestShed,
    RetryBudgetExhausted,
)

EPS = 1e-6
HANG = 10_000.0  # "never answers": far past every deadline
_EDGE = 0.001  # the smallest reserve a Dependency keeps (brownout._dependency._EDGE)

# What the transport does on one attempt. `sent`: the request may have reached the server;
# `answered`: the server answered (so a mutation's outcome is known).
KINDS = [
    "ok",
    "refused",  # TransientError(sent=False): never left the client
    "lost",  # TransientError(sent=True): sent, no answer
    "hang",  # no answer until the attempt's budget cancels it
    "fatal",  # 422: answered, not retryable
    "server_error",  # 500: answered, not retryable
    "pushback",  # 503 + Retry-After: refused by the server
    "throttled",  # 429: refused by the server
    "gateway",  # 502: answered by a gateway that may have forwarded it
    "unavailable_lost",  # gRPC UNAVAILABLE made up by the client: sent, no answer
    "never",  # 503 + brownout-retry: never
]
# Retryable for any call (the request was certainly not applied).
SAFE_TO_RESEND = {"refused", "pushback", "throttled"}
# Retryable only for idempotent or keyed calls (the request may have been applied).
RESEND_IF_KEYED = {"lost", "cancelled", "gateway", "unavailable_lost"}
UNANSWERED = {"lost", "cancelled", "unavailable_lost"}  # sent, no answer: unknown (D6)
LOCAL_REASONS = {
    Reason.DEADLINE_TOO_SHORT,
    Reason.DEADLINE_EXPIRED,
    Reason.BREAKER_OPEN,
    Reason.THROTTLED,
    Reason.OVERLOADED,
}
EVENT_REASONS = {
    Reason.BREAKER_OPEN,
    Reason.THROTTLED,
    Reason.OVERLOADED,
    Reason.DEADLINE_TOO_SHORT,  # counted since the calls refused for lack of time are (O1)
    Reason.DEADLINE_EXPIRED,
}


@dataclass(frozen=True)
class Step:
    kind: str
    delay: float
    retry_after: float = 0.0


@dataclass(frozen=True)
class Call:
    start: float
    deadline: float | None
    idempotent: bool
    key: str | None
    script: tuple[Step, ...]
    cancel_after: float | None = None
    """The caller goes away (its task is cancelled) this long after the call starts."""


@dataclass(frozen=True)
class Config:
    attempts: int
    timeout: float | None
    reserve: float
    min_useful: float
    expected_attempt_time: float | None
    ratio: float
    min_per_second: float
    window: float
    buckets: int
    backoff_base: float
    backoff_cap: float
    max_pushback: float
    idempotency_keys: bool
    breaker: dict[str, Any] | None
    throttle_k: float | None
    max_active: int | None
    max_concurrent_retries: int | None
    seed: int
    healthy_after: float | None = None
    """From this time on the transport answers every attempt at once (a recovery)."""


@dataclass
class Attempt:
    """What the transport saw for one attempt."""

    call: int
    number: int
    key: str | None
    start: float
    deadline_at: float | None
    breaker_state: BreakerState | None
    breaker_epoch: int
    kind: str = ""  # the scripted kind, or "cancelled" when the budget cut it off
    error: BaseException | None = None
    end: float = math.nan


@dataclass
class Outcome:
    start: float = math.nan
    end: float = math.nan
    value: Any = None
    error: BaseException | None = None
    ended: int = 0


@dataclass
class Run:
    config: Config
    calls: list[Call]
    attempts: list[Attempt] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    ledger_writes: Counter[str] = field(default_factory=Counter)
    ledger_pending: list[str] = field(default_factory=list)
    peak_active: int = 0
    peak_retrying: int = 0
    stats: Stats | None = None
    leftover_active: int = 0
    leftover_slots: int = 0


class Recorder:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.transitions = 0

    def emit(self, event: Event) -> None:
        self.run.events.append(event)
        if isinstance(event, BreakerStateChanged):
            self.transitions += 1


class CountingLedger(InMemoryOutcomeLedger):
    """The real in-memory ledger, counting the writes it is asked for."""

    def __init__(self, writes: Counter[str]) -> None:
        super().__init__()
        self.writes = writes

    async def record_unknown(self, key: str, *, dependency: str, detail: str = "") -> None:
        self.writes[key] += 1
        await super().record_unknown(key, dependency=dependency, detail=detail)


def raise_for(step: Step) -> BaseException | None:
    kind = step.kind
    if kind == "refused":
        return TransientError("connection refused", sent=False)
    if kind == "lost":
        return TransientError("connection reset", sent=True)
    if kind == "fatal":
        return ResponseError(422)
    if kind == "server_error":
        return ResponseError(500)
    if kind == "pushback":
        return ResponseError(503, retry_after=step.retry_after)
    if kind == "throttled":
        return ResponseError(429)
    if kind == "gateway":
        return ResponseError(502)
    if kind == "unavailable_lost":
        return ResponseError(grpc_code="UNAVAILABLE", answered=False)
    if kind == "never":
        return ResponseError(503, do_not_retry=True)
    return None


def execute(config: Config, calls: list[Call]) -> Run:
    run = Run(config, calls)
    run.outcomes = [Outcome() for _ in calls]
    recorder = Recorder(run)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        events = EventHub()
        events.subscribe(recorder)
        stats = Stats()
        events.subscribe(stats)
        run.stats = stats
        rng = random.Random(config.seed)
        breaker = (
            CircuitBreaker(**config.breaker, rng=rng, events=events, name="b")
            if config.breaker is not None
            else None
        )
        throttle = (
            ClientThrottle(config.throttle_k, window=10.0, rng=rng, events=events, name="t")
            if config.throttle_k is not None
            else None
        )
        policy = RetryPolicy(
            config.attempts,
            budget=RetryBudget(
                config.ratio,
                min_per_second=config.min_per_second,
                window=config.window,
                buckets=config.buckets,
            ),
            backoff=ExponentialBackoff(config.backoff_base, cap=config.backoff_cap, rng=rng),
            expected_attempt_time=config.expected_attempt_time,
            max_pushback=config.max_pushback,
            idempotency_keys=config.idempotency_keys,
            events=events,
        )
        dep = Dependency(
            "dep",
            timeout=config.timeout,
            reserve=config.reserve,
            min_useful=config.min_useful,
            retry=policy,
            breaker=breaker,
            throttle=throttle,
            max_active=config.max_active,
            max_concurrent_retries=config.max_concurrent_retries,
            ledger=CountingLedger(run.ledger_writes),
            events=events,
        )
        active = 0
        retrying = 0

        async def transport(i: int) -> str:
            nonlocal active, retrying
            ctx = brownout.current()
            record = Attempt(
                i,
                ctx.attempt,
                ctx.idempotency_key,
                loop.time(),
                None if ctx.deadline is None else ctx.deadline.at,
                None if breaker is None else breaker.state,
                recorder.transitions,
            )
            run.attempts.append(record)
            script = calls[i].script
            step = script[record.number - 1] if record.number <= len(script) else Step("ok", 0.0)
            if config.healthy_after is not None and record.start >= config.healthy_after:
                step = Step("ok", 0.0)
            active += 1
            retrying += record.number > 1
            run.peak_active = max(run.peak_active, active)
            run.peak_retrying = max(run.peak_retrying, retrying)
            try:
                await asyncio.sleep(HANG if step.kind == "hang" else step.delay)
                error = raise_for(step)
                # (a hang with no timeout and no deadline is answered, very late)
                record.kind = "ok" if step.kind == "hang" else step.kind
                if error is not None:
                    record.error = error
                    raise error
                return f"ok-{i}-{record.number}"
            except asyncio.CancelledError:
                record.kind = "cancelled"
                raise
            finally:
                record.end = loop.time()
                active -= 1
                retrying -= record.number > 1

        async def calling(i: int, call: Call) -> Any:
            async with brownout.request(deadline=call.deadline, operation=f"c{i}"):
                return await dep.call(
                    transport, i, idempotent=call.idempotent, idempotency_key=call.key
                )

        async def one(i: int, call: Call) -> None:
            await asyncio.sleep(call.start)
            out = run.outcomes[i]
            out.start = loop.time()
            task = asyncio.create_task(calling(i, call))
            if call.cancel_after is not None:
                loop.call_later(call.cancel_after, task.cancel)
            try:
                out.value = await task
            except (Exception, asyncio.CancelledError) as error:
                out.error = error
            finally:
                out.end = loop.time()
                out.ended += 1

        await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        run.ledger_pending = [r.key for r in await dep.ledger.pending(10_000)]  # type: ignore[union-attr]
        run.leftover_active = dep.active
        run.leftover_slots = 0 if dep.retry_slots is None else dep.retry_slots.in_use

    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return run


# -- the invariants ------------------------------------------------------------------------


def for_call(events: list[Event], kind: type, i: int) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and getattr(e, "operation", "") == f"c{i}"]


def check(run: Run) -> list[str]:
    cfg = run.config
    bad: list[str] = []
    by_call: dict[int, list[Attempt]] = {i: [] for i in range(len(run.calls))}
    for a in run.attempts:
        by_call[a.call].append(a)
    keys_seen: dict[str, int] = {}

    for i, call in enumerate(run.calls):
        att = by_call[i]
        out = run.outcomes[i]
        err = out.error
        n = len(att)
        req_at = None if call.deadline is None else out.start + call.deadline
        retried = for_call(run.events, AttemptRetried, i)
        exhausted = for_call(run.events, RetryBudgetExhausted, i)
        unknown_events = for_call(run.events, OutcomeUnknown, i)
        shed = for_call(run.events, RequestShed, i)
        where = f"call {i} ({call}, {[(a.number, a.kind) for a in att]}, error={err!r})"

        # O1: every call ends exactly once; no attempt outlives its call.
        if out.ended != 1:
            bad.append(f"O1 {where}: ended {out.ended} times")
        for a in att:
            if not a.end <= out.end + EPS:
                bad.append(f"O1 {where}: attempt {a.number} outlived the call")

        # R1 / R5: attempt numbers 1..n, n <= attempts; the same key on every attempt.
        if [a.number for a in att] != list(range(1, n + 1)):
            bad.append(f"R5 {where}: attempt numbers {[a.number for a in att]}")
        if n > cfg.attempts:
            bad.append(f"R1 {where}: {n} attempts > {cfg.attempts}")
        keys = {a.key for a in att}
        if len(keys) > 1:
            bad.append(f"R5 {where}: keys {keys}")
        key = next(iter(keys)) if keys else None
        if att:
            if call.key is not None:
                want_key_ok = key == call.key
            elif call.idempotent or not cfg.idempotency_keys:
                want_key_ok = key is None
            else:
                want_key_ok = isinstance(key, str) and key not in keys_seen
            if not want_key_ok:
                bad.append(f"R5 {where}: key {key!r}")
            if key is not None and call.key is None:
                keys_seen[key] = i
        keyed = call.idempotent or key is not None or (call.key is not None)

        # R2: only retryable failures are retried; a sent mutation is never resent unkeyed.
        for a in att[:-1]:
            if a.kind in SAFE_TO_RESEND:
                continue
            if a.kind in RESEND_IF_KEYED and keyed:
                continue
            bad.append(f"R2 {where}: retried after {a.kind}")

        # D4 / R4: each attempt's budget is min(timeout, remaining - reserve), at least
        # min_useful, and no attempt runs past its budget or the request's deadline.
        reserve = max(cfg.reserve, _EDGE)
        for a in att:
            if req_at is None:
                want = cfg.timeout
            else:
                left = req_at - a.start - reserve
                want = left if cfg.timeout is None else min(cfg.timeout, left)
            got = None if a.deadline_at is None else a.deadline_at - a.start
            if (want is None) != (got is None) or (
                want is not None and got is not None and abs(want - got) > 1e-6
            ):
                bad.append(f"D4 {where}: attempt {a.number} budget {got} != {want}")
            if got is not None and got < cfg.min_useful - EPS:
                bad.append(f"D4 {where}: attempt {a.number} started with {got} < min_useful")
            if a.deadline_at is not None and not a.end <= a.deadline_at + EPS:
                bad.append(f"D5 {where}: attempt {a.number} ran past its budget")
            if req_at is not None and not a.end <= req_at - _EDGE + EPS:
                bad.append(f"D4 {where}: attempt {a.number} ran into the reserve")
        if req_at is not None and not out.end <= req_at + EPS:
            bad.append(f"D5 {where}: the call ended {out.end - req_at} s after its deadline")

        # R4: a retry is decided only when backoff + expected + reserve fits the time left,
        # and waits its backoff (at least the server's pushback) before it is sent.
        floor = cfg.min_useful
        if cfg.expected_attempt_time is not None:
            floor = max(floor, cfg.expected_attempt_time)
        for e in retried:
            if req_at is not None and not e.backoff + floor + reserve <= req_at - e.at + EPS:
                bad.append(f"R4 {where}: retry {e.attempt} decided with too little time")
            prev = att[e.attempt - 2] if e.attempt - 2 < n else None
            if prev is None:
                bad.append(f"O1 {where}: AttemptRetried({e.attempt}) without attempt before")
                continue
            if prev.kind == "pushback" and e.backoff < call.script[prev.number - 1].retry_after:
                bad.append(f"R2 {where}: backoff {e.backoff} shorter than Retry-After")
            top = ExponentialBackoff(cfg.backoff_base, cap=cfg.backoff_cap).ceiling(e.attempt - 1)
            if prev.kind != "pushback" and not 0.0 <= e.backoff <= top + EPS:
                bad.append(f"R1 {where}: backoff {e.backoff} outside [0, {top}]")
            if e.attempt - 1 < n and abs(att[e.attempt - 1].start - (e.at + e.backoff)) > EPS:
                bad.append(f"R1 {where}: attempt {e.attempt} did not wait its backoff")

        # O1: one AttemptRetried per retry: for every attempt sent after the first, and at
        # most one more for a retry a local guard refused.
        numbers = [e.attempt for e in retried]
        refused_retry = len(retried) == n and n >= 1  # the retry after attempt n was refused
        if numbers not in (list(range(2, n + 1)), list(range(2, n + 2))):
            bad.append(f"O1 {where}: AttemptRetried numbers {numbers}")
            refused_retry = False

        # D6: a mutation sent and not answered, never settled by a later answer, ends as
        # UnknownOutcome, once in the ledger (keyed) and once as an event.
        unanswered = any(a.kind in UNANSWERED for a in att)
        settled = n > 0 and att[-1].kind == "ok" and not refused_retry
        unknown = not call.idempotent and unanswered and not settled
        # The caller went away (cancelled): no answer to check, but an unknown outcome must
        # still be recorded (an attempt in flight then was sent and never answered).
        gone = isinstance(err, asyncio.CancelledError)
        if unknown:
            if not gone and (not isinstance(err, UnknownOutcome) or err.idempotency_key != key):
                bad.append(f"D6 {where}: want UnknownOutcome({key!r})")
            if key is not None and (run.ledger_writes[key] != 1 or key not in run.ledger_pending):
                bad.append(f"D6 {where}: ledger writes {run.ledger_writes[key]}")
            if len(unknown_events) != 1:
                bad.append(f"O1 {where}: {len(unknown_events)} OutcomeUnknown events")
        else:
            if isinstance(err, UnknownOutcome):
                bad.append(f"D6 {where}: UnknownOutcome for a known outcome")
            if key is not None and run.ledger_writes[key]:
                bad.append(f"D6 {where}: a known outcome in the ledger")
            if unknown_events:
                bad.append(f"O1 {where}: OutcomeUnknown for a known outcome")
        if gone:
            continue

        # What the caller gets, given what happened.
        budget_stop = isinstance(err, RetriesExhausted) and err.stopped_by is StopReason.BUDGET
        if budget_stop != bool(exhausted) and not (unknown and len(exhausted) == 1):
            bad.append(f"O1 {where}: {len(exhausted)} RetryBudgetExhausted events")
        if len(exhausted) > 1:
            bad.append(f"O1 {where}: {len(exhausted)} RetryBudgetExhausted events")
        if n == 0:
            if not (isinstance(err, Rejected) and err.reason in LOCAL_REASONS):
                bad.append(f"A6 {where}: never sent, yet not a local refusal")
            elif len(shed) != (err.reason in EVENT_REASONS):
                bad.append(f"O1 {where}: {len(shed)} RequestShed for {err.reason}")
            continue
        if len(shed) > refused_retry:
            bad.append(f"O1 {where}: {len(shed)} RequestShed events")
        last = att[-1]
        if unknown:
            continue
        if refused_retry:
            if not (
                isinstance(err, RetriesExhausted)
                and err.stopped_by is StopReason.REFUSED
                and err.attempts == n
            ):
                bad.append(f"R1 {where}: a refused retry must give up with the real failure")
            continue
        if last.kind == "ok":
            if err is not None or out.value != f"ok-{i}-{n}":
                bad.append(f"O1 {where}: success not returned")
        elif last.kind in ("fatal", "server_error"):
            if err is not last.error:
                bad.append(f"R2 {where}: a non-retryable answer must be raised unchanged")
        elif last.kind == "never":
            if not (
                isinstance(err, RetriesExhausted) and err.stopped_by is StopReason.DO_NOT_RETRY
            ):
                bad.append(f"R1 {where}: do-not-retry must stop with DO_NOT_RETRY")
        elif last.kind in SAFE_TO_RESEND or keyed:
            if cfg.attempts == 1:
                ok = err is last.error or (
                    last.kind == "cancelled" and isinstance(err, DeadlineExceeded)
                )
            else:
                # Stopped by the attempt limit exactly when it was reached.
                ok = (
                    isinstance(err, RetriesExhausted)
                    and err.attempts == n
                    and (err.stopped_by is StopReason.ATTEMPTS) == (n == cfg.attempts)
                )
            if not ok:
                bad.append(f"R1 {where}: giving up on a transient failure")
        else:  # an unkeyed mutation that was sent and answered (502): not retried, raised
            if err is not last.error:
                bad.append(f"R2 {where}: unkeyed sent mutation's answer must be raised")

    bad.extend(check_budget(run))
    bad.extend(check_breaker(run, by_call))
    bad.extend(check_capacity(run))
    bad.extend(check_stats(run))
    return bad


def check_budget(run: Run) -> list[str]:
    """R3: in every window of the budget (its slices, as documented), retries <= ratio x
    originals + min_per_second x window. Retries are counted when the budget pays for them
    (`AttemptRetried`), originals when they deposit: when the first attempt, having reached
    the transport, ends (`RetryPolicy` deposits once an original was tried, so a first attempt
    that spans a slice boundary pays into the later slice; one refused locally never reached
    the transport and deposits nothing)."""
    cfg = run.config
    width = cfg.window / cfg.buckets
    starts = sorted(a.end for a in run.attempts if a.number == 1 and not math.isnan(a.end))
    paid = [e.at for e in run.events if isinstance(e, AttemptRetried)]
    bad = []
    for j, at in enumerate(paid):
        top = int(at // width)
        low = top - cfg.buckets + 1
        retries = sum(1 for t in paid[: j + 1] if low <= int(t // width) <= top)
        originals = sum(1 for t in starts if t <= at and low <= int(t // width) <= top)
        allowed = cfg.ratio * originals + cfg.min_per_second * cfg.window
        if retries > allowed + 1e-9:
            bad.append(f"R3 {retries} retries in a window of {originals} originals > {allowed}")
            break
    return bad


def check_breaker(run: Run, by_call: dict[int, list[Attempt]]) -> list[str]:
    """R6: an open breaker calls nothing; half-open sends at most ``half_open_probes`` and
    closes only after that many succeed; each open period is jittered within its bounds."""
    b = run.config.breaker
    if b is None:
        return []
    bad = []
    probes = b["half_open_probes"]
    sent_in: Counter[int] = Counter()
    ok_in: Counter[int] = Counter()
    spans: dict[int, list[tuple[float, float]]] = {}
    for a in run.attempts:
        if a.breaker_state is BreakerState.OPEN:
            bad.append(f"R6 attempt {a.call}/{a.number} sent while the breaker was open")
        if a.breaker_state is BreakerState.HALF_OPEN:
            spans.setdefault(a.breaker_epoch, []).append((a.start, a.end))
            # A probe whose caller went away is ignored, as cancellation is in the closed
            # state (docs/circuit-breakers.md), and frees its place for another probe.
            caller_left = a.kind == "cancelled" and isinstance(
                run.outcomes[a.call].error, asyncio.CancelledError
            )
            sent_in[a.breaker_epoch] += not caller_left
            ok_in[a.breaker_epoch] += a.kind in ("ok", "fatal")
    for sent in sent_in.values():
        if sent > probes:
            bad.append(f"R6 {sent} probes counted in one half-open period (limit {probes})")
    for intervals in spans.values():
        for start, _ in intervals:
            at_once = sum(1 for s, e in intervals if s <= start < e)
            if at_once > probes:
                bad.append(f"R6 {at_once} probes in flight at once (limit {probes})")
    transitions = [e for e in run.events if isinstance(e, BreakerStateChanged)]
    low = b["open_for"] * (1 - b["open_jitter"])
    high = b["open_for"] * (1 + b["open_jitter"])
    for k, e in enumerate(transitions):
        if e.new == "half_open" and k > 0:
            opened = transitions[k - 1]
            if not low - EPS <= e.at - opened.at:
                bad.append(f"R6 half-open {e.at - opened.at} s after opening (< {low})")
        if e.new == "closed" and e.old == "half_open" and ok_in[k] < probes:
            # epoch k: the half-open period began with transition k - 1, so attempts sent in
            # it saw k transitions.
            bad.append(f"R6 closed after {ok_in[k]} successful probes (< {probes})")
    for out in run.outcomes:
        err = out.error
        if (
            isinstance(err, Rejected)
            and err.reason is Reason.BREAKER_OPEN
            and err.retry_after is not None
            and not err.retry_after <= high + EPS
        ):
            bad.append(f"R6 retry_after {err.retry_after} > {high}")
    return bad


def check_capacity(run: Run) -> list[str]:
    """A6: max_active attempts in flight, max_concurrent_retries retries in flight; every
    counter back to zero once the calls have ended."""
    cfg = run.config
    bad = []
    if cfg.max_active is not None and run.peak_active > cfg.max_active:
        bad.append(f"A6 {run.peak_active} attempts in flight > max_active {cfg.max_active}")
    cap = cfg.max_concurrent_retries
    if cap is not None and run.peak_retrying > cap:
        bad.append(f"A6 {run.peak_retrying} retries in flight > {cap}")
    if run.leftover_active or run.leftover_slots:
        bad.append(f"A6 leaked: active={run.leftover_active} slots={run.leftover_slots}")
    return bad


def check_stats(run: Run) -> list[str]:
    """O1: Stats, fed by the same hub, counts what happened."""
    stats = run.stats
    assert stats is not None
    bad = []
    ev = run.events
    for kind, typ in (
        ("retried", AttemptRetried),
        ("budget_exhausted", RetryBudgetExhausted),
        ("outcome_unknown", OutcomeUnknown),
        ("shed", RequestShed),
    ):
        if stats.count(kind) != sum(isinstance(e, typ) for e in ev):
            bad.append(f"O1 Stats.{kind} disagrees with the events")
    return bad


# -- strategies ------------------------------------------------------------------------------


def steps(max_attempts: int) -> st.SearchStrategy[tuple[Step, ...]]:
    step = st.builds(
        Step,
        # Retryable failures twice as often: they are what exercises the retry loop.
        kind=st.sampled_from([*KINDS, "refused", "lost", "hang", "pushback", "gateway"]),
        delay=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.6]),
        retry_after=st.sampled_from([0.0, 0.05, 0.3, 2.0]),
    )
    return st.lists(step, min_size=max_attempts - 1, max_size=max_attempts).map(tuple)


@st.composite
def scenarios(draw: st.DrawFn, *, breaker: bool | None = None) -> tuple[Config, list[Call]]:
    attempts = draw(st.integers(1, 4))
    timeout = draw(st.one_of(st.none(), st.sampled_from([0.05, 0.15, 0.5, 1.0])))
    min_useful = draw(st.sampled_from([0.0, 0.01, 0.1]))
    if timeout is not None:
        min_useful = min(min_useful, timeout)  # (a Dependency refuses timeout < min_useful)
    with_breaker = draw(st.booleans()) if breaker is None else breaker
    config = Config(
        attempts=attempts,
        timeout=timeout,
        reserve=draw(st.sampled_from([0.0, 0.0005, 0.02, 0.1])),
        min_useful=min_useful,
        expected_attempt_time=draw(st.one_of(st.none(), st.sampled_from([0.0, 0.05, 0.4]))),
        ratio=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        min_per_second=draw(st.sampled_from([0.0, 0.1, 1.0, 10.0, 10.0])),
        window=draw(st.sampled_from([0.5, 2.0, 10.0])),
        buckets=draw(st.sampled_from([1, 4, 10])),
        backoff_base=draw(st.sampled_from([0.0, 0.01, 0.1])),
        backoff_cap=draw(st.sampled_from([0.05, 0.5])),
        max_pushback=draw(st.sampled_from([0.1, 30.0])),
        idempotency_keys=draw(st.booleans()),
        breaker=(
            {
                "failure_rate": draw(st.sampled_from([0.2, 0.5, 1.0])),
                "window": draw(st.integers(1, 6)),
                "minimum_calls": draw(st.integers(1, 6)),
                "open_for": draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])),
                "open_jitter": draw(st.sampled_from([0.0, 0.3])),
                "half_open_probes": draw(st.integers(1, 3)),
            }
            if with_breaker
            else None
        ),
        throttle_k=draw(st.one_of(st.none(), st.sampled_from([1.0, 2.0]))),
        max_active=draw(st.one_of(st.none(), st.none(), st.integers(0, 4))),
        max_concurrent_retries=draw(st.one_of(st.none(), st.none(), st.integers(0, 3))),
        seed=draw(st.integers(0, 2**16)),
        healthy_after=draw(st.sampled_from([0.1, 0.5, 1.0])) if breaker else None,
    )
    calls = draw(
        st.lists(
            st.builds(
                Call,
                start=st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 1.0, 3.0]),
                deadline=st.one_of(st.none(), st.sampled_from([0.03, 0.1, 0.3, 1.0, 3.0])),
                idempotent=st.booleans(),
                key=st.sampled_from([None, "order"]),
                script=steps(attempts),
                cancel_after=st.sampled_from([None, None, None, 0.02, 0.1, 0.3]),
            ),
            min_size=1,
            max_size=16 if breaker else 10,
        )
    )
    # Explicit keys are per call (two calls sharing a key are the same operation).
    calls = [
        c if c.key is None else dataclasses.replace(c, key=f"k{i}") for i, c in enumerate(calls)
    ]
    return config, calls


PROPERTY = settings(max_examples=300, deadline=None, derandomize=True)


@PROPERTY
@given(scenarios())
def test_property_outbound_calls_keep_every_invariant(
    scenario: tuple[Config, list[Call]],
) -> None:
    """R1-R6, D4-D6, A6, O1 over random dependencies, outcomes, deadlines and concurrency."""
    config, calls = scenario
    assert check(execute(config, calls)) == []


@settings(max_examples=200, deadline=None, derandomize=True)
@given(scenarios(breaker=True))
def test_property_breaker_recovery_under_concurrent_waves(
    scenario: tuple[Config, list[Call]],
) -> None:
    """R6 with a breaker on every run: open calls nothing, half-open sends a few probes."""
    config, calls = scenario
    assert check(execute(config, calls)) == []


@st.composite
def tight_scenarios(draw: st.DrawFn) -> tuple[Config, list[Call]]:
    """Deadlines that server pushback and attempt times fill exactly: no reserve, attempts
    estimated at 0 s, nothing else in the way. Where a retry's wait uses up the time left,
    the retry must not be decided (R4)."""
    attempts = draw(st.integers(2, 4))
    config = Config(
        attempts=attempts,
        timeout=None,
        reserve=0.0,
        min_useful=0.0,
        expected_attempt_time=0.0,
        ratio=1.0,
        min_per_second=10.0,
        window=10.0,
        buckets=10,
        backoff_base=0.0,
        backoff_cap=0.05,
        max_pushback=30.0,
        idempotency_keys=True,
        breaker=None,
        throttle_k=None,
        max_active=None,
        max_concurrent_retries=None,
        seed=0,
    )
    step = st.builds(
        Step,
        kind=st.sampled_from(["pushback", "pushback", "refused", "lost", "ok"]),
        delay=st.sampled_from([0.0, 0.05, 0.1]),
        retry_after=st.sampled_from([0.05, 0.1]),
    )
    calls = draw(
        st.lists(
            st.builds(
                Call,
                start=st.sampled_from([0.0, 0.05]),
                deadline=st.sampled_from([0.05, 0.1, 0.15, 0.2, 0.3]),
                idempotent=st.booleans(),
                key=st.none(),
                script=st.lists(step, min_size=attempts - 1, max_size=attempts).map(tuple),
            ),
            min_size=1,
            max_size=4,
        )
    )
    return config, calls


@settings(max_examples=100, deadline=None, derandomize=True)
@given(tight_scenarios())
def test_property_retries_fit_the_time_left_to_the_millisecond(
    scenario: tuple[Config, list[Call]],
) -> None:
    """R4/D4 at the edge: a retry whose backoff fills what is left is never decided."""
    config, calls = scenario
    assert check(execute(config, calls)) == []
