"""The lab's sync front (Flask under gunicorn gthread) starts, serves and stops, both ways."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from brownout._lab.protect import FIXED_LIMIT
from brownout._lab.servers import start_demo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _get(url: str, budget_ms: int | None = None) -> tuple[int, str, bytes]:
    headers = {"brownout-budget-ms": str(budget_ms)} if budget_ms is not None else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status), r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], within: float = 10.0) -> bool:
    give_up = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("mode", ["unprotected", "fixed"])
def test_the_sync_front_serves_the_ramp_endpoints_and_stops(mode: str) -> None:
    with start_demo(mode, concurrency=8, latency=0.02, sync=True) as demo:
        front = demo.front
        assert front.worker_pid is not None and front.worker_pid != front.proc.pid
        assert front.serving_pid == front.worker_pid
        with open(f"/proc/{front.worker_pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == front.proc.pid  # its master
        for path in ("/api/interactive", "/api/batch"):
            status, _, body = _get(front.url + path, budget_ms=1000)
            assert (status, body) == (200, b"ok"), path
        assert _get(front.url + "/healthz")[:1] == (200,)
        # concurrent requests share the worker's threads and its pooled session
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda _: _get(front.url + "/api/interactive")[0], range(24)))
        assert statuses == [200] * 24
        stats = json.loads(_get(demo.backend.url + "/admin/stats")[2])
        state = _get(front.url + "/lab/bulkhead")
        if mode == "unprotected":
            assert state[0] == 404
            assert stats["with_budget"] == 0  # a plain session sends no budget
        else:
            assert state[0] == 200
            assert json.loads(state[2])["limit"] == FIXED_LIMIT
            assert stats["with_budget"] == stats["served"]  # every call passed its budget
        pids = [front.proc.pid, front.worker_pid]
    assert _gone(pids), "the gunicorn master or its worker outlived the demo"


def test_the_protected_sync_front_refuses_what_it_cannot_serve_in_time() -> None:
    # A 1 ms budget cannot cover a 20 ms dependency: answered at once, never sent onward.
    with start_demo("fixed", concurrency=8, latency=0.02, sync=True) as demo:
        started = time.monotonic()
        status, content_type, _ = _get(demo.front.url + "/api/interactive", budget_ms=1)
        assert time.monotonic() - started < 5
        assert status == 504, (status, content_type)
        stats = json.loads(_get(demo.backend.url + "/admin/stats")[2])
        assert stats["served"] == 0
