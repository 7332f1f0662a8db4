"""Many real threads through the WSGI edge at once: every request is counted exactly once.

16 threads send 500 requests each through a Flask app behind the middleware, on a route held
by a small `ThreadBulkhead` (so some wait and some are shed), on an unguarded route, and with
a reader thread scraping `Stats` all along (flushing the bulkhead's ledger from another
thread, as a Prometheus server thread does). The counts must add up to the answers sent.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

from flask import Flask, Response

import brownout
from brownout import EdgePolicy, Route, ThreadBulkhead
from brownout.events import EventHub
from brownout.integrations.flask import protect
from brownout.limits import FixedLimit
from brownout.queues import FifoQueue

THREADS = 16
REQUESTS = 500
JOIN = 300.0


def make_app(hub: EventHub) -> Flask:
    bulkhead = ThreadBulkhead(
        "stress", FixedLimit(4), FifoQueue(max_size=4, max_wait=0.05), reserve=0, events=hub
    )
    policy = EdgePolicy(
        routes={"/guarded/<int:n>": Route(default=5.0, bulkhead=bulkhead)}, events=hub
    )
    app = Flask(__name__)

    @app.get("/guarded/<int:n>")
    def guarded(n: int) -> Response | tuple[str, int]:
        kind = n % 4
        if kind == 1:
            return "broken", 500
        if kind == 2:
            raise ValueError("boom")  # Flask answers 500
        if kind == 3:

            def chunks() -> Iterator[str]:
                yield "a"
                time.sleep(random.random() * 0.002)
                yield "b"

            return Response(chunks())
        time.sleep(random.random() * 0.002)
        return "ok", 200

    @app.get("/open/<int:n>")
    def open_route(n: int) -> str:
        return "ok"

    protect(app, policy)
    return app


def test_every_request_is_counted_exactly_once_under_many_threads() -> None:
    hub = EventHub()
    stats = brownout.Stats()
    hub.subscribe(stats)
    app = make_app(hub)
    statuses: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        mine: Counter[tuple[str, int]] = Counter()
        with app.test_client() as c:
            for _ in range(REQUESTS):
                route = "open" if rng.random() < 0.2 else "guarded"
                r = c.get(f"/{route}/{rng.randrange(1000)}")
                r.get_data()  # drain and close the body (streams settle on close)
                r.close()
                mine[(route, r.status_code)] += 1
        with lock:
            statuses.update(mine)

    def scraper() -> None:
        while not stop.is_set():
            stats.count("completed")  # flushes the ledger from this thread
            time.sleep(0.001)

    def guard(fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException as e:  # reported below: a thread's error would be lost
            errors.append(e)

    reader = threading.Thread(target=guard, args=(scraper,))
    reader.start()
    threads = [threading.Thread(target=guard, args=(client, s)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    stop.set()
    reader.join(JOIN)
    assert not errors
    assert sum(statuses.values()) == THREADS * REQUESTS

    guarded = {s: n for (r, s), n in statuses.items() if r == "guarded"}
    opened = {s: n for (r, s), n in statuses.items() if r == "open"}
    assert set(guarded) <= {200, 500, 503}
    assert set(opened) == {200}

    def count(kind: str, op: str) -> int:
        return stats.count(kind, operation=op)

    op = "/guarded/<int:n>"
    offered, admitted, shed = count("offered", op), count("admitted", op), count("shed", op)
    ended = count("completed", op) + count("completed_late", op)
    ended += count("failed", op) + count("expired", op) + count("abandoned", op)
    assert offered == sum(guarded.values())
    assert offered == admitted + shed
    assert shed == guarded.get(503, 0)
    assert ended == admitted
    assert count("failed", op) == guarded.get(500, 0)
    assert count("completed", op) + count("completed_late", op) == guarded.get(200, 0)
    # Every success within its deadline left one latency sample: none lost to a flush.
    assert stats.latency(operation=op).count == count("completed", op)

    unguarded = "/open/<int:n>"
    assert count("offered", unguarded) == count("admitted", unguarded) == opened[200]
    assert count("completed", unguarded) == opened[200]
    assert stats.latency(operation=unguarded).count == opened[200]
