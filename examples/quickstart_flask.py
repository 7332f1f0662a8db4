"""The README's quick start for a thread-based service: Flask at the edge, requests on the way out.

Run it: .venv/bin/python examples/quickstart_flask.py (tests/unit/test_readme.py runs it too).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from werkzeug.serving import make_server

# isort: split
# --- the ten lines the README shows ---------------------------------------------------------
import requests
from flask import Flask

from brownout import Dependency, EdgePolicy, InboundDeadlinePolicy, RetryPolicy, ThreadBulkhead
from brownout.integrations.flask import protect
from brownout.integrations.requests import BrownoutAdapter
from brownout.limits import Gradient2Limit

app = Flask(__name__)
edge = EdgePolicy(
    bulkhead=ThreadBulkhead("api", limit=Gradient2Limit(initial=8, max_limit=16)),  # < threads
    deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),  # one deadline per request
)
protect(app, edge)  # early 503s, health answered, a late handler answered 504
payments = Dependency("payments", timeout=0.8, reserve=0.05, retry=RetryPolicy(attempts=3))
session = requests.Session()
session.mount("http://", BrownoutAdapter(payments))  # remaining budget, retries under a budget
# ---------------------------------------------------------------------------------------------

PAYMENTS_URL = "http://127.0.0.1:0"  # set by main() to the fake payments service below


@app.post("/checkout")
def checkout() -> dict[str, object]:
    r = session.post(f"{PAYMENTS_URL}/charge", headers={"idempotency-key": "order-42"})
    return {"charged": r.json()}


class FakePayments(BaseHTTPRequestHandler):
    """A downstream that echoes the budget and idempotency key it received."""

    def do_POST(self) -> None:
        body = {k: self.headers.get(k) for k in ("brownout-budget-ms", "idempotency-key")}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    global PAYMENTS_URL
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log
    pay = ThreadingHTTPServer(("127.0.0.1", 0), FakePayments)
    threading.Thread(target=pay.serve_forever, daemon=True).start()
    PAYMENTS_URL = f"http://127.0.0.1:{pay.server_address[1]}"
    api = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    r = requests.post(
        f"http://127.0.0.1:{api.server_port}/checkout",
        headers={"brownout-budget-ms": "1500"},
        timeout=10,
    )
    seen = r.json()["charged"]
    # The caller gave 1.5 s; payments saw what remained minus the reserve, never a fresh timeout.
    assert 0 < int(seen["brownout-budget-ms"]) <= 800, seen
    assert seen["idempotency-key"] == "order-42"
    print("payments saw:", seen)
    api.shutdown()
    pay.shutdown()


if __name__ == "__main__":
    main()
