"""WSGI benchmark: the WSGI middleware's overhead on a trivial Flask endpoint.

Prints, in one run:

1. served: the endpoint under gunicorn (``gthread``, 1 worker, 8 threads), with and without
   `brownout.integrations.flask.protect` (an `EdgePolicy` whose bulkhead is a
   `ThreadBulkhead` from `worker_bulkhead`, as docs/gunicorn.md recommends): server CPU per
   request of the worker process (all threads, ``/proc/<pid>/task/*/schedstat``), the two
   servers driven alternately by 2 keep-alive clients (threads of this process, so their
   CPU is not counted). Target <= 1.15x;
2. in-process, as a diagnostic: the Flask app called with a werkzeug test environ, bare
   against protected (the middleware's own cost without the server's).

Each figure is the best of several interleaved repetitions, so a noisy shared machine
inflates both sides alike. Run under the lock:

    flock /tmp/brownout-bench.lock .venv/bin/python bench/wsgi_bench.py
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flask import Flask

from brownout import EdgePolicy
from brownout.integrations.flask import protect
from brownout.integrations.gunicorn import worker_bulkhead

REPS = 9
N = 4_000
CONCURRENCY = 2  # at most the limit while it probes (pinned to half its capacity)
THREADS = 8
LOCAL_N = 20_000
HERE = Path(__file__).resolve().parent


def flask_app(protected: bool) -> Flask:
    app = Flask(__name__)

    @app.get("/hello")
    def hello() -> dict[str, str]:
        return {"hello": "world"}

    if protected:
        # As docs/gunicorn.md has it: adaptive, started at its cap, threads kept to refuse.
        bulkhead = worker_bulkhead("api", threads=THREADS)
        protect(app, EdgePolicy(bulkhead=bulkhead))
    return app


bare_app = flask_app(False)  # gunicorn's targets: wsgi_bench:bare_app, :protected_app
protected_app = flask_app(True)


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` (Linux schedstat, ns resolution)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(target: str) -> tuple[subprocess.Popen[bytes], int, int]:
    """gunicorn serving ``target``; returns it, its port and its one worker's pid."""
    port = free_port()
    args = ["-k", "gthread", "-w", "1", "--threads", str(THREADS), "--keep-alive", "30"]
    args += ["-b", f"127.0.0.1:{port}", "--log-level", "warning", target]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", *args], cwd=HERE, env=env)
    deadline = time.monotonic() + 60
    while True:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        if children:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/hello")
                if conn.getresponse().status == 200:
                    conn.close()
                    return proc, port, int(children[0])
            except OSError:
                pass
        assert proc.poll() is None, "gunicorn exited"
        assert time.monotonic() < deadline, "gunicorn did not start"
        time.sleep(0.2)


def client_round(conns: list[http.client.HTTPConnection], pid: int, n: int) -> float:
    """Server CPU per request over ``n`` requests, one keep-alive connection per client."""
    refused: list[int] = []

    def run(conn: http.client.HTTPConnection) -> None:
        for _ in range(n // len(conns)):
            conn.request("GET", "/hello")
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                refused.append(r.status)

    with ThreadPoolExecutor(len(conns)) as pool:
        c = process_cpu(pid)
        list(pool.map(run, conns))
        took = (process_cpu(pid) - c) / n
    assert len(refused) <= n // 100, f"{len(refused)} of {n} refused: not an overhead figure"
    return took


def served() -> None:
    servers = {kind: start(f"wsgi_bench:{kind}_app") for kind in ("bare", "protected")}
    try:
        conns = {
            kind: [http.client.HTTPConnection("127.0.0.1", port) for _ in range(CONCURRENCY)]
            for kind, (_, port, _) in servers.items()
        }
        for kind, (_, _, pid) in servers.items():
            client_round(conns[kind], pid, 800)  # warm up
        best = dict.fromkeys(servers, float("inf"))
        ratios = []
        for _ in range(REPS):
            got = {kind: client_round(conns[kind], pid, N) for kind, (_, _, pid) in servers.items()}
            for kind, v in got.items():
                best[kind] = min(best[kind], v)
            ratios.append(got["protected"] / got["bare"])
        ratios.sort()
        bare, mw = best["bare"], best["protected"]
        print(
            f"Flask served by gunicorn gthread over loopback: server CPU per request bare "
            f"{bare * 1e6:6.1f} us, with middleware {mw * 1e6:6.1f} us "
            f"(+{(mw - bare) * 1e6:.1f} us): best/best {mw / bare:.3f}x, median round "
            f"{ratios[len(ratios) // 2]:.3f}x (target <= 1.15x)"
        )
    finally:
        for proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def local_round(app: Callable[..., Iterable[bytes]], n: int) -> float:
    from werkzeug.test import create_environ

    template = create_environ("/hello", "http://bench/")

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        assert status.startswith("200"), status
        return lambda data: None

    t = time.perf_counter()
    for _ in range(n):
        body = app(dict(template), start_response)
        for _chunk in body:
            pass
        close = getattr(body, "close", None)
        if close is not None:
            close()
    return (time.perf_counter() - t) / n


def in_process() -> None:
    local_round(bare_app, 500)
    local_round(protected_app, 500)
    best_bare = best_mw = float("inf")
    for _ in range(5):
        best_bare = min(best_bare, local_round(bare_app, LOCAL_N))
        best_mw = min(best_mw, local_round(protected_app, LOCAL_N))
    print(
        f"Flask in-process (werkzeug environ): bare {best_bare * 1e6:6.1f} us, with "
        f"middleware {best_mw * 1e6:6.1f} us (+{(best_mw - best_bare) * 1e6:.1f} us): "
        f"{best_mw / best_bare:.3f}x (diagnostic)"
    )


if __name__ == "__main__":
    in_process()
    served()
