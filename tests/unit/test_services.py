"""The integration tests' service check (tests/services.py): a service that does not answer
fails the test with its name, address and how to start it; nothing is skipped quietly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from tests import services

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: refused


@pytest.mark.parametrize("service", [services.REDIS, services.RABBITMQ])
def test_a_closed_port_fails_with_the_service_its_address_and_how_to_start_it(
    service: services.Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv(service.env, address)
    why = services.probe(service, timeout=0.5)
    assert why is not None and "ConnectionRefused" in why
    with pytest.raises(pytest.fail.Exception) as failed:
        services.require(service)
    message = str(failed.value)
    assert service.name in message and address in message
    assert service.start in message and service.env in message


def test_a_port_where_something_else_answers_is_not_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        monkeypatch.setenv("BROWNOUT_TEST_REDIS", f"127.0.0.1:{listener.getsockname()[1]}")

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(16)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        why = services.probe(services.REDIS, timeout=2)
        thread.join(5)
    assert why is not None and "something else answers" in why


def test_a_malformed_address_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROWNOUT_TEST_RABBITMQ", "localhost")
    why = services.probe(services.RABBITMQ)
    assert why is not None and "BROWNOUT_TEST_RABBITMQ" in why


def test_a_test_that_needs_a_missing_service_errors_with_the_message(tmp_path: Path) -> None:
    # end to end through pytest: the fixture fails the test at setup, never skips it
    test = tmp_path / "test_needs_redis.py"
    test.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from tests.conftest import redis_server  # the fixture, as the suite has it

            def test_uses_redis(redis_server):
                raise AssertionError("must not run without Redis")
            """
        )
    )
    port = closed_port()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "BROWNOUT_TEST_REDIS": f"127.0.0.1:{port}"},
        timeout=120,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 error" in out and "skipped" not in out, out
    assert f"Redis does not answer at 127.0.0.1:{port}" in out, out
    assert "redis-server --daemonize yes" in out, out


def test_the_cluster_fixture_fails_naming_the_missing_redis_binaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No quiet skip: without redis-server and redis-cli the cluster tests fail, saying so."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: nothing found
    with pytest.raises(pytest.fail.Exception) as failed:
        with services.redis_cluster(tmp_path / "cluster"):
            raise AssertionError("started without redis-server")
    message = str(failed.value)
    assert "redis-server and redis-cli not found on PATH" in message
