"""Deadlines reach a real PostgreSQL from a worker thread (issue 28): a statement timeout
taken from the remaining budget (`brownout.statement_timeout_ms`) makes the server cancel a
slow statement at the deadline, and the backend is free again right after; through a Flask
view behind the WSGI edge the caller hears 504 in bounded time. Also runs the psycopg
example of docs/threads.md.

Margins are generous (a shared, noisy 2-core host): the statement would run 5 s; the bounds
checked are about a second."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from tests import services

import brownout
from brownout import EdgePolicy, Route, ThreadBulkhead
from brownout.events import EventHub
from brownout.integrations.flask import protect
from brownout.limits import FixedLimit

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 0.3
SLEEP = 5.0  # what the statement would take uncancelled
BOUND = 1.0  # cancelled within this of starting
GONE = 1.0  # and its backend idle within this after


def conninfo(pg: services.Service) -> str:
    return f"host={pg.host} port={pg.port} dbname=test user=postgres connect_timeout=5"


def on_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh worker thread (as a WSGI server does); its result or error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed back to the test's thread
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(SLEEP * 3)
    assert not t.is_alive() and out
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def running(pg: services.Service, marker: str) -> int:
    """Backends still running a query that carries ``marker``."""
    with psycopg.connect(conninfo(pg), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
            " AND pid <> pg_backend_pid() AND query LIKE %s",
            (f"%{marker}%",),
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_until_gone(pg: services.Service, marker: str) -> float:
    """Seconds until no backend runs ``marker``'s query (at most `GONE`, else fail)."""
    start = time.monotonic()
    while running(pg, marker):
        assert time.monotonic() - start < GONE, "the cancelled statement is still running"
        time.sleep(0.02)
    return time.monotonic() - start


def slow_query(conn: psycopg.Connection[Any], marker: str) -> None:
    """The budget as the transaction's statement timeout, then a statement that outlives it."""
    with conn.transaction():
        conn.execute(f"SET LOCAL statement_timeout = {brownout.statement_timeout_ms(SLEEP)}")
        conn.execute(f"SELECT pg_sleep({SLEEP}) /* {marker} */")


def test_the_remaining_budget_cancels_a_statement_on_the_server(
    postgres_server: services.Service,
) -> None:
    marker = f"brownout-{uuid.uuid4().hex}"

    def work() -> float:
        with psycopg.connect(conninfo(postgres_server), autocommit=True) as conn:
            start = time.monotonic()
            with brownout.deadline(BUDGET), pytest.raises(psycopg.errors.QueryCanceled):
                slow_query(conn, marker)
            took = time.monotonic() - start
            # The connection is usable again, and the timeout ended with the transaction.
            row = conn.execute("SHOW statement_timeout").fetchone()
            assert row is not None and row[0] == "0"
            return took

    took = on_thread(work)
    assert BUDGET * 0.9 <= took < BOUND
    wait_until_gone(postgres_server, marker)


def test_a_flask_view_past_its_budget_in_the_database_answers_504_in_bounded_time(
    postgres_server: services.Service,
) -> None:
    marker = f"brownout-{uuid.uuid4().hex}"
    hub = EventHub()
    bulkhead = ThreadBulkhead("db", FixedLimit(2), reserve=0, events=hub)
    app = Flask(__name__)

    @app.get("/report")
    def report() -> str:
        with psycopg.connect(conninfo(postgres_server), autocommit=True) as conn:
            slow_query(conn, marker)
        return "done"

    protect(app, EdgePolicy(routes={"/report": Route(default=BUDGET, bulkhead=bulkhead)}))

    def call() -> tuple[int, str, float]:
        start = time.monotonic()
        with app.test_client() as client:
            r = client.get("/report")
            return r.status_code, r.content_type, time.monotonic() - start

    status, content_type, took = on_thread(call)
    assert status == 504  # the server cancelled it at the budget; the edge says so
    assert content_type == "application/problem+json"
    assert took < BOUND + 0.5  # (plus a connection set up inside the budget)
    assert bulkhead.in_flight == 0
    wait_until_gone(postgres_server, marker)


def test_the_psycopg_example_of_the_threads_page_runs(
    postgres_server: services.Service,
) -> None:
    text = (ROOT / "docs" / "threads.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    [example] = [b for b in blocks if "import psycopg" in b]
    example = example.replace(
        'conninfo = "host=127.0.0.1 port=5432 dbname=test user=postgres"',
        f"conninfo = {conninfo(postgres_server)!r}",
    )
    assert conninfo(postgres_server) in example
    scope: dict[str, Any] = {}
    start = time.monotonic()
    on_thread(lambda: exec(compile(example, "docs/threads.md", "exec"), scope))
    assert time.monotonic() - start < BOUND + 0.5
    assert scope["answer"] == 504
