"""Start and stop the demo's server processes (real uvicorn or gunicorn, each in its own
process)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "DemoSystem",
    "ServerProcess",
    "spawn_server",
    "start_demo",
    "start_server",
    "wait_ready",
]


@dataclass
class ServerProcess:
    """One running demo server."""

    role: str
    port: int
    proc: subprocess.Popen[bytes]
    worker_pid: int | None = None
    """gunicorn's worker, forked by ``proc`` (its master): the process that serves."""
    proxy: tuple[int, int] | None = None
    """A backend's `brownout proxy` in front of it (``--proxy``): (port, control port)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def serving_pid(self) -> int:
        """The process whose CPU is the server's: the worker under gunicorn."""
        return self.worker_pid if self.worker_pid is not None else self.proc.pid

    def stop(self) -> None:
        if self.worker_pid is not None:
            # Killed with its master, a worker would serve on until it noticed, up to a second.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker_pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()  # a demo server has nothing to flush; a graceful stop only costs time
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn_server(args: list[str]) -> ServerProcess:
    """Run ``python -m brownout._lab.demo ARGS``; return once it has bound its port.

    The server exits by itself if this process dies without stopping it (SIGTERM, SIGKILL).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "brownout._lab.demo", *args, "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("PORT "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"demo server {args[0]} failed to start (said {line!r})")
    server = ServerProcess(args[0], int(line.split()[1]), proc)
    if args[0] == "sync-front":
        # gunicorn's worker says its pid once forked (the app is built there).
        worker = proc.stdout.readline().decode().strip()
        if not worker.startswith("WORKER "):
            server.stop()
            raise RuntimeError(f"demo server {args[0]} started no worker (said {worker!r})")
        server.worker_pid = int(worker.split()[1])
    if "--proxy" in args:
        said = proc.stdout.readline().decode().strip()
        if not said.startswith("PROXY "):
            server.stop()
            raise RuntimeError(f"demo server {args[0]} started no proxy (said {said!r})")
        port, control = said.split()[1:3]
        server.proxy = (int(port), int(control))
    return server


def wait_ready(server: ServerProcess, ready_path: str, timeout: float = 20.0) -> None:
    """Poll ``ready_path`` until it answers 200; stop the server and raise if it never does."""
    give_up = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(server.url + ready_path, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if server.proc.poll() is not None or time.monotonic() > give_up:
            server.stop()
            raise RuntimeError(f"demo server {server.role} never became ready")
        time.sleep(0.02)


def start_server(args: list[str], ready_path: str, timeout: float = 20.0) -> ServerProcess:
    """`spawn_server` then `wait_ready`."""
    server = spawn_server(args)
    wait_ready(server, ready_path, timeout)
    return server


@dataclass
class DemoSystem:
    """A running backend and front."""

    backend: ServerProcess
    front: ServerProcess

    @property
    def proxy_control(self) -> tuple[str, int] | None:
        """The control endpoint of the proxy between front and backend (None: no proxy)."""
        proxy = self.backend.proxy
        return ("127.0.0.1", proxy[1]) if proxy is not None else None

    def stop(self) -> None:
        self.front.stop()
        self.backend.stop()


@contextlib.contextmanager
def start_demo(
    mode: str,
    *,
    limit_concurrency: int | None = None,
    concurrency: int,
    latency: float,
    backend_cpus: list[int] | None = None,
    front_cpus: list[int] | None = None,
    drill: str | None = None,
    sync: bool = False,
    metrics: bool = False,
    proxy: bool = False,
) -> Iterator[DemoSystem]:
    """A fresh backend + front in ``mode``; both stopped on exit. ``concurrency`` and
    ``latency`` shape the dependency (the lab passes `LabSettings`' ``backend_*``).

    ``drill`` forces that declared degraded mode on in the front (protected modes only).
    ``sync``: the front is the Flask one under gunicorn (`brownout._lab.sync_front`).
    ``metrics``: the (async) front serves brownout's metrics at ``/metrics``.
    ``proxy``: the front calls the dependency through `brownout proxy` (`DemoSystem.proxy_control`).
    """

    def cpus(c: list[int] | None) -> list[str]:
        return ["--cpus", ",".join(map(str, c))] if c else []

    backend = spawn_server(
        [
            "backend",
            "--concurrency",
            str(concurrency),
            "--latency",
            str(latency),
            *cpus(backend_cpus),
            *(["--proxy"] if proxy else []),
        ]
    )
    front: ServerProcess | None = None
    try:
        extra = ["--limit-concurrency", str(limit_concurrency)] if limit_concurrency else []
        if drill is not None and mode != "unprotected":
            extra += ["--drill", drill]
        if metrics and not sync:
            extra.append("--metrics")
        front = spawn_server(
            [
                "sync-front" if sync else "front",
                "--backend-url",
                f"http://127.0.0.1:{backend.proxy[0]}" if backend.proxy else backend.url,
                "--mode",
                mode,
                *extra,
                *cpus(front_cpus),
            ]
        )
        wait_ready(backend, "/admin/stats")
        wait_ready(front, "/healthz")
    except BaseException:
        if front is not None:
            front.stop()
        backend.stop()
        raise
    system = DemoSystem(backend, front)
    try:
        yield system
    finally:
        system.stop()
