"""The embedded demo's network faults go through `brownout proxy` (brownout._lab.servers)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from brownout._lab.servers import start_demo


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.loads(r.read())


def test_the_front_calls_the_dependency_through_the_proxy() -> None:
    with start_demo("unprotected", concurrency=8, latency=0.005, proxy=True) as demo:
        control = demo.proxy_control
        assert control is not None
        faults = f"http://{control[0]}:{control[1]}/faults"
        assert [_status(demo.front.url + "/api/interactive") for _ in range(5)] == [200] * 5
        _json(faults, {"error_rate": 1.0})
        assert {_status(demo.front.url + "/api/interactive") for _ in range(5)} == {502}
        _json(faults, {"reset_rate": 1.0})
        assert {_status(demo.front.url + "/api/interactive") for _ in range(5)} == {502}
        _json(faults, {})
        assert _status(demo.front.url + "/api/interactive") == 200
        time.sleep(0.25)  # the arrivals of a bin are read at its end
        proxy = _json(f"http://{control[0]}:{control[1]}/stats")
        backend = _json(demo.backend.url + "/admin/stats")
    assert proxy["faults_injected"]["error"] == 5
    assert proxy["faults_injected"]["reset"] >= 5  # a client may retry a reset connection
    # the failed attempts never reached the backend, but they are in its arrivals
    assert backend["served"] == 6
    assert sum(n for _, n in backend["arrivals"]) == proxy["requests"]
