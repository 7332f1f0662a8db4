"""`brownout top`: window rates and percentiles from recorded scrapes (timestamps injected, no
sleeping), failed scrapes that keep the last frame, 80-column layout, and what it imports."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from brownout import Priority, Reason, Stats
from brownout.events import BreakerStateChanged, RequestCompleted, RequestOffered, RequestShed
from brownout.export._top import (
    MAX_SCRAPE_BYTES,
    ScrapeError,
    Window,
    _quantile,
    fetch,
    increase,
    parse,
    render,
    run,
)
from brownout.export._top import main as top_main
from brownout.export.prometheus import register


def req(cls, operation="/search", source="api", **kw):
    return cls(
        at=0.0,
        source=source,
        operation=operation,
        priority=Priority.CRITICAL,
        caller=kw.pop("caller", "alice"),
        **kw,
    )


def text_of(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True)
    console.print(renderable)
    return console.export_text()


class Service:
    """A real `Stats` behind a real prometheus_client registry: scrape texts to replay."""

    def __init__(self) -> None:
        self.stats = Stats()
        self.registry = CollectorRegistry()
        register(self.stats, self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def scrape(self, at: float):
        return parse(self.text(), at=at)


def test_warming_up_shows_no_lifetime_numbers_then_rates_over_the_window():
    svc = Service()
    svc.stats.watch_gauge("in_flight", {"source": "api"}, lambda: 7)
    for _ in range(1000):  # lifetime traffic before top started: never shown as a figure
        svc.stats.emit(req(RequestOffered, remaining=1.0))
    svc.stats.emit(BreakerStateChanged(at=0.0, source="db", old="closed", new="open"))
    first = svc.scrape(100.0)
    out = text_of(render(first, title="svc"))
    assert "warming up" in out
    assert "1000" not in out
    assert "Work per second" not in out
    assert "breakers open: db" in out  # gauges are now, not lifetime
    assert " 7 " in out

    for _ in range(20):
        svc.stats.emit(req(RequestOffered, remaining=1.0))
    svc.stats.emit(
        req(
            RequestShed,
            caller="mallory",
            reason=Reason.QUEUE_FULL,
            remaining=1.0,
            queue_wait=0.0,
            false_positive=True,
        )
    )
    second = svc.scrape(102.0)
    out = text_of(render(second, first))
    assert "over the last 2.0 s" in out
    assert " 10.0 " in out  # 20 offered in 2 s, not 1020
    assert "mallory" in out and "queue_full" in out
    assert " 0.5 " in out  # one shed in 2 s
    assert "FALSE-POSITIVE SHEDDING: 1 in the window" in out


BEFORE = """\
# TYPE brownout_success_latency_seconds histogram
brownout_success_latency_seconds_bucket{operation="/a",le="0.1"} 1000.0
brownout_success_latency_seconds_bucket{operation="/a",le="0.2"} 1000.0
brownout_success_latency_seconds_bucket{operation="/a",le="0.4"} 1000.0
brownout_success_latency_seconds_bucket{operation="/a",le="+Inf"} 1000.0
brownout_success_latency_seconds_count{operation="/a"} 1000.0
brownout_success_latency_seconds_sum{operation="/a"} 50.0
# TYPE brownout_requests_offered_total counter
brownout_requests_offered_total{source="api",operation="/a"} 500.0
# TYPE brownout_in_flight_requests gauge
brownout_in_flight_requests{source="api"} 3.0
"""
AFTER = """\
# TYPE brownout_success_latency_seconds histogram
brownout_success_latency_seconds_bucket{operation="/a",le="0.1"} 1000.0
brownout_success_latency_seconds_bucket{operation="/a",le="0.2"} 1050.0
brownout_success_latency_seconds_bucket{operation="/a",le="0.4"} 1100.0
brownout_success_latency_seconds_bucket{operation="/a",le="+Inf"} 1100.0
brownout_success_latency_seconds_count{operation="/a"} 1100.0
brownout_success_latency_seconds_sum{operation="/a"} 70.0
# TYPE brownout_requests_offered_total counter
brownout_requests_offered_total{source="api",operation="/a"} 540.0
# TYPE brownout_in_flight_requests gauge
brownout_in_flight_requests{source="api"} 9.0
"""


def test_percentiles_come_from_bucket_increases_in_the_window():
    before, after = parse(BEFORE, at=0.0), parse(AFTER, at=4.0)
    delta = increase(after, before)
    buckets = {
        float(le): n
        for (le,), n in delta.sum("brownout_success_latency_seconds_bucket", ("le",)).items()
    }
    assert buckets == {0.1: 0.0, 0.2: 50.0, 0.4: 100.0, math.inf: 100.0}
    # the window's 100 successes: 50 in (0.1, 0.2], 50 in (0.2, 0.4]; lifetime p50 was < 0.1
    assert _quantile(buckets, 0.5) == pytest.approx(0.2)
    assert _quantile(buckets, 0.99) == pytest.approx(0.2 + 0.2 * 49 / 50)
    assert ("brownout_in_flight_requests", (("source", "api"),)) not in delta.samples
    out = text_of(render(after, before))
    assert "200.0" in out and "396.0" in out  # p50 and p99 in ms
    assert " 10.0 " in out  # 40 offered in 4 s
    assert " 9 " in out  # the gauge is the newest scrape's


def test_a_counter_that_went_down_was_reset_and_counts_from_zero():
    before, after = parse(AFTER, at=0.0), parse(BEFORE.replace("500.0", "6.0"), at=2.0)
    delta = increase(after, before)
    offered = delta.total("brownout_requests_offered_total")
    assert offered == 6.0  # the restarted process offered 6, not -534
    # every bucket of a reset histogram counts from zero, so they stay cumulative
    buckets = delta.sum("brownout_success_latency_seconds_bucket", ("le",))
    assert buckets[("0.1",)] == 1000.0 and buckets[("+Inf",)] == 1000.0
    assert " 3.0 " in text_of(render(after, before))


def test_quantile_matches_prometheus_interpolation():
    buckets = {0.1: 50.0, 0.2: 100.0, math.inf: 100.0}
    assert _quantile(buckets, 0.5) == 0.1
    assert abs(_quantile(buckets, 0.75) - 0.15) < 1e-9
    assert math.isnan(_quantile({math.inf: 0.0}, 0.5))
    assert math.isnan(_quantile({0.1: 3.0, math.inf: 0.0}, 0.5))
    assert _quantile({0.1: 1.0, 0.2: 5.0, math.inf: 5.0}, 0.99) == pytest.approx(0.19875)
    assert _quantile({0.1: 10.0, 0.2: 10.0, math.inf: 20.0}, 0.9) == 0.2  # +Inf: highest bound
    # a bucket below the one before it (a scrape mid-update) is raised, as Prometheus does
    assert _quantile({0.1: 10.0, 0.2: 4.0, math.inf: 10.0}, 0.5) == pytest.approx(0.05)


def test_the_window_compares_the_newest_scrape_with_the_oldest_inside_it():
    w = Window(10.0)
    assert w.oldest is None and w.newest is None
    for at in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0):
        w.add(parse("", at=at))
    assert w.newest is not None and w.newest.at == 14.0
    assert w.oldest is not None and w.oldest.at == 4.0
    # scrapes failed for 30 s: only the newest is inside, the previous one stays the baseline
    w.add(parse("", at=44.0))
    assert w.oldest.at == 14.0 and len(w) == 2
    w.add(parse("", at=46.0))
    assert w.oldest.at == 44.0
    with pytest.raises(ValueError, match="oldest first"):
        w.add(parse("", at=1.0))


def test_the_window_is_bounded():
    w = Window(3600.0, max_scrapes=5)
    for at in range(100):
        w.add(parse("", at=float(at)))
    assert len(w) == 5 and w.oldest is not None and w.oldest.at == 95.0
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            Window(bad)
    with pytest.raises(ValueError):
        Window(1.0, max_scrapes=1)


def busy_service() -> tuple[Service, Service]:
    """Two scrapes of a service with long labels, many sources and every table filled."""
    svc = Service()
    sources = ("api", "search-backend-primary", "recommendations")
    for i, source in enumerate(sources):
        svc.stats.watch_gauge("in_flight", {"source": source}, lambda i=i: 10 * i)
        svc.stats.watch_gauge("limit", {"source": source}, lambda: 64)
        svc.stats.watch_gauge("queue_depth", {"source": source}, lambda: 3)
        svc.stats.watch_gauge("queue_oldest_age", {"source": source}, lambda: 0.125)
    before = svc.scrape(0.0)
    for source in sources:
        for op in ("/search", "/v1/catalogue/items/{item_id}/recommendations"):
            for _ in range(123):
                svc.stats.emit(req(RequestOffered, op, source, remaining=1.0))
                svc.stats.emit(req(RequestCompleted, op, source, latency=0.02, useful=True))
            svc.stats.emit(
                req(
                    RequestShed,
                    op,
                    source,
                    caller="a-very-long-tenant-name-for-the-batch-exporter",
                    reason=Reason.QUEUE_FULL,
                    remaining=1.0,
                    queue_wait=0.0,
                )
            )
    return before, svc.scrape(3.0)


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_frame_fits_the_terminal_without_cutting_a_header_or_label(width: int):
    before, after = busy_service()
    url = "http://127.0.0.1:8000/metrics"
    warning = f"WARNING: cannot read {url}: [Errno 111] Connection refused; showing the last"
    frame = render(after, before, title=f"brownout top {url}", warning=warning, width=width)
    out = text_of(frame, width)
    assert "…" not in out and "..." not in out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    long_names = width >= 120
    for header in (
        *(("offered", "admitted", "abandoned") if long_names else ("offer", "admit", "aband")),
        *(("in flight", "oldest age s", "retry tokens") if long_names else ("infl", "age s")),
        "p50 ms",
        "p99 ms",
        "source",
        "operation",
        "search-backend-primary",
    ):
        assert any(header in line for line in lines), (header, out)
    # a long label folds onto the next lines of its cell: the first cells, joined, hold it whole
    first_cells = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert "/v1/catalogue/items/{item_id}/recommendations" in first_cells
    assert "Connection refused" in " ".join(out.split())
    if width == 80:
        assert "Work per second (2/2)" in out  # split into sections rather than squeezed


# -- loopback servers ---------------------------------------------------------------------------


class Pages:
    """A real loopback HTTP server whose answers the test scripts, one per request."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes]] = []
        self.default: tuple[int, bytes] = (200, b"")
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = pages.answers.pop(0) if pages.answers else pages.default
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages() -> Iterator[Pages]:
    p = Pages()
    try:
        yield p
    finally:
        p.close()


