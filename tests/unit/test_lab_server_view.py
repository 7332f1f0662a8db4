"""The server's view: the Prometheus text parser, the figures read at a step's edges, and
where server and client are said to disagree (virtual data, plus a stdlib HTTP server on
loopback for the scrape's failure notes)."""

from __future__ import annotations

import http.server
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from brownout._lab.ci_report import steps_csv
from brownout._lab.scenario_file import ScenarioFileError, parse_scenario
from brownout._lab.server_view import (
    MetricsFormatError,
    ScrapeError,
    ServerWatch,
    add_server_view,
    agreement,
    compare_step,
    figures_of,
    parse_metrics,
    resolve_metrics_url,
    scrape,
    server_rows,
    step_figures,
)
from brownout._lab.verdict import evaluate

PAGE = """\
# HELP brownout_requests_offered_total Requests that arrived.
# TYPE brownout_requests_offered_total counter
brownout_requests_offered_total{operation="/a",priority="critical",source="front"} 30.0
brownout_requests_offered_total{operation="/b",priority="sheddable",source="front"} 12
brownout_requests_offered_total{operation="/out",source="dep"} 7
brownout_retries_total{cause="http_503",source="dep"} 6
brownout_requests_shed_total{reason="queue_full",source="front"} 5.0
brownout_requests_shed_total{reason="deadline_expired",source="front"} 2
brownout_requests_expired_total{stage="queue",source="front"} 3 1700000000000
brownout_queue_depth_requests{source="front"} 4
brownout_success_latency_seconds_bucket{le="+Inf",operation="/a",priority="critical"} 9
odd_metric{path="a \\"quoted\\" \\\\ back\\nslash"} NaN
# EOF
"""


def test_the_parser_reads_labels_escapes_and_special_values() -> None:
    samples = parse_metrics(PAGE)
    assert len(samples) == 10
    assert samples[0].name == "brownout_requests_offered_total"
    assert samples[0].label("operation") == "/a" and samples[0].value == 30.0
    assert samples[6].value == 3  # the timestamp is read and dropped
    assert samples[8].label("le") == "+Inf"
    odd = samples[-1]
    assert odd.label("path") == 'a "quoted" \\ back\nslash'
    assert math.isnan(odd.value)
    assert parse_metrics('x{a="1",} +Inf\ny -Inf\n')[0].value == math.inf


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("metric{a=1} 2", "malformed labels"),
        ('metric{a="1" b="2"} 2', "malformed labels"),
        ('metric{a="1",a="2"} 2', "twice"),
        ('metric{a="\\x"} 2', "bad escape"),
        ("metric twelve", "not a number"),
        ("3metric 1", "not a sample"),
        ("<html>oops</html>", "not a sample"),
        ("# TYPE broken", "malformed # TYPE"),
    ],
)
def test_the_parser_names_the_bad_line(text: str, problem: str) -> None:
    with pytest.raises(MetricsFormatError, match=problem) as e:
        parse_metrics("ok_metric 1\n" + text)
    assert "line 2" in str(e.value)


def test_figures_sum_the_labels_and_filter_a_source() -> None:
    everything = figures_of(parse_metrics(PAGE))
    assert everything["offered"] == 49
    assert everything["shed.queue_full"] == 5 and everything["shed.deadline_expired"] == 2
    assert everything["expired.queue"] == 3 and everything["queue_depth"] == 4
    front = figures_of(parse_metrics(PAGE), "front")
    assert front["offered"] == 42 and front["retried"] == 6  # retries are outbound


def _points(*rows: tuple[float, dict[str, float]]) -> list[tuple[float, dict[str, float]]]:
    return list(rows)


def test_counters_are_interpolated_at_the_window_edges() -> None:
    points = _points(
        (10.0, {"offered": 0, "shed.queue_full": 0, "queue_depth": 1}),
        (11.0, {"offered": 100, "shed.queue_full": 40, "queue_depth": 9}),
        (12.0, {"offered": 200, "shed.queue_full": 80, "expired.queue": 10, "queue_depth": 3}),
    )
    f = step_figures(points, 10.5, 11.5)
    assert f is not None
    assert f["offered"] == 100 and f["shed"] == {"queue_full": 40}
    assert f["expired"] == {"queue": 5}  # absent before: counted from zero
    assert f["queue_depth_max"] == 9  # only the scrape inside the window
    assert f["edge_s"] == 0.5
    # Outside the scrapes: the nearest one, and how far it was.
    tail = step_figures(points, 11.0, 13.0)
    assert tail is not None and tail["offered"] == 100 and tail["edge_s"] == 1.0
    assert step_figures([], 0.0, 1.0) is None


def test_a_counter_that_went_down_counts_from_zero() -> None:
    points = _points((0.0, {"offered": 500}), (1.0, {"offered": 30}))
    f = step_figures(points, 0.0, 1.0)
    assert f is not None and f["offered"] == 30


