"""docs/gunicorn.md's gunicorn.conf.py files and app.py, run as they are on the page by real
gunicorn (gthread and sync workers) over loopback: a burst above a worker's threads is
refused 503 quickly while /health is answered; the adaptive limit stays within the threads
the bulkhead may hold; a scrape of either of two workers shows both workers' counts, and a worker
killed with SIGKILL keeps its counts (child_exit)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "gunicorn.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CAPACITY = 6  # the page's threads = 16: 8 kept spare, 2 for the queue
NAMED = """
import os
from app import app as inner


def app(environ, start_response):
    def named(status, headers, exc_info=None):
        return start_response(status, [*headers, ("x-pid", str(os.getpid()))], exc_info)

    return inner(environ, named)
"""


def block(first_line: str) -> str:
    found = [b for b in BLOCK.findall(PAGE.read_text()) if b.startswith(first_line + "\n")]
    assert len(found) == 1, first_line
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def total(text: str, name: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


Server = Callable[..., str]


@pytest.fixture
def gunicorn(tmp_path: Path) -> Iterator[Server]:
    procs: list[subprocess.Popen[bytes]] = []
    (tmp_path / "app.py").write_text(block("# app.py"))
    (tmp_path / "named.py").write_text(NAMED)
    (tmp_path / "gthread.conf.py").write_text(block("# gunicorn.conf.py"))
    (tmp_path / "sync.conf.py").write_text(block("# gunicorn.conf.py for sync workers"))

    def start(kind: str, workers: int) -> str:
        metrics = tmp_path / f"metrics-{len(procs)}"
        metrics.mkdir()
        port = free_port()
        env = {
            **os.environ,
            "PROMETHEUS_MULTIPROC_DIR": str(metrics),
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}",
        }
        args = ["-c", str(tmp_path / f"{kind}.conf.py"), "-b", f"127.0.0.1:{port}"]
        args += ["-w", str(workers), "--log-level", "warning", "named:app"]
        proc = subprocess.Popen([sys.executable, "-m", "gunicorn", *args], cwd=tmp_path, env=env)
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    return base
            except requests.RequestException:
                pass
            assert proc.poll() is None, "gunicorn exited"
            assert time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.2)

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(url: str) -> tuple[int, float, requests.Response]:
    t = time.monotonic()
    r = requests.get(url, timeout=30)  # its own connection: the kernel picks the worker
    return r.status_code, time.monotonic() - t, r


def limit_now(base: str) -> float:
    r = requests.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200
    return total(r.text, "brownout_concurrency_limit")


def test_gthread_refuses_a_burst_quickly_within_its_threads(gunicorn) -> None:
    base = gunicorn("gthread", 1)
    assert limit_now(base) == CAPACITY  # worker_bulkhead starts at what the threads may run
    limits: list[float] = []
    refused: list[tuple[float, requests.Response]] = []
    served = 0
    with ThreadPoolExecutor(60) as pool:
        for _ in range(8):  # bursts of 50 slow requests, far above 16 threads
            burst = [pool.submit(get, f"{base}/work?seconds=0.4") for _ in range(50)]
            time.sleep(0.1)
            health = [pool.submit(get, f"{base}/health") for _ in range(3)]
            for f in health:
                status, took, _ = f.result(timeout=60)
                assert status == 200
                assert took < 5.0, took  # a spare thread answers it; noisy host margin
            for f in burst:
                status, took, r = f.result(timeout=60)
                if status == 503:
                    refused.append((took, r))
                else:
                    assert status == 200, status
                    served += 1
            limits.append(limit_now(base))
            if len(refused) >= 60:
                break
    assert served > 0 and len(refused) >= 60, (served, len(refused))
    assert all(1 <= v <= CAPACITY for v in limits), limits
    for _, r in refused:
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["status"] == 503
        assert r.json()["reason"] in ("queue_full", "queue_timeout"), r.text
        assert int(r.headers.get("retry-after", "0")) >= 0  # sent when the policy estimates
    took = sorted(t for t, _ in refused)
    # A refusal does not wait for the work ahead of it (each slow request takes 0.4 s).
    assert took[len(took) // 2] < 0.4, took


def test_a_refusal_closes_its_keep_alive_connection_at_a_pace(gunicorn) -> None:
    # pre_request (the page's config) lets the middleware close a refused connection, so a
    # client pool that reuses it moves to whichever worker accepts its next connection.
    base = gunicorn("gthread", 1)
    with ThreadPoolExecutor(CAPACITY + 4) as pool:
        slow = [pool.submit(get, f"{base}/work?seconds=1.5") for _ in range(CAPACITY + 4)]
        time.sleep(0.5)  # the bulkhead and its queue are full
        closes: list[str] = []
        with requests.Session() as session:
            for _ in range(5):
                r = session.get(f"{base}/work?seconds=1.5", timeout=30)
                if r.status_code == 503:
                    closes.append(r.headers.get("connection", "keep-alive").lower())
        for f in slow:
            f.result(timeout=60)
    assert closes, "nothing was refused"
    assert closes[0] == "close", closes  # the first refusal is always within the pace


def test_sync_workers_serve_one_at_a_time_and_never_refuse_for_concurrency(gunicorn) -> None:
    base = gunicorn("sync", 2)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(get, [f"{base}/work?seconds=0.2"] * 8, timeout=60))
    assert [s for s, _, _ in results] == [200] * 8  # waited in the backlog, unseen
    deadline = time.monotonic() + 15
    while (seen := limit_now(base)) != 2:  # 1 per worker, summed once both have published
        assert seen <= 2 and time.monotonic() < deadline, seen
        time.sleep(0.5)


def workers_that_served(base: str, n: int) -> tuple[set[str], int]:
    """Send ``n`` requests, 8 at a time; the workers that answered 200, and how many did.

    A worker given more of the 8 than its limit and queue hold refuses the rest 503
    (``queue_full``, or ``queue_timeout`` past the queue's short bound: the kernel picks the
    worker, and a busy host slows each request): the bulkhead working, counted as offered
    and not admitted."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(get, [f"{base}/work"] * n, timeout=120))
    refused = [r for s, _, r in results if s != 200]
    for r in refused:
        assert r.status_code == 503, r.text
        assert r.json()["reason"] in ("queue_full", "queue_timeout"), r.text
    return {r.headers["x-pid"] for s, _, r in results if s == 200}, n - len(refused)


