"""Demo server processes (brownout._lab.servers)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from brownout._lab.servers import spawn_server

# -- demo servers outliving the lab -----------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_demo_servers_exit_when_the_lab_process_dies() -> None:
    # SIGTERM from a CI timeout or `kill` runs no `finally`: the uvicorn servers the lab
    # started were left running for ever, holding their ports (SIGKILL alike).
    import subprocess
    import sys
    import time

    script = (
        "import os, signal\n"
        "from brownout._lab.servers import spawn_server\n"
        "server = spawn_server(['backend'])\n"
        "print(server.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    # stderr is not ours to read: the server inherits it and would hold the pipe open.
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    parent.wait(30)
    parent.stdout.close()
    child = int(line)
    try:
        give_up = time.monotonic() + 10
        while _alive(child) and time.monotonic() < give_up:
            time.sleep(0.1)
        assert not _alive(child), "the demo server outlived the process that started it"
    finally:
        if _alive(child):
            os.kill(child, 9)


# -- demo servers and the open-file limit -------------------------------------------------------


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc/<pid>/limits")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_demo_servers_make_room_for_a_flood_of_connections() -> None:
    # The front accepts the generator's whole pool (1,024 connections) and opens its own to
    # the dependency. Started under a stock soft limit of 1,024 it ran out of descriptors
    # under the 10x flood and refused connections: the lab blamed the configuration.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip("hard file limit below what the demo asks for")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        server = spawn_server(["backend"])  # inherits the stock limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        give_up = time.monotonic() + 10
        while _soft_nofile(server.proc.pid) <= 1024 and time.monotonic() < give_up:
            time.sleep(0.05)  # the port is announced first, the limit raised right after
        assert _soft_nofile(server.proc.pid) >= 4096
    finally:
        server.stop()


def test_the_uvicorn_comparator_does_not_log_each_refusal() -> None:
    # uvicorn --limit-concurrency logged "Exceeded concurrency limit." for every connection it
    # refused: 32,503 lines over the lab's console in one default run.
    backend = spawn_server(["backend", "--latency", "0.2"])
    args = ["front", "--backend-url", backend.url, "--limit-concurrency", "2"]
    front = subprocess.Popen(
        [sys.executable, "-m", "brownout._lab.demo", *args, "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert front.stdout is not None and front.stderr is not None
        port = int(front.stdout.readline().split()[1])
        url = f"http://127.0.0.1:{port}/api/interactive"

        def get(_: int) -> int:
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                return 0

        give_up = time.monotonic() + 20
        while get(0) == 0 and time.monotonic() < give_up:
            time.sleep(0.05)  # until uvicorn serves
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(get, range(32)))
        assert 503 in statuses, statuses  # the comparator did refuse
    finally:
        front.kill()
        _, err = front.communicate(timeout=10)
        backend.stop()
    assert b"Exceeded concurrency limit" not in err, err[-500:]