@pytest.mark.parametrize(
    ("server", "client", "agrees"),
    [
        (100, 104, True),  # within 5 requests
        (1000, 1040, True),  # within 5%
        (1000, 1100, False),
        (10, 16, False),  # 6 apart: more than 5 and more than 5%
        (0, 5, True),
    ],
)
def test_agreement_needs_both_margins_exceeded(server: int, client: int, agrees: bool) -> None:
    assert agreement(server, client) is agrees


def _step(server: dict[str, Any] | None, **steady: Any) -> dict[str, Any]:
    base = {"sent": 1000, "r429": 0, "r503": 0, "r504": 0, "shed_reasons": {}}
    return {
        "label": "4x",
        "load": 4.0,
        "valid": True,
        "host_bound": [],
        "start": 1.0,
        "settle": 0.5,
        "duration": 2.0,
        "steady": base | steady,
        "retries": {"sent": 20, "r503": 10, "r429": 0, "r504": 0, "shed_reasons": {"x": 10}},
        "classes": {},
        "server": server,
    }


def _server(offered: int, shed: dict[str, int], expired: dict[str, int]) -> dict[str, Any]:
    return {
        "offered": offered,
        "admitted": offered - sum(shed.values()),
        "completed": 0,
        "completed_late": 0,
        "failed": 0,
        "retried": 0,
        "budget_exhausted": 0,
        "shed_retry": 0,
        "shed": shed,
        "expired": expired,
        "queue_depth_max": None,
        "edge_s": 0.5,
    }


def test_compare_step_sets_the_server_beside_the_client() -> None:
    server = _server(1020, {"queue_full": 300, "deadline_expired": 40}, {"queue": 60})
    step = _step(server, r503=290, r504=100, shed_reasons={"queue_full": 290})
    rows = {r["figure"]: r for r in compare_step(step)}
    # Retries count on both sides: the client sent 1000 originals and 20 retries.
    assert rows["offered"] == {"figure": "offered", "server": 1020, "client": 1020, "agrees": True}
    assert (rows["refused"]["server"], rows["refused"]["client"]) == (300, 300)
    # 504s: expiries plus the refusals answered 504 (deadline_expired).
    assert (rows["expired"]["server"], rows["expired"]["client"]) == (100, 100)
    assert compare_step(_step(None)) == []


def _lab(step: dict[str, Any], invariants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "calibration": {"capacity": 100.0},
        "settings": {"deadline": 1.0},
        "scenario_file": {"endpoints": [], "invariants": invariants},
        "runs": [
            {
                "configuration": "target",
                "scenario": "s",
                "steps": [step],
                "server_view": {"note": None, "failures": 0, "scrapes": 9},
            }
        ],
    }


def test_server_agrees_is_an_opt_in_failing_invariant() -> None:
    wrong = _step(_server(700, {}, {}))  # the client sent 1020: 300 never reached brownout
    invariant = {"check": "server_agrees", "threshold": 0.05, "steps": [], "traffic_class": None}
    checks = evaluate(_lab(wrong, [invariant]))
    assert [(c["check"].split(" within")[0], c["passed"]) for c in checks] == [
        ("server agrees on offered", False),
        ("server agrees on refused", False),  # the client's retries met 10 503s
        ("server agrees on expired", True),
    ]
    assert evaluate(_lab(wrong, [])) == []  # without it, only a flag in the table
    row = server_rows(_lab(wrong, []), "s")[0]
    assert row[-1] == "NO: offered, refused (an edge read 0.5 s from a scrape)"
    unread = _step(None)
    (check,) = evaluate(_lab(unread, [invariant]))
    assert check["check"] == "server's view read" and not check["passed"]


def test_steps_csv_carries_the_server_columns() -> None:
    step = _step(_server(1020, {}, {}))
    step.update(server_agrees=True)
    step["steady"].update(offered_per_s=500.0, goodput_per_s=400.0, refused=0, expired=0)
    step["steady"].update(success_p50_ms=1.0, success_p99_ms=2.0, refusal_p50_ms=None)
    header, row = steps_csv(_lab(step, [])).splitlines()
    assert header.endswith("server_offered,server_refused,server_expired,server_agrees")
    assert row.endswith("1020,0,0,true")


