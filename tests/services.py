"""The real servers the integration tests talk to, checked once per session.

A test that needs a service asks for its fixture (``redis_server``, ``rabbitmq_server``,
``postgres_server`` in ``tests/conftest.py``); when the service does not answer, the test
errors at setup with a message naming the service, its address and the command that starts
it, never a quiet skip. Each address can be moved with an environment variable
(``BROWNOUT_TEST_REDIS=127.0.0.1:6380``), which is also how the message is shown on purpose
(a closed port).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = [
    "POSTGRES",
    "RABBITMQ",
    "REDIS",
    "SERVICES",
    "Service",
    "probe",
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