class Clock:
    """Virtual time for `run`: sleeping moves it on at once."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_a_failed_scrape_keeps_the_last_frame_under_a_warning(pages: Pages):
    svc = Service()
    svc.stats.emit(req(RequestOffered, remaining=1.0))
    first = svc.text().encode()
    for _ in range(8):
        svc.stats.emit(req(RequestOffered, remaining=1.0))
    second = svc.text().encode()
    pages.answers = [(200, first), (200, second), (503, b"overloaded"), (200, b"<html>garbage")]
    clock = Clock()
    console = Console(width=80, record=True, force_terminal=False)
    status = run(pages.url, interval=2.0, count=4, console=console, clock=clock, sleep=clock.sleep)
    frames = console.export_text().split("brownout top http")[1:]
    assert len(frames) == 4
    assert "warming up" in frames[0]
    assert " 4.0 " in frames[1] and "WARNING" not in frames[1]  # 8 offered in 2 s
    for frame, why, age in ((frames[2], "HTTP 503", "2.0"), (frames[3], "not Prometheus", "4.0")):
        assert "WARNING: cannot read" in frame and why in frame, frame
        assert f"from {age} s ago" in frame
        assert " 4.0 " in frame and "/search" in frame  # the last good figures stay
    assert status == 3  # the last scrape failed


def test_a_refused_connection_and_a_timeout_keep_the_last_frame(pages: Pages):
    svc = Service()
    svc.stats.emit(req(RequestOffered, remaining=1.0))
    pages.answers = [(200, svc.text().encode())] * 2
    clock = Clock()
    console = Console(width=80, record=True)
    calls: list[float] = []

    def scrape(url: str, timeout: float, at: float):
        calls.append(timeout)
        if len(calls) == 3:
            return fetch("http://127.0.0.1:9/metrics", timeout, at=at)  # nothing listens
        return fetch(url, timeout, at=at)

    pages.default = (200, b"")  # (an empty page is valid: no metrics)
    status = run(
        pages.url,
        interval=0.5,
        count=3,
        console=console,
        clock=clock,
        sleep=clock.sleep,
        scrape=scrape,
    )
    out = console.export_text()
    assert status == 3
    assert "WARNING: cannot read" in out and "refused" in out.lower()
    assert calls == [0.4, 0.4, 0.4]  # the timeout defaults under the interval


def test_the_first_scrape_failing_exits_3_with_the_reason(capsys: pytest.CaptureFixture[str]):
    assert run("http://127.0.0.1:9/metrics", interval=0.5) == 3
    err = capsys.readouterr().err
    assert err.startswith("brownout top: cannot read http://127.0.0.1:9/metrics")


def test_once_takes_two_scrapes_and_prints_one_frame(pages: Pages):
    svc = Service()
    first = svc.text().encode()
    for _ in range(6):
        svc.stats.emit(req(RequestOffered, remaining=1.0))
    pages.answers = [(200, first), (200, svc.text().encode())]
    clock = Clock()
    console = Console(width=80, record=True)
    assert run(pages.url, once=True, console=console, clock=clock, sleep=clock.sleep) == 0
    out = console.export_text()
    assert out.count("brownout top http") == 1 and " 3.0 " in out and "warming" not in out


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
    assert top_main(["--once", "--interval", "20", "--timeout", "10", junk_server + path]) == 3
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
        ["--timeout", "2"],  # not shorter than the interval
        ["--window", "0"],
        ["--window", "inf"],
        ["--count", "0"],
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


@pytest.mark.parametrize("url", ["notaurl", "file:///etc/passwd"])
def test_top_refuses_a_url_that_is_not_http(url: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        top_main(["--once", url])
    assert exit_info.value.code == 2
    assert "not an http://" in capsys.readouterr().err


def test_top_once_imports_nothing_from_the_lab(pages: Pages) -> None:
    svc = Service()
    pages.default = (200, svc.text().encode())
    code = (
        "import sys\n"
        "from brownout._cli import main\n"
        f"status = main(['top', '--once', '--interval', '0.2', {pages.url!r}])\n"
        "lab = {'matplotlib', 'uvicorn', 'uvloop', 'httptools', 'aiohttp', 'starlette'}\n"
        "loaded = sorted(lab & {m.split('.')[0] for m in sys.modules})\n"
        "lab_modules = sorted(m for m in sys.modules if m.startswith('brownout._lab'))\n"
        "print('LOADED', loaded, lab_modules, status)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "LOADED [] [] 0" in r.stdout, r.stdout + r.stderr
    assert "rich" in sys.modules  # (this process is not the one under test)
