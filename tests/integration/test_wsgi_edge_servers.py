"""The WSGI and Django edges on real servers over loopback: Flask under gunicorn (sync and
gthread workers), Django under gunicorn (WSGI) and uvicorn (ASGI), with `requests`; and
Django's own test client. Refusals are problem+json, health is served while the bulkhead is
full, a handler that outlives its deadline gets 504, the URL pattern is the label."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.integration.wsgi_apps"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVERS = {
    "flask-gunicorn-sync": (["-m", "gunicorn", f"{MODULE}:flask_app", "-k", "sync"], "wsgi", ""),
    "flask-gunicorn-gthread": (
        ["-m", "gunicorn", f"{MODULE}:flask_app", "-k", "gthread", "--threads", "4"],
        "wsgi",
        "",
    ),
    "django-gunicorn": (
        ["-m", "gunicorn", f"{MODULE}:django_wsgi", "-k", "gthread", "--threads", "4"],
        "wsgi",
        "/",
    ),
    "django-uvicorn": (["-m", "uvicorn", f"{MODULE}:django_asgi"], "asgi", "/"),
}


@pytest.fixture(params=sorted(SERVERS))
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str]]:
    args, mode, slash = SERVERS[request.param]
    port = free_port()
    if args[1] == "gunicorn":
        args = [*args, "-b", f"127.0.0.1:{port}", "-w", "1", "--log-level", "warning"]
    else:
        args = [*args, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
        "DJANGO_SETTINGS_MODULE": MODULE,
        "BROWNOUT_DJANGO_MODE": mode,
    }
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            try:
                if requests.get(f"{base}/health{slash}", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() - started < 60, "the server did not start"
            time.sleep(0.2)
        yield request.param, base, slash
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_edge_on_a_real_server(server: tuple[str, str, str]) -> None:
    name, base, slash = server
    with requests.Session() as s:
        assert s.get(f"{base}/items/3{slash}", timeout=10).json() == {"id": 3}
        late = s.get(f"{base}/slow{slash}", timeout=10)
        assert late.status_code == 504, name
        assert late.headers["content-type"] == "application/problem+json"
        assert json.loads(late.content)["reason"] == "deadline_expired"
    if name == "flask-gunicorn-sync":
        return  # one request at a time: nothing to refuse
    answers: list[int] = []
    holder = threading.Thread(
        target=lambda: answers.append(requests.get(f"{base}/hold{slash}", timeout=10).status_code)
    )
    holder.start()
    try:
        time.sleep(0.5)  # the holder is inside (it holds 1.5 s)
        refused = requests.get(f"{base}/items/1{slash}", timeout=10)
        assert refused.status_code == 503, name
        assert refused.headers["content-type"] == "application/problem+json"
        health = requests.get(f"{base}/health{slash}", timeout=10)
        assert health.status_code == 200 and health.text == "ok"
    finally:
        holder.join(15)
    assert answers == [200]


@pytest.fixture(scope="module")
def django_client() -> object:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", MODULE)
    if os.environ["DJANGO_SETTINGS_MODULE"] != MODULE:
        pytest.skip("another Django site is configured in this process")
    import django

    django.setup()
    from django.test import Client

    return Client()


def test_django_test_client_labels_trust_and_refusals(django_client) -> None:  # type: ignore[no-untyped-def]
    from brownout import Priority
    from brownout.events import RequestAdmitted, hub
    from brownout.testing import EventRecorder

    with EventRecorder(hub) as rec:
        claim = {"HTTP_BROWNOUT_PRIORITY": "sheddable"}
        assert django_client.get("/items/3/", **claim).status_code == 200
        trusted = {**claim, "HTTP_AUTHORIZATION": "Bearer mesh"}
        assert django_client.get("/items/4/", **trusted).status_code == 200
        late = django_client.get("/slow/")
        assert late.status_code == 504 and late["content-type"] == "application/problem+json"
        assert django_client.get("/health/").content == b"ok"
    admitted = [e for e in rec.events if isinstance(e, RequestAdmitted)]
    assert [e.operation for e in admitted] == ["/items/<int:item_id>/"] * 2 + ["/slow/"]
    assert [e.priority for e in admitted][:2] == [Priority.CRITICAL, Priority.SHEDDABLE]
