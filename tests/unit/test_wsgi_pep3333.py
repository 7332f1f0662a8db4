"""PEP 3333 through the WSGI edge, served by the standard library's own server handler
(`wsgiref.handlers.SimpleHandler`): one head per response, ``write()``, the body's ``close()``
on every path, ``wsgi.file_wrapper``, HEAD, and the permit settled exactly once whatever the
application does."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.handlers import SimpleHandler
from wsgiref.util import setup_testing_defaults

import pytest

from brownout import DeadlineExceeded, EdgePolicy, Route, ThreadBulkhead, current
from brownout.events import (
    EventHub,
    HandlerOverran,
    RequestAbandoned,
    RequestCompleted,
    RequestExpired,
    RequestFailed,
)
from brownout.integrations.wsgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.testing import EventRecorder

SHORT = 0.05

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class Stop(BaseException):
    """Not an `Exception`: what a worker's shutdown or a greenlet's timeout raises."""


@pytest.fixture
def hub() -> EventHub:
    return EventHub()


@pytest.fixture
def recorder(hub: EventHub) -> Iterator[EventRecorder]:
    with EventRecorder(hub) as rec:
        yield rec


@pytest.fixture
def bulkhead(hub: EventHub) -> ThreadBulkhead:
    return ThreadBulkhead("wsgi", FixedLimit(2), reserve=0, events=hub)


def guarded(app: App, hub: EventHub, bulkhead: ThreadBulkhead) -> BrownoutMiddleware:
    policy = EdgePolicy(routes={"/": Route(default=5.0, bulkhead=bulkhead)}, events=hub)
    return BrownoutMiddleware(app, policy)


def serve(app: Any, method: str = "GET") -> tuple[bytes, str]:
    """One request through wsgiref's server handler: the raw response and its error log."""
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": "/"}
    setup_testing_defaults(environ)
    out, err = io.BytesIO(), io.StringIO()
    handler = SimpleHandler(io.BytesIO(), out, err, environ, multithread=True)
    handler.run(app)
    return out.getvalue(), err.getvalue()


def settled(recorder: EventRecorder) -> list[object]:
    return [e for e in recorder.events if isinstance(e, RequestCompleted | RequestFailed)]


def test_write_then_a_returned_body_sends_one_head(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        write = start_response("200 OK", [("content-type", "text/plain")])
        write(b"written ")
        return [b"returned"]

    raw, err = serve(guarded(app, hub, bulkhead))
    assert err == ""
    assert raw.startswith(b"HTTP/1.0 200 OK")
    assert raw.endswith(b"written returned")
    assert bulkhead.in_flight == 0
    assert len(settled(recorder)) == 1


def test_a_base_exception_out_of_the_app_settles_and_leaves_no_context(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        raise Stop

    with pytest.raises(Stop):
        guarded(app, hub, bulkhead)({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, None)
    assert bulkhead.in_flight == 0  # its slot is free
    assert current().deadline is None  # the next request on this thread starts clean
    assert len(settled(recorder)) == 1


def test_an_exception_while_iterating_settles_once_as_failed_and_closes(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    closed: list[bool] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [])
        try:
            yield b"a"
            raise ValueError("broken mid-way")
        finally:
            closed.append(True)

    _, err = serve(guarded(app, hub, bulkhead))
    assert "broken mid-way" in err
    assert closed == [True]
    assert bulkhead.in_flight == 0
    assert [type(e) for e in settled(recorder)] == [RequestFailed]


def test_close_without_iteration_and_a_disconnect_mid_body_settle_once(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    closed: list[bool] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [])
        try:
            yield b"a"
            yield b"b"
        finally:
            closed.append(True)

    middleware = guarded(app, hub, bulkhead)
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/"}
    body = middleware(environ, lambda *a: None)
    body.close()  # type: ignore[attr-defined]  # the server gave up before iterating
    assert closed == []  # (a generator never started has no finally to run)
    assert bulkhead.in_flight == 0
    body = middleware(environ, lambda *a: None)
    assert next(iter(body)) == b"a"
    body.close()  # type: ignore[attr-defined]  # the client went away mid-body
    body.close()  # type: ignore[attr-defined]
    assert closed == [True]
    assert bulkhead.in_flight == 0
    # Both ended before the body was read: the client went away, not a success (O1).
    abandoned = [e for e in recorder.events if isinstance(e, RequestAbandoned)]
    assert len(abandoned) == 2 and settled(recorder) == []


def test_file_wrapper_and_head_are_served_and_settled(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    files: list[io.BytesIO] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        start_response("200 OK", [("content-length", "9")])
        f = io.BytesIO(b"from file")
        files.append(f)
        return environ["wsgi.file_wrapper"](f, 4)  # type: ignore[no-any-return]

    middleware = guarded(app, hub, bulkhead)
    raw, err = serve(middleware)
    assert err == ""
    assert raw.endswith(b"\r\n\r\nfrom file")
    raw, err = serve(middleware, "HEAD")
    assert err == ""
    assert b"200 OK" in raw
    assert all(f.closed for f in files)
    assert bulkhead.in_flight == 0
    assert len(settled(recorder)) == 2


def test_a_streamed_body_is_read_inside_the_request_context(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    seen: list[float | None] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("content-type", "text/plain")])
        for part in (b"a", b"b"):
            seen.append(current().remaining())  # code of the app, run as the server reads
            yield part

    raw, _ = serve(guarded(app, hub, bulkhead))
    assert raw.endswith(b"ab")
    assert len(seen) == 2 and all(r is not None and 0 < r <= 5.0 for r in seen)
    assert current().deadline is None  # and not left on the server's thread
    assert len(settled(recorder)) == 1


def test_a_handler_raising_after_its_deadline_once_its_response_started_overran(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        write = start_response("200 OK", [("content-type", "text/plain")])
        write(b"partial")  # the head is out: the answer can no longer be replaced
        time.sleep(SHORT * 2)
        raise DeadlineExceeded("a dependency found no time left")

    policy = EdgePolicy(routes={"/": Route(default=SHORT, bulkhead=bulkhead)}, events=hub)
    serve(BrownoutMiddleware(app, policy))
    (overran,) = [e for e in recorder.events if isinstance(e, HandlerOverran)]
    assert overran.overrun >= SHORT * 0.5
    assert [e.stage for e in recorder.events if isinstance(e, RequestExpired)] == ["running"]
    assert settled(recorder) == []
    assert bulkhead.in_flight == 0


def test_a_body_raising_after_its_deadline_overran(
    hub: EventHub, recorder: EventRecorder, bulkhead: ThreadBulkhead
) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("content-type", "text/plain")])
        yield b"a"
        time.sleep(SHORT * 2)
        raise RuntimeError("the stream broke, late")

    policy = EdgePolicy(routes={"/": Route(default=SHORT, bulkhead=bulkhead)}, events=hub)
    serve(BrownoutMiddleware(app, policy))
    assert len([e for e in recorder.events if isinstance(e, HandlerOverran)]) == 1
    assert len([e for e in recorder.events if isinstance(e, RequestExpired)]) == 1
    assert settled(recorder) == []
    assert bulkhead.in_flight == 0
