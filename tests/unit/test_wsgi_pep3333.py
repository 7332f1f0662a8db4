"""PEP 3333 through the WSGI edge, served by the standard library's own server handler
(`wsgiref.handlers.SimpleHandler`): one head per response, ``write()``, the body's ``close()``
on every path, ``wsgi.file_wrapper``, HEAD, and the permit settled exactly once whatever the
application does."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.handlers import SimpleHandler
from wsgiref.util import setup_testing_defaults

import pytest

from brownout import EdgePolicy, Route, ThreadBulkhead, current
from brownout.events import EventHub, RequestCompleted, RequestFailed
from brownout.integrations.wsgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.testing import EventRecorder

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
    assert len(settled(recorder)) == 2


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
