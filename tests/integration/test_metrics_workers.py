"""Several worker processes, one scrape: uvicorn ``--workers 2`` and gunicorn with
``uvicorn.workers.UvicornWorker`` serve `workers_app`; after N requests, every scrape,
whichever worker answers it, shows N offered and admitted (brownout's counters summed over
workers) and N handler runs (the application's own counter, prometheus_client's
`MultiProcessCollector`). Under gunicorn a killed worker's counts survive it (O1)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PERIOD = 0.2


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


@pytest.fixture(params=["uvicorn", "gunicorn"])
def server(request, tmp_path) -> Iterator[tuple[str, subprocess.Popen[bytes], str]]:
    port = free_port()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),  # empty at start, as the docs require
        "PUBLISH_PERIOD": str(PERIOD),
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
    }
    app = "tests.integration.workers_app:app"
    if request.param == "uvicorn":
        args = ["-m", "uvicorn", app, "--workers", "2", "--port", str(port)]
    else:
        args = ["-m", "gunicorn", app, "-w", "2", "-k", "uvicorn.workers.UvicornWorker"]
        args += ["-b", f"127.0.0.1:{port}", "-c", str(ROOT / "tests/integration/gunicorn_conf.py")]
    proc = subprocess.Popen([sys.executable, *args, "--log-level", "warning"], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the server exited"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)
    try:
        yield request.param, proc, base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def scrapes_until_both_workers_answered(base: str, n: int) -> set[str]:
    """Scrape on fresh connections until two workers have answered; each scrape must show n."""
    pids: set[str] = set()
    for _ in range(80):
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            r = await client.get("/metrics", headers={"accept-encoding": "gzip"})
        assert r.status_code == 200
        pids.add(r.headers["x-pid"])
        assert total(r.text, "brownout_requests_offered_total") == n, r.headers["x-pid"]
        assert total(r.text, "brownout_requests_admitted_total") == n
        assert total(r.text, "app_work_total") == n
        if len(pids) >= 2:
            break
    return pids


async def send(base: str, n: int) -> set[str]:
    """n requests, each on its own connection, 8 at a time: the kernel spreads them."""

    async def one(i: int) -> str:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            r = await client.get("/work")
            assert r.status_code == 200
            return r.headers["x-pid"]

    pids: set[str] = set()
    for start in range(0, n, 8):
        pids |= set(await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8)))))
    return pids


async def test_any_workers_scrape_shows_the_sum_over_workers(server) -> None:
    kind, _proc, base = server
    # The kernel hands connections to whichever worker accepts first: on a busy host one
    # worker may take a whole batch, so send batches until both have served (bounded).
    n = 80
    served_by = await send(base, n)
    while len(served_by) < 2 and n < 800:
        served_by |= await send(base, 40)
        n += 40
    assert len(served_by) == 2, f"{kind}: one worker served all {n}: {served_by}"
    await asyncio.sleep(PERIOD * 5)  # every worker has published since
    assert len(await scrapes_until_both_workers_answered(base, n)) == 2

    if kind != "gunicorn":
        return
    # A worker dies (SIGKILL: no last snapshot): gunicorn's child_exit hook folds its counts;
    # the replacement starts from zero; totals stay n (monotonic), then grow with new work.
    victim = sorted(served_by)[0]
    os.kill(int(victim), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            r = await client.get("/metrics")
        if r.status_code == 200 and r.headers["x-pid"] not in served_by:
            break  # the replacement answers
        assert time.monotonic() < deadline, "no replacement worker"
        await asyncio.sleep(0.2)
    await send(base, 8)
    await asyncio.sleep(PERIOD * 5)
    pids = await scrapes_until_both_workers_answered(base, n + 8)
    assert victim not in pids
