"""`brownout top`: parsing the text format and rendering totals and rates (O1, O2, O5)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from brownout import Priority, Reason, Stats
from brownout.events import BreakerStateChanged, RequestCompleted, RequestOffered, RequestShed
from brownout.export._top import MAX_SCRAPE_BYTES, ScrapeError, _quantile, fetch, parse, render
from brownout.export._top import main as top_main
from brownout.export.prometheus import register


def req(cls, **kw):
    return cls(
        at=0.0,
        source="api",
        operation="/search",
        priority=Priority.CRITICAL,
        caller=kw.pop("caller", "alice"),
        **kw,
    )


def text_of(renderable) -> str:
    console = Console(width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_render_totals_then_rates():
    stats = Stats()
    registry = CollectorRegistry()
    register(stats, registry)
    stats.watch_gauge("in_flight", {"source": "api"}, lambda: 7)
    for _ in range(10):
        stats.emit(req(RequestOffered, remaining=1.0))
        stats.emit(req(RequestCompleted, latency=0.02, useful=True))
    stats.emit(
        req(
            RequestShed,
            caller="mallory",
            reason=Reason.QUEUE_FULL,
            remaining=1.0,
            queue_wait=0.0,
            false_positive=True,
        )
    )
    stats.emit(BreakerStateChanged(at=0.0, source="db", old="closed", new="open"))
    first = parse(generate_latest(registry).decode(), at=100.0)
    out = text_of(render(first, title="svc"))
    assert "totals since start" in out
    assert "/search" in out
    assert "mallory" in out
    assert "queue_full" in out
    assert "FALSE-POSITIVE SHEDDING: 1" in out
    assert "breakers open: db" in out
    assert "7" in out

    for _ in range(20):
        stats.emit(req(RequestOffered, remaining=1.0))
    second = parse(generate_latest(registry).decode(), at=102.0)
    out = text_of(render(second, first))
    assert "rates per second" in out
    assert " 10.0 " in out  # 20 offered in 2 s


def test_quantile_matches_prometheus_interpolation():
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert _quantile(buckets, 0.5) == 0.1
    assert abs(_quantile(buckets, 0.75) - 0.15) < 1e-9
    assert _quantile({float("inf"): 0.0}, 0.5) != _quantile({float("inf"): 0.0}, 0.5)  # NaN


@pytest.fixture
def junk_server() -> Iterator[str]:
    """A real loopback HTTP server answering every path with a page that is not metrics."""
    pages = {
        "/html": b"<html><body>not metrics</body></html>",
        "/latin1": b"\xff\xfe metric 1",
        "/huge": b"# " + b"x" * (MAX_SCRAPE_BYTES + 10),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("path", "says"),
    [("/html", "not Prometheus text"), ("/latin1", "not Prometheus text"), ("/huge", "MiB")],
)
def test_top_reports_a_page_that_is_not_metrics_instead_of_a_traceback(
    junk_server: str, path: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ScrapeError, match=says):
        fetch(junk_server + path, timeout=10)
    assert top_main(["--once", "--timeout", "10", junk_server + path]) == 2
    err = capsys.readouterr().err
    assert "brownout top: cannot read" in err and says in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--interval", "0"],
        ["--interval", "-1"],
        ["--interval", "nan"],
        ["--timeout", "nan"],
        ["--timeout", "-1"],
        ["--timeout", "0"],
    ],
)
def test_top_refuses_absurd_intervals_and_timeouts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # These used to end in a ValueError traceback from the socket (timeout) or scrape the
    # service in a busy loop (interval 0).
    with pytest.raises(SystemExit) as exit_info:
        top_main([*argv, "http://127.0.0.1:1/metrics"])
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_top_refuses_a_url_that_is_not_http(capsys: pytest.CaptureFixture[str]) -> None:
    assert top_main(["--once", "notaurl"]) == 2
    assert top_main(["--once", "file:///etc/passwd"]) == 2
    assert "not an http://" in capsys.readouterr().err
