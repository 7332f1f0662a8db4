"""The demo's sync front: the async front's ramp endpoints as a Flask app under gunicorn gthread.

``GET /api/interactive`` and ``GET /api/batch`` call the demo dependency through one pooled
`requests.Session`; ``GET /healthz`` answers directly. ``unprotected`` is the app as a sync
user runs it today (a plain session with a fixed timeout); ``fixed`` adds brownout through
the public API only (`brownout._lab.protect.protect_wsgi`: the WSGI middleware and a
`ThreadBulkhead`), passes the remaining budget to the dependency and bounds each call by it,
and serves ``GET /lab/bulkhead``.

gunicorn runs one gthread worker of `THREADS` threads on the socket the demo process bound
(`serve`); the worker announces its pid (``WORKER <pid>``) so the lab reads the CPU of the
process that serves, not of the master.
"""

from __future__ import annotations

import socket
from typing import Any

import requests
from flask import Flask, Response, jsonify
from gunicorn.app.base import BaseApplication  # type: ignore[import-untyped]

from brownout import Rejected, call_budget
from brownout.wire import outbound_headers

from .demo import NORMAL_TIMEOUT
from .protect import protect_wsgi

__all__ = ["SYNC_MODES", "THREADS", "create_sync_front", "serve"]

SYNC_MODES = ("unprotected", "fixed")

THREADS = 32
"""gthread threads: a request holds one for its whole life, so they must outnumber what the
bulkhead lets wait (its limit plus its queue, 20), leaving threads free to refuse at once;
more only add GIL contention. The unprotected front gets the same number."""

KEEPALIVE = 60
"""Seconds an idle keep-alive connection is kept: the generator reuses its connections."""
WORKER_CONNECTIONS = 4096
"""Connections the worker holds: the generator's pool (1,024) must never stop it accepting."""


def create_sync_front(backend_url: str, mode: str = "unprotected") -> Flask:
    """The sync front as a Flask app; ``fixed`` wraps it in brownout's WSGI middleware."""
    if mode not in SYNC_MODES:
        raise ValueError(f"mode must be one of {SYNC_MODES}")
    protected = mode != "unprotected"
    work_url = backend_url.rstrip("/") + "/work"
    session = requests.Session()
    # One connection per thread kept in the pool: more would be opened and thrown away.
    adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=THREADS)
    session.mount("http://", adapter)
    app = Flask("brownout-lab-sync-front")

    def call_backend() -> requests.Response:
        if not protected:
            return session.get(work_url, timeout=NORMAL_TIMEOUT)
        return session.get(
            work_url,
            headers=outbound_headers(reserve=0.005),
            timeout=call_budget(NORMAL_TIMEOUT, reserve=0.005),
        )

    def work() -> Response:
        try:
            upstream = call_backend()
        except Rejected:
            return Response("deadline exceeded", 504, mimetype="text/plain")
        except requests.Timeout:
            return Response("dependency timed out", 504, mimetype="text/plain")
        except requests.RequestException:
            return Response("dependency failed", 502, mimetype="text/plain")
        status = 200 if upstream.status_code == 200 else 502
        return Response(upstream.content, status, mimetype="text/plain")

    app.add_url_rule("/api/interactive", "interactive", work)
    app.add_url_rule("/api/batch", "batch", work)
    app.add_url_rule("/healthz", "health", lambda: Response("ok", mimetype="text/plain"))
    if protected:
        bulkhead = protect_wsgi(app, mode)

        def bulkhead_state() -> Response:
            return jsonify(
                limit=bulkhead.limit,
                in_flight=bulkhead.in_flight,
                queue_depth=bulkhead.queue_depth,
            )

        app.add_url_rule("/lab/bulkhead", "bulkhead", bulkhead_state)
    return app


class _Gunicorn(BaseApplication):  # type: ignore[misc]  # gunicorn ships no type hints
    """gunicorn run from code: its options as a dict, the app built in the worker."""

    def __init__(self, options: dict[str, Any], build: Any) -> None:
        self.options = options
        self.build = build
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return self.build()


def _announce_worker(server: Any, worker: Any) -> None:
    print(f"WORKER {worker.pid}", flush=True)


def serve(sock: socket.socket, backend_url: str, mode: str) -> None:
    """Serve the sync front on ``sock`` (bound and listening) with gunicorn gthread."""
    options = {
        "bind": [f"fd://{sock.fileno()}"],
        "workers": 1,
        "worker_class": "gthread",
        "threads": THREADS,
        "worker_connections": WORKER_CONNECTIONS,
        "keepalive": KEEPALIVE,
        "graceful_timeout": 1,
        "loglevel": "warning",
        "accesslog": None,
        "post_fork": _announce_worker,
    }
    # The app is built in the worker, after the fork: its session's sockets are its own.
    _Gunicorn(options, lambda: create_sync_front(backend_url, mode)).run()
