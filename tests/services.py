"""The real servers the integration tests talk to, checked once per session.

A test that needs a service asks for its fixture (``redis_server``, ``rabbitmq_server``,
``postgres_server`` in ``tests/conftest.py``); when the service does not answer, the test
errors at setup with a message naming the service, its address and the command that starts
it, never a quiet skip. Each address can be moved with an environment variable
(``BROWNOUT_TEST_REDIS=127.0.0.1:6380``), which is also how the message is shown on purpose
(a closed port).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "POSTGRES",
    "RABBITMQ",
    "REDIS",
    "SERVICES",
    "Service",
    "probe",
    "redis_cluster",
    "require",
    "unavailable",
]

TIMEOUT = 1.0
"""Seconds to connect and read the greeting: a live local server answers in milliseconds."""


@dataclass(frozen=True)
class Service:
    name: str
    env: str
    """The environment variable that overrides the address (``host:port``)."""
    default: str
    start: str
    """How to start it on a development machine."""
    hello: bytes
    """Sent after connecting; ``expect`` must begin the answer (a real server, not any port)."""
    expect: bytes | tuple[bytes, ...]
    """What the answer must begin with (one of them, for a tuple)."""

    @property
    def address(self) -> str:
        return os.environ.get(self.env, self.default).strip() or self.default

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0] or "127.0.0.1"

    @property
    def port(self) -> int:
        text = self.address.rpartition(":")[2]
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ValueError(f"{self.env}={self.address!r}: expected host:port")
        return int(text)


REDIS = Service(
    name="Redis",
    env="BROWNOUT_TEST_REDIS",
    default="127.0.0.1:6379",
    start="redis-server --daemonize yes --save '' --appendonly no  (or: python3 dev.py test)",
    hello=b"PING\r\n",
    expect=b"+PONG",
)
RABBITMQ = Service(
    name="RabbitMQ",
    env="BROWNOUT_TEST_RABBITMQ",
    default="127.0.0.1:5672",
    start="rabbitmq-server -detached  (or: service rabbitmq-server start), user guest/guest",
    hello=b"AMQP\x00\x00\x09\x01",
    expect=b"\x01\x00\x00",  # a method frame on channel 0: connection.start
)
POSTGRES = Service(
    name="PostgreSQL",
    env="BROWNOUT_TEST_POSTGRES",
    default="127.0.0.1:5432",
    start="service postgresql start  (trust auth on loopback, a database named test)",
    hello=b"\x00\x00\x00\x08\x04\xd2\x16\x2f",  # SSLRequest: the server answers N or S
    expect=(b"N", b"S"),
)
SERVICES = {"redis": REDIS, "rabbitmq": RABBITMQ, "postgres": POSTGRES}

_checked: dict[str, str | None] = {}  # address -> why it does not answer (None: it does)


def probe(service: Service, timeout: float = TIMEOUT) -> str | None:
    """Why ``service`` does not answer at its address, or ``None`` when it does."""
    try:
        with socket.create_connection((service.host, service.port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(service.hello)
            answer = s.recv(16)
    except (OSError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    if not answer.startswith(service.expect):
        return f"something else answers there: {answer[:16]!r}"
    return None


def unavailable(service: Service, why: str) -> str:
    """The message a test that needs ``service`` fails with."""
    return (
        f"{service.name} does not answer at {service.address} ({why}); this test needs it.\n"
        f"Start it: {service.start}\n"
        f"Or point the tests at another one: {service.env}=host:port"
    )


def require(service: Service) -> Service:
    """``service`` when it answers (checked once per address and session); otherwise fail
    the calling test with `unavailable`'s message."""
    import pytest

    key = f"{service.name}@{service.address}"
    if key not in _checked:
        _checked[key] = probe(service)
    why = _checked[key]
    if why is not None:
        pytest.fail(unavailable(service, why), pytrace=False)
    return service


# -- a Redis Cluster of our own ------------------------------------------------------------------
CLUSTER_TOOLS = ("redis-server", "redis-cli")
CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def _free_node_port() -> int:
    """A loopback port that is free, and whose cluster bus port is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + CLUSTER_BUS_OFFSET >= 65536:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair for a Redis Cluster node")


def _cli(port: int, *args: str, timeout: float = 5.0) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


@contextlib.contextmanager
def redis_cluster(directory: Path, nodes: int = 3) -> Iterator[list[tuple[str, int]]]:
    """Start a Redis Cluster of ``nodes`` primaries on free loopback ports under
    ``directory``, yield their ``(host, port)`` once ``cluster_state:ok``, stop them after.

    Fails the calling test (no quiet skip) when ``redis-server`` or ``redis-cli`` is missing
    or the cluster does not form.
    """
    import pytest

    missing = [tool for tool in CLUSTER_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found on PATH; the Redis Cluster tests start a "
            f"{nodes}-node cluster on loopback with them.\n"
            "Install Redis 7 (apt-get install redis-server, or brew install redis).",
            pytrace=False,
        )
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for _ in range(nodes):
            port = _free_node_port()
            home = directory / str(port)
            home.mkdir(parents=True)
            log = (home / "redis.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--bind",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(home / "nodes.conf"),
                        "--dir",
                        str(home),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
            ports.append(port)

        def fail(why: str) -> None:
            logs = "\n".join(
                f"--- node {p} ---\n{(directory / str(p) / 'redis.log').read_text()[-2000:]}"
                for p in ports
            )
            pytest.fail(f"the test Redis Cluster did not start: {why}\n{logs}", pytrace=False)

        deadline = time.monotonic() + 20
        for port, proc in zip(ports, procs, strict=True):
            while "PONG" not in _cli(port, "ping"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    fail(f"node {port} does not answer PING")
                time.sleep(0.05)
        created = subprocess.run(
            [
                *("redis-cli", "--cluster", "create"),
                *(f"127.0.0.1:{p}" for p in ports),
                *("--cluster-replicas", "0", "--cluster-yes"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            fail(f"redis-cli --cluster create: {created.stdout}{created.stderr}")
        deadline = time.monotonic() + 30
        for port in ports:
            while "cluster_state:ok" not in _cli(port, "cluster", "info"):
                if time.monotonic() > deadline:
                    fail(f"node {port} never reached cluster_state:ok")
                time.sleep(0.1)
        yield [("127.0.0.1", port) for port in ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
