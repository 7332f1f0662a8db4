"""The WSGI edge (`brownout.integrations.wsgi`, `.flask`) through Flask's own test client:
route templates as labels, health paths, refusals, the 504 of a handler that returned after
its deadline, header trust and malformed headers, settling by status and body close."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, Response

from brownout import (
    Bulkhead,
    EdgePolicy,
    InboundDeadlinePolicy,
    Priority,
    Quota,
    Reason,
    Rejected,
    Route,
    SlowedRejections,
    ThreadBulkhead,
    Trust,
)
from brownout.events import (
    DeadlineHeaderIgnored,
    EventHub,
    HandlerOverran,
    RequestAbandoned,
    RequestAdmitted,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
    RequestOffered,
    RequestShed,
)
from brownout.integrations.flask import protect
from brownout.integrations.wsgi import BrownoutMiddleware, environ_getter
from brownout.limits import FixedLimit
from brownout.testing import EventRecorder

SLOW = 0.3
SHORT = 0.05


def make_app(policy: EdgePolicy) -> tuple[Flask, list[str]]:
    app = Flask(__name__)
    calls: list[str] = []
    closed: list[str] = []

    @app.get("/items/<int:item_id>")
    def item(item_id: int) -> dict[str, int]:
        calls.append("item")
        return {"id": item_id}

    @app.get("/slow")
    def slow() -> str:
        calls.append("slow")
        time.sleep(SLOW)
        return "late"

    @app.get("/boom")
    def boom() -> tuple[str, int]:
        return "broken", 500

    @app.get("/refused")
    def refused() -> str:
        raise Rejected(Reason.BREAKER_OPEN, retry_after=2.0)

    @app.get("/stream")
    def stream() -> Response:
        def chunks() -> Iterator[str]:
            try:
                yield "a"
                yield "b"
            finally:
                closed.append("stream")

        return Response(chunks())

    @app.get("/health")
    def health() -> str:
        calls.append("health")
        return "ok"

    protect(app, policy)
    app.config["closed"] = closed
    return app, calls


@pytest.fixture
def hub() -> EventHub:
    return EventHub()


@pytest.fixture
def recorder(hub: EventHub) -> Iterator[EventRecorder]:
    with EventRecorder(hub) as rec:
        yield rec


def policy_for(hub: EventHub, **kw: object) -> EdgePolicy:
    return EdgePolicy(routes={"/slow": Route(default=SHORT)}, events=hub, **kw)  # type: ignore[arg-type]


def of(recorder: EventRecorder, kind: type) -> list:
    return [e for e in recorder.events if isinstance(e, kind)]


def test_flask_rule_is_the_operation_label(hub: EventHub, recorder: EventRecorder) -> None:
    app, _ = make_app(policy_for(hub))
    client = app.test_client()
    for n in (1, 2, 3):
        assert client.get(f"/items/{n}").json == {"id": n}
    assert client.get("/nowhere").data
    ops = [e.operation for e in of(recorder, RequestCompleted)]
    assert ops == ["/items/<int:item_id>"] * 3 + ["unmatched"]


def test_health_path_is_served_and_never_counted(hub: EventHub, recorder: EventRecorder) -> None:
    app, calls = make_app(policy_for(hub))
    assert app.test_client().get("/health").text == "ok"
    assert calls == ["health"]
    assert recorder.events == []


def test_a_handler_returning_after_its_deadline_gets_504(
    hub: EventHub, recorder: EventRecorder
) -> None:
    app, calls = make_app(policy_for(hub))
    r = app.test_client().get("/slow")
    assert r.status_code == 504
    assert r.headers["content-type"] == "application/problem+json"
    assert json.loads(r.data)["reason"] == "deadline_expired"
    assert calls == ["slow"]  # it ran to its end: a thread cannot be cancelled
    (overran,) = of(recorder, HandlerOverran)
    assert overran.operation == "/slow" and overran.overrun >= SLOW - SHORT - 0.01
    assert [e.operation for e in of(recorder, RequestExpired)] == ["/slow"]
    assert of(recorder, RequestCompleted) == []


@pytest.mark.parametrize("guarded", [True, False])
def test_the_overrun_log_says_the_504_went_out_when_the_handler_returned(
    hub: EventHub, caplog: pytest.LogCaptureFixture, guarded: bool
) -> None:
    bulkhead = ThreadBulkhead("t", FixedLimit(2), events=hub) if guarded else None
    app, _ = make_app(policy_for(hub, bulkhead=bulkhead))
    with caplog.at_level(logging.WARNING, logger="brownout.edge"):
        assert app.test_client().get("/slow").status_code == 504
    (message,) = [r.getMessage() for r in caplog.records if "past its deadline" in r.message]
    assert "when it returned" in message  # a thread is never cancelled at the deadline
    assert "at the deadline" not in message and "cancellation" not in message


def test_a_spent_budget_is_refused_before_the_work(hub: EventHub, recorder: EventRecorder) -> None:
    app, calls = make_app(policy_for(hub, deadline=_honouring(hub)))
    r = app.test_client().get("/items/1", headers={"brownout-budget-ms": "0"})
    assert r.status_code == 504
    assert calls == []
    (shed,) = of(recorder, RequestShed)
    assert shed.reason is Reason.DEADLINE_EXPIRED


def _honouring(hub: EventHub) -> InboundDeadlinePolicy:  # reports to the test's hub
    return InboundDeadlinePolicy(events=hub)


def test_malformed_budget_falls_back_to_the_default(hub: EventHub, recorder: EventRecorder) -> None:
    app, _ = make_app(policy_for(hub, deadline=_honouring(hub)))
    for bad in ("soon", "-5", "1e999", "5000, 3000"):
        r = app.test_client().get("/items/1", headers={"brownout-budget-ms": bad})
        assert r.status_code == 200, bad
    assert len(of(recorder, DeadlineHeaderIgnored)) == 3
    remaining = [e.remaining for e in of(recorder, RequestOffered)]
    assert remaining[-1] is not None and 2.0 < remaining[-1] <= 3.0  # the shortest wins


def test_priority_claim_ignored_untrusted_and_honoured_trusted(
    hub: EventHub, recorder: EventRecorder
) -> None:
    def trust(environ: dict) -> Trust:
        # what an authentication layer in front established
        return Trust.TRUSTED if environ.get("REMOTE_USER") == "mesh" else Trust.UNTRUSTED

    app, _ = make_app(policy_for(hub, trust=trust, default_priority=Priority.SHEDDABLE_PLUS))
    client = app.test_client()
    claim = {"brownout-priority": "critical"}
    assert client.get("/items/1", headers=claim).data
    assert client.get("/items/2", headers=claim, environ_base={"REMOTE_USER": "mesh"}).data
    priorities = [e.priority for e in of(recorder, RequestAdmitted)]
    assert priorities == [Priority.SHEDDABLE_PLUS, Priority.CRITICAL]
    assert [e.problem for e in of(recorder, DeadlineHeaderIgnored)] == ["untrusted source"]


def test_a_5xx_is_a_failure(hub: EventHub, recorder: EventRecorder) -> None:
    app, _ = make_app(policy_for(hub))
    assert app.test_client().get("/boom").data == b"broken"
    (failed,) = of(recorder, RequestFailed)
    assert failed.error == "status_500" and failed.operation == "/boom"


def test_a_refusal_from_inside_is_problem_json_with_retry_after(
    hub: EventHub, recorder: EventRecorder
) -> None:
    app, _ = make_app(policy_for(hub))
    r = app.test_client().get("/refused")
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/problem+json"
    assert json.loads(r.data)["reason"] == "breaker_open"
    assert 2 <= int(r.headers["retry-after"]) <= 4  # jittered upwards
    assert len(of(recorder, RequestFailed)) == 1
    assert of(recorder, RequestCompleted) == []


def _stream_environ() -> dict:
    return {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/stream",
        "SERVER_NAME": "x",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": None,
    }


def test_a_streaming_body_is_in_flight_until_read_to_its_end(
    hub: EventHub, recorder: EventRecorder
) -> None:
    app, _ = make_app(policy_for(hub))
    statuses: list[str] = []
    body = app.wsgi_app(
        _stream_environ(), lambda status, headers, exc_info=None: statuses.append(status)
    )
    assert statuses == ["200 OK"]
    chunks = iter(body)
    assert next(chunks) == b"a"
    assert of(recorder, RequestCompleted) == []  # still streaming
    assert list(chunks) == [b"b"]
    assert len(of(recorder, RequestCompleted)) == 1
    body.close()  # type: ignore[attr-defined]
    assert app.config["closed"] == ["stream"]
    body.close()  # type: ignore[attr-defined]  # settled once
    assert len(of(recorder, RequestCompleted)) == 1
    assert of(recorder, RequestAbandoned) == []


def test_a_body_closed_before_its_end_is_abandoned_not_a_success(
    hub: EventHub, recorder: EventRecorder
) -> None:
    app, _ = make_app(policy_for(hub))
    body = app.wsgi_app(_stream_environ(), lambda status, headers, exc_info=None: None)
    assert next(iter(body)) == b"a"
    body.close()  # type: ignore[attr-defined]  # the server stopped: its client went away
    assert app.config["closed"] == ["stream"]
    (abandoned,) = of(recorder, RequestAbandoned)
    assert abandoned.operation == "/stream"
    assert of(recorder, RequestCompleted) == []
    body.close()  # type: ignore[attr-defined]  # settled once
    assert len(of(recorder, RequestAbandoned)) == 1


def test_what_the_blocking_path_cannot_do_is_refused_at_construction(hub: EventHub) -> None:
    quota = Quota(10.0, 10, events=hub).for_edge(key=lambda c: "all", per_caller=False)
    app = Flask(__name__)
    with pytest.raises(TypeError, match="quota"):
        protect(app, EdgePolicy(quota=quota, events=hub))
    with pytest.raises(TypeError, match="slowed"):
        protect(app, EdgePolicy(slowed=SlowedRejections(), events=hub))


def test_an_asyncio_bulkhead_is_refused_with_a_clear_error(hub: EventHub) -> None:
    policy = EdgePolicy(bulkhead=Bulkhead("edge", FixedLimit(4), events=hub), events=hub)
    app, _ = make_app(policy)
    with pytest.raises(TypeError, match="ThreadBulkhead"):
        app.test_client().get("/items/1")


def test_repeated_headers_from_the_environ() -> None:
    get = environ_getter({"HTTP_BROWNOUT_BUDGET_MS": "100, 100", "HTTP_BROWNOUT_PRIORITY": "a,b"})
    assert get("brownout-budget-ms") == "100"
    assert sorted(get("brownout-priority")) == ["a", "b"]  # type: ignore[union-attr]
    assert get("idempotency-key") is None


def test_generic_wsgi_app_with_the_policys_own_routes(
    hub: EventHub, recorder: EventRecorder
) -> None:
    def app(environ: dict, start_response) -> list[bytes]:  # type: ignore[no-untyped-def]
        start_response("200 OK", [("content-type", "text/plain")])
        return [b"hi"]

    from werkzeug.test import Client

    policy = EdgePolicy(routes={"/users/{id}": Route()}, events=hub)
    client = Client(BrownoutMiddleware(app, policy))
    assert client.get("/users/7").data == b"hi"
    assert [e.operation for e in of(recorder, RequestOffered)] == ["/users/{id}"]


def test_a_full_thread_bulkhead_refuses_with_503_and_health_is_still_served(
    hub: EventHub, recorder: EventRecorder
) -> None:
    import threading

    from brownout import ThreadBulkhead

    bulkhead = ThreadBulkhead("edge", FixedLimit(1), reserve=0, events=hub)
    app = Flask(__name__)
    inside, release = threading.Event(), threading.Event()

    @app.get("/hold")
    def hold() -> str:
        inside.set()
        release.wait(10)
        return "done"

    @app.get("/health")
    def health() -> str:
        return "ok"

    protect(app, EdgePolicy(bulkhead=bulkhead, events=hub))
    held: list[int] = []
    t = threading.Thread(target=lambda: held.append(len(app.test_client().get("/hold").data)))
    t.start()
    try:
        assert inside.wait(10)
        r = app.test_client().get("/hold")
        assert r.status_code == 503
        assert r.headers["content-type"] == "application/problem+json"
        assert json.loads(r.data)["status"] == 503
        assert app.test_client().get("/health").text == "ok"
    finally:
        release.set()
        t.join(10)
    assert held == [4]  # "done", read to the end: the permit is released
    assert [e.operation for e in of(recorder, RequestShed)] == ["/hold"]
    assert bulkhead.in_flight == 0


class CountingThreadBulkhead(ThreadBulkhead):
    """Counts the admissions the express path made (`admit_uncontended`)."""

    express = 0

    def admit_uncontended(self, *args: Any) -> Any:
        permit = super().admit_uncontended(*args)
        if permit is not None:
            self.express += 1
        return permit


def test_plain_requests_take_the_express_path_and_count_as_the_general_one() -> None:
    from brownout import Stats, current

    hub = EventHub()
    stats = Stats()
    hub.subscribe(stats)
    bulkhead = CountingThreadBulkhead("api", FixedLimit(4), events=hub)
    app = Flask(__name__)
    seen: list[tuple[float | None, Priority, str]] = []

    @app.get("/items/<int:item_id>")
    def item(item_id: int) -> dict[str, int]:
        ctx = current()
        seen.append((ctx.remaining(), ctx.priority, ctx.operation))
        return {"id": item_id}

    protect(
        app,
        EdgePolicy(
            bulkhead=bulkhead, routes={"/items/<int:item_id>": Route(default=1.5)}, events=hub
        ),
    )
    client = app.test_client()
    for i in range(3):
        assert client.get(f"/items/{i}").json == {"id": i}
    for i in range(3):  # a priority claim sends a request through `begin`
        r = client.get(f"/items/{i}", headers={"brownout-priority": "sheddable"})
        assert r.json == {"id": i}  # (read: the body holds its permit until then)
    assert bulkhead.express == 3
    remaining, priority, operation = seen[0]
    assert remaining is not None and 1.0 < remaining <= 1.5  # the route default
    assert priority is Priority.CRITICAL and operation == "/items/<int:item_id>"
    assert [s[1] for s in seen] == [Priority.CRITICAL] * 6  # untrusted: the claim is ignored
    assert bulkhead.in_flight == 0
    for kind in ("offered", "admitted", "completed"):
        assert stats.count(kind, operation="/items/<int:item_id>") == 6, kind
    assert stats.count("failed") == 0


def test_a_contended_or_nested_request_leaves_the_express_path() -> None:
    from brownout import deadline

    bulkhead = CountingThreadBulkhead("api", FixedLimit(4), events=EventHub())
    app = Flask(__name__)
    remaining: list[float | None] = []

    @app.get("/x")
    def x() -> str:
        from brownout import current

        remaining.append(current().remaining())
        return "x"

    protect(app, EdgePolicy(bulkhead=bulkhead, events=bulkhead._events))
    client = app.test_client()
    with deadline(0.5):  # inside another request's context: its deadline is the bound
        assert client.get("/x").text == "x"
    assert bulkhead.express == 0
    assert remaining[0] is not None and remaining[0] <= 0.5
    bulkhead.force_full()
    assert client.get("/x").status_code == 503
    bulkhead.force_full(False)
    assert bulkhead.express == 0 and bulkhead.in_flight == 0
    assert client.get("/x").text == "x"
    assert bulkhead.express == 1 and bulkhead.in_flight == 0