def test_add_server_view_reads_each_steps_steady_window() -> None:
    watch = ServerWatch("http://127.0.0.1:9/metrics")
    # The plan started at monotonic 100; the step's steady window is 101.5 .. 103.
    watch.points = [(101.0, {"offered": 0}), (102.0, {"offered": 100}), (104.0, {"offered": 300})]
    run: dict[str, Any] = {"steps": [_step(None)]}
    add_server_view(run, watch, 100.0)
    assert run["steps"][0]["server"]["offered"] == 200 - 50
    assert run["steps"][0]["server_agrees"] is False  # the client sent 1020
    assert run["server_view"] == {
        "url": "http://127.0.0.1:9/metrics",
        "source": None,
        "scrapes": 3,
        "failures": 0,
        "note": None,
    }


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b"x 1\n"
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_bad_endpoint_is_a_typed_note(metrics_server: tuple[str, type[_Handler]]) -> None:
    url, handler = metrics_server
    assert scrape(url)[0].name == "x"
    handler.body = b"<html>not metrics</html>"
    with pytest.raises(ScrapeError) as e:
        scrape(url)
    assert e.value.kind == "format" and "line 1" in str(e.value)
    handler.status = 404
    with pytest.raises(ScrapeError) as e:
        scrape(url)
    assert e.value.kind == "http" and "404" in str(e.value)
    watch = ServerWatch(url, period=0.05)
    with watch.running():
        pass
    assert watch.failures >= 1 and not watch.points
    note = watch.summary()["note"]
    assert note.startswith("no server view: http:") and "404" in note


def test_an_unreachable_endpoint_fails_fast() -> None:
    with pytest.raises(ScrapeError) as e:
        scrape("http://127.0.0.1:9/metrics", timeout=0.5)  # the discard port: refused
    assert e.value.kind == "unreachable"


def test_metrics_url_paths_resolve_on_the_base_url() -> None:
    base = "http://127.0.0.1:8000/api"
    assert resolve_metrics_url("/metrics", base) == "http://127.0.0.1:8000/metrics"
    assert resolve_metrics_url("http://127.0.0.1:9100/m", base) == "http://127.0.0.1:9100/m"
    with pytest.raises(ValueError, match="path or an http"):
        resolve_metrics_url("metrics", base)


SCENARIO = """
version = 1
name = "s"
[[endpoints]]
name = "e"
path = "/"
[[steps]]
load = 1
"""


def test_the_scenario_file_declares_the_server() -> None:
    sf = parse_scenario(SCENARIO + '[server]\nmetrics_url = "/metrics"\nsource = "front"\n')
    assert (sf.server.metrics_url, sf.server.source) == ("/metrics", "front")
    assert parse_scenario(SCENARIO).server.metrics_url is None
    with pytest.raises(ScenarioFileError, match=r"server\.metrics_url: must be a path"):
        parse_scenario(SCENARIO + '[server]\nmetrics_url = "ftp://x/m"\n')
    with pytest.raises(ScenarioFileError, match=r"server\.port: unknown field"):
        parse_scenario(SCENARIO + "[server]\nport = 1\n")
    agrees = SCENARIO + '[[invariants]]\ncheck = "server_agrees"\nmax = 0.1\n'
    assert parse_scenario(agrees).invariants[0].threshold == 0.1
    with pytest.raises(ScenarioFileError, match="takes max"):
        parse_scenario(SCENARIO + '[[invariants]]\ncheck = "server_agrees"\nmin = 0.1\n')


def test_the_cli_refuses_a_metrics_url_it_cannot_use(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from brownout._cli import EXIT_USAGE, lab_main

    assert lab_main(["--metrics-url", "/metrics"]) == EXIT_USAGE
    assert "--metrics-url goes with --target" in capsys.readouterr().out
    target = ["--target", "http://127.0.0.1:9/x", "--metrics-url", "metrics"]
    assert lab_main(target) == EXIT_USAGE
    assert "must be a path or an http" in capsys.readouterr().out
    scenario = tmp_path / "s.toml"
    scenario.write_text('base_url = "http://127.0.0.1:9"' + SCENARIO)
    assert lab_main(["--scenario", str(scenario), "--metrics-url", "ftp://x"]) == EXIT_USAGE
    assert "must be a path or an http" in capsys.readouterr().out


def test_the_watch_scrapes_at_the_edges_it_is_told(
    metrics_server: tuple[str, type[_Handler]],
) -> None:
    url, _ = metrics_server
    watch = ServerWatch(url, period=30.0)  # periodic scrapes out of the way
    with watch.running():
        now = time.monotonic()
        watch.expect(now + 0.3, now + 0.2, now - 1.0)
        time.sleep(0.6)
    times = [t - now for t, _ in watch.points]
    # The first periodic scrape and the past edge (one scrape if due together), both edges,
    # and one at the end; no second periodic one.
    assert 4 <= len(times) <= 5, times
    assert any(0.19 <= t <= 0.3 for t in times) and any(0.29 <= t <= 0.4 for t in times), times


def test_a_silent_endpoint_times_out_instead_of_hanging() -> None:
    import socket

    with socket.socket() as silent:  # listening, never answering: connects, then nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        started = time.monotonic()
        with pytest.raises(ScrapeError) as e:
            scrape(f"http://127.0.0.1:{silent.getsockname()[1]}/metrics", timeout=0.3)
    assert e.value.kind == "unreachable" and "timed out" in str(e.value)
    assert time.monotonic() - started < 2.0