def scrapes_show(base: str, offered: int, admitted: int) -> set[str]:
    """Scrape on fresh connections until both workers answered; each must show the counts."""
    pids: set[str] = set()
    for _ in range(80):
        r = requests.get(f"{base}/metrics", timeout=10)
        assert r.status_code == 200
        pids.add(r.headers["x-pid"])
        assert total(r.text, "brownout_requests_offered_total") == offered, r.headers["x-pid"]
        assert total(r.text, "brownout_requests_admitted_total") == admitted
        if len(pids) >= 2:
            break
    return pids


def test_two_gthread_workers_scrape_as_one_and_keep_a_killed_workers_counts(gunicorn) -> None:
    base = gunicorn("gthread", 2)
    n = 80
    served_by, admitted = workers_that_served(base, n)
    while len(served_by) < 2 and n < 800:  # the kernel may give one worker a whole batch
        more, served = workers_that_served(base, 40)
        served_by |= more
        n, admitted = n + 40, admitted + served
    assert len(served_by) == 2, served_by
    time.sleep(3)  # each worker publishes every second
    assert len(scrapes_show(base, n, admitted)) == 2

    victim = sorted(served_by)[0]
    os.kill(int(victim), signal.SIGKILL)  # no last snapshot: child_exit folds what it wrote
    deadline = time.monotonic() + 30
    while True:
        try:
            r = requests.get(f"{base}/health", timeout=5)
            if r.headers["x-pid"] not in served_by:
                break  # the replacement answers
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "no replacement worker"
        time.sleep(0.2)
    _, served = workers_that_served(base, 8)
    time.sleep(3)
    assert victim not in scrapes_show(base, n + 8, admitted + served)
