"""requests and urllib3 through a `Dependency`, against a real HTTP server over loopback.

The server (`http.server.ThreadingHTTPServer`, one per module) records what arrived, so the
counts and headers below are what went over the wire.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
import redis.asyncio
import requests
import urllib3
from tests import services

import brownout
from brownout import (
    CircuitBreaker,
    Dependency,
    ExponentialBackoff,
    InMemoryOutcomeLedger,
    Reason,
    RedisOutcomeLedger,
    Rejected,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    ThreadBulkhead,
    UnknownOutcome,
)
from brownout.integrations.requests import BrownoutAdapter
from brownout.integrations.urllib3 import BrownoutPoolManager
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

SLACK = 1.5  # seconds of scheduling noise allowed on a shared 2-core host


class _Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[str, str, dict[str, str]]] = []
        self.flaky: dict[str, int] = {}
        self.held = 0  # requests inside /held now
        self.most_held = 0  # the most there were at once

    def of(self, path: str) -> list[dict[str, str]]:
        with self.lock:
            return [h for (_, p, h) in self.rows if p == path]


SEEN = _Seen()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        headers = {k.lower(): v for k, v in self.headers.items()}
        with SEEN.lock:
            SEEN.rows.append((self.command, url.path, headers))
        extra: list[tuple[str, str]] = []
        status = 200
        if url.path == "/slow":
            time.sleep(float(query["s"]))
        elif url.path == "/held":
            with SEEN.lock:
                SEEN.held += 1
                SEEN.most_held = max(SEEN.most_held, SEEN.held)
            time.sleep(float(query["s"]))
            with SEEN.lock:
                SEEN.held -= 1
        elif url.path.startswith("/status/"):
            status = int(url.path.rsplit("/", 1)[1])
            if "retry_after" in query:
                extra.append(("Retry-After", query["retry_after"]))
        elif url.path == "/flaky":
            # Fails ``fails`` times per id, then answers.
            with SEEN.lock:
                n = SEEN.flaky.get(query["id"], 0)
                SEEN.flaky[query["id"]] = n + 1
            if n < int(query["fails"]):
                status = 503
                extra.append(("Retry-After", query.get("retry_after", "0")))
        elif url.path == "/never":
            status = 503
            extra += [("brownout-retry", "later"), ("brownout-retry", "never")]
        body = b"done"
        self.send_response(status)
        for name, value in extra:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        try:
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on a slow answer: what these tests expect


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _session(dep: Dependency, **kw: object) -> requests.Session:
    session = requests.Session()
    session.mount("http://", BrownoutAdapter(dep, **kw))  # type: ignore[arg-type]
    return session


def _fast_retries(attempts: int = 3, **kw: object) -> RetryPolicy:
    return RetryPolicy(attempts, backoff=ExponentialBackoff(0.01, jitter=False), **kw)  # type: ignore[arg-type]


# -- requests ------------------------------------------------------------------------------


def test_the_budget_header_arrives_and_shrinks(base: str) -> None:
    session = _session(Dependency("svc"))
    with brownout.request(deadline=2.0, priority=brownout.Priority.CRITICAL):
        session.get(f"{base}/status/200?n=budget1")
        time.sleep(0.2)
        session.get(f"{base}/status/200?n=budget2")
    first, second = (int(h["brownout-budget-ms"]) for h in SEEN.of("/status/200")[-2:])
    assert 0 < second < first <= 2000
    assert second <= first - 150  # the 200 ms spent in between came out of it


def test_a_slow_endpoint_ends_with_the_deadline(base: str) -> None:
    session = _session(Dependency("svc", retry=_fast_retries()))
    started = time.monotonic()
    with brownout.deadline(0.5), pytest.raises((Rejected, brownout.DeadlineExceeded)):
        session.get(f"{base}/slow?s=3")
    assert time.monotonic() - started < 0.5 + SLACK


def test_a_503_is_retried_after_its_retry_after(base: str) -> None:
    session = _session(Dependency("svc", retry=_fast_retries()))
    started = time.monotonic()
    answer = session.get(f"{base}/flaky?id=ra&fails=1&retry_after=1")
    assert answer.status_code == 200
    assert answer.text == "done"
    assert time.monotonic() - started >= 0.95  # waited out Retry-After: 1
    assert [h.get("brownout-attempt", "1") for h in SEEN.of("/flaky")[-2:]] == ["1", "2"]


def test_brownout_retry_never_on_any_line_stops_retries(base: str) -> None:
    before = len(SEEN.of("/never"))
    session = _session(Dependency("svc", retry=_fast_retries()))
    with pytest.raises(RetriesExhausted):
        session.get(f"{base}/never")
    assert len(SEEN.of("/never")) == before + 1
    answer = _session(Dependency("svc", retry=_fast_retries()), return_exhausted=True).get(
        f"{base}/never"
    )
    assert answer.status_code == 503
    assert len(SEEN.of("/never")) == before + 2


def test_a_404_is_returned_as_it_is(base: str) -> None:
    answer = _session(Dependency("svc", retry=_fast_retries())).get(f"{base}/status/404")
    assert answer.status_code == 404
    assert answer.text == "done"


def test_a_retry_budget_shared_by_16_threads_caps_retries(base: str) -> None:
    # 16 originals earn 1.6 retries at ratio 0.1; the reserve adds 0.5/s x 10 s = 5: at most 6.
    budget = RetryBudget(0.1, min_per_second=0.5, window=10.0)
    dep = Dependency("capped", retry=_fast_retries(5, budget=budget))
    session = _session(dep)
    before = len(SEEN.of("/status/502"))
    start = threading.Barrier(16)
    outcomes: list[str] = []

    def one() -> None:
        start.wait()
        try:
            session.get(f"{base}/status/502")
        except RetriesExhausted as e:
            outcomes.append(e.stopped_by.value)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    sent = len(SEEN.of("/status/502")) - before
    assert len(outcomes) == 16
    assert sent - 16 == 6  # every retry the rule allows, and not one more
    assert "budget" in outcomes


def test_the_breaker_opens_and_fails_fast(base: str) -> None:
    breaker = CircuitBreaker("svc", window=4, minimum_calls=4, open_for=30.0)
    session = _session(Dependency("svc", breaker=breaker))
    before = len(SEEN.of("/status/500"))
    for _ in range(4):
        assert session.get(f"{base}/status/500").status_code == 500
    started = time.monotonic()
    with pytest.raises(Rejected) as refused:
        session.get(f"{base}/status/500")
    assert refused.value.reason is Reason.BREAKER_OPEN
    assert time.monotonic() - started < 0.5
    assert len(SEEN.of("/status/500")) == before + 4


def test_a_post_never_answered_is_an_unknown_outcome_in_the_ledger(base: str) -> None:
    ledger = InMemoryOutcomeLedger()
    session = _session(Dependency("pay", retry=_fast_retries(), ledger=ledger))
    started = time.monotonic()
    with brownout.deadline(0.6), pytest.raises(UnknownOutcome) as lost:
        session.post(f"{base}/slow?s=2", json={"order": 1})
    assert time.monotonic() - started < 0.6 + SLACK
    key = lost.value.idempotency_key
    assert key is not None
    assert lost.value.recorded
    assert SEEN.of("/slow")[-1]["idempotency-key"] == key
    record = asyncio.run(ledger.get(key))
    assert record is not None
    assert record.state.value == "pending"


def test_the_idempotency_key_is_the_same_on_every_attempt(base: str) -> None:
    session = _session(Dependency("pay", retry=_fast_retries()))
    answer = session.post(f"{base}/flaky?id=key&fails=2", data=b"x")
    assert answer.status_code == 200
    rows = SEEN.of("/flaky")[-3:]
    assert [h.get("brownout-attempt", "1") for h in rows] == ["1", "2", "3"]
    assert len({h["idempotency-key"] for h in rows}) == 1
    own = session.post(
        f"{base}/flaky?id=own&fails=1", data=b"x", headers={"Idempotency-Key": "mine-1"}
    )
    assert own.status_code == 200
    assert [h["idempotency-key"] for h in SEEN.of("/flaky")[-2:]] == ["mine-1", "mine-1"]


def test_a_callers_smaller_timeout_is_kept(base: str) -> None:
    session = _session(Dependency("svc", timeout=5.0))
    started = time.monotonic()
    with pytest.raises(requests.ReadTimeout):
        session.get(f"{base}/slow?s=2", timeout=0.3)  # no retries: requests' own error
    assert time.monotonic() - started < 0.3 + SLACK


def test_a_refused_connection_is_resent_as_it_never_left(base: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    dep = Dependency("gone", retry=_fast_retries())
    with pytest.raises(RetriesExhausted) as gave_up:
        _session(dep).post(f"http://127.0.0.1:{port}/charge", data=b"x")
    assert gave_up.value.attempts == 3  # a mutation, resent: it certainly never left


# -- urllib3 --------------------------------------------------------------------------------


def test_urllib3_sends_the_budget_and_retries_503(base: str) -> None:
    http = BrownoutPoolManager(Dependency("svc", retry=_fast_retries()))
    with brownout.deadline(3.0):
        answer = http.request("GET", f"{base}/flaky?id=u3&fails=1")
    assert answer.status == 200
    assert answer.data == b"done"
    rows = SEEN.of("/flaky")[-2:]
    assert [h.get("brownout-attempt", "1") for h in rows] == ["1", "2"]
    assert 0 < int(rows[1]["brownout-budget-ms"]) <= 3000


def test_urllib3_post_never_answered_is_unknown(base: str) -> None:
    ledger = InMemoryOutcomeLedger()
    http = BrownoutPoolManager(Dependency("pay", retry=_fast_retries(), ledger=ledger))
    started = time.monotonic()
    with brownout.deadline(0.6), pytest.raises(UnknownOutcome) as lost:
        http.request("POST", f"{base}/slow?s=2", body=b"x")
    assert time.monotonic() - started < 0.6 + SLACK
    key = lost.value.idempotency_key
    assert key is not None
    assert SEEN.of("/slow")[-1]["idempotency-key"] == key
    assert asyncio.run(ledger.get(key)) is not None


def test_urllib3_answers_and_refusals(base: str) -> None:
    http = BrownoutPoolManager(Dependency("svc", retry=_fast_retries()))
    assert http.request("GET", f"{base}/status/404").status == 404
    with pytest.raises(RetriesExhausted):
        http.request("GET", f"{base}/never")
    with pytest.raises(ValueError, match="one retry layer"):
        http.request("GET", f"{base}/status/200", retries=urllib3.Retry(3))
    with pytest.raises(ValueError, match="one retry layer"):
        BrownoutPoolManager(retries=3)


# -- a ThreadBulkhead on the blocking path ---------------------------------------------------


def _eight_at_once(dep: Dependency, url: str) -> tuple[int, list[Reason], int]:
    """Eight threads GET ``url`` through ``dep`` together: (answers, refusal reasons, reads
    that timed out)."""
    start = threading.Barrier(8)
    answered: list[int] = []
    refused: list[Reason] = []
    timed_out: list[BaseException] = []

    def get() -> None:
        session = _session(dep)
        start.wait()
        try:
            answered.append(session.get(url).status_code)
        except Rejected as refusal:
            refused.append(refusal.reason)
        except requests.Timeout as late:  # admitted with less time left than the answer takes
            timed_out.append(late)

    threads = [threading.Thread(target=get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answered.count(200) == len(answered)
    return len(answered), refused, len(timed_out)


def test_a_thread_bulkhead_holds_the_server_to_its_limit(base: str) -> None:
    bulkhead = ThreadBulkhead("svc", FixedLimit(2), FifoQueue(max_size=2, max_wait=30.0))
    dep = Dependency("svc", bulkhead=bulkhead)
    with SEEN.lock:
        SEEN.most_held = 0
    answered, refused, timed_out = _eight_at_once(dep, f"{base}/held?s=0.4")
    assert SEEN.most_held == 2  # never more than the limit at the server
    assert (answered, timed_out) == (4, 0)  # two admitted at once, two queued behind them
    assert refused == [Reason.QUEUE_FULL] * 4
    assert bulkhead.in_flight == 0  # every permit settled
    assert dep.active == 0


def test_a_queued_attempt_spends_its_own_budget(base: str) -> None:
    bulkhead = ThreadBulkhead("svc", FixedLimit(2), FifoQueue(max_size=8, max_wait=30.0))
    dep = Dependency("svc", bulkhead=bulkhead, timeout=0.6)
    with SEEN.lock:
        SEEN.most_held = 0
    before = len(SEEN.of("/held"))
    answered, refused, timed_out = _eight_at_once(dep, f"{base}/held?s=0.4")
    # A read that timed out frees its permit while the server still works on it.
    assert 2 <= SEEN.most_held <= 2 + timed_out
    # Two go at once; the rest wait at most their 0.6 s budget, and a pair admitted after
    # 0.4 s has too little left for the answer.
    assert answered >= 2
    assert len(refused) >= 2  # at most a third pair starts, with what the skew left
    assert answered + len(refused) + timed_out == 8
    assert set(refused) <= {Reason.QUEUE_TIMEOUT, Reason.DEADLINE_EXPIRED}
    assert len(SEEN.of("/held")) == before + answered + timed_out  # refused: never sent
    assert bulkhead.in_flight == 0


def test_an_asyncio_bulkhead_is_a_type_error(base: str) -> None:
    dep = Dependency("svc", bulkhead=brownout.Bulkhead("svc", FixedLimit(2)))
    with pytest.raises(TypeError, match="ThreadBulkhead"):
        _session(dep).get(f"{base}/status/200")


# -- the outcome ledger on Redis, from threads ------------------------------------------------


@pytest.fixture
def redis_ledger() -> Iterator[tuple[RedisOutcomeLedger, redis.Redis]]:
    server = services.require(services.REDIS)
    # Made for this ledger alone: the blocking path awaits its writes on one private loop.
    client = redis.asyncio.Redis(host=server.host, port=server.port)
    check = redis.Redis(host=server.host, port=server.port)
    prefix = f"{{test-blocking-{time.monotonic_ns()}}}"
    try:
        yield RedisOutcomeLedger(client, prefix=prefix, ttl=60), check
    finally:
        keys = list(check.scan_iter(match=f"{prefix}:*"))
        if keys:
            check.delete(*keys)
        check.close()


def test_posts_never_answered_are_recorded_in_redis(
    base: str, redis_ledger: tuple[RedisOutcomeLedger, redis.Redis]
) -> None:
    ledger, check = redis_ledger
    dep = Dependency("pay", retry=_fast_retries(), ledger=ledger)
    lost: list[UnknownOutcome] = []
    errors: list[BaseException] = []

    def post(n: int) -> None:
        session = _session(dep)
        try:
            with brownout.deadline(0.5):
                session.post(f"{base}/slow?s=2", json={"order": n})
        except UnknownOutcome as unknown:
            lost.append(unknown)
        except BaseException as error:
            errors.append(error)

    post(0)  # alone first, then four threads at once: the ledger's client serves them all
    threads = [threading.Thread(target=post, args=(n,)) for n in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(lost) == 5
    assert all(unknown.recorded for unknown in lost)
    keys = [unknown.idempotency_key for unknown in lost]
    sent = {h.get("idempotency-key") for h in SEEN.of("/slow")}
    for key in keys:
        assert key in sent
        record = check.hgetall(f"{ledger.name}:outcome:{key}")
        assert record[b"state"] == b"pending"
        assert record[b"dependency"] == b"pay"
