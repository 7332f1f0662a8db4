"""A FastAPI service for several worker processes (uvicorn ``--workers``, gunicorn), set up as
docs/observability.md says: brownout's metrics and the application's own prometheus_client
metrics summed over workers through ``PROMETHEUS_MULTIPROC_DIR``. Every response names the
worker that answered it (``x-pid``), scrapes included."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.multiprocess import MultiProcessCollector

from brownout import Bulkhead, EdgePolicy, Stats
from brownout.events import hub
from brownout.export.prometheus import mount_metrics, register_multiprocess
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

WORK = Counter("app_work", "Requests the application's handler ran.")

stats = hub.subscribe(Stats())
registry = CollectorRegistry()
MultiProcessCollector(registry)  # the application's own metrics, from every worker
register_multiprocess(stats, registry, period=float(os.environ.get("PUBLISH_PERIOD", "0.2")))

api = FastAPI()


@api.get("/work")
async def work() -> dict[str, int]:
    WORK.inc()
    return {"pid": os.getpid()}


@api.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


api.add_middleware(BrownoutMiddleware, policy=EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(64))))
mount_metrics(api, registry=registry)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    async def named(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            pid = str(os.getpid()).encode()
            message = {**message, "headers": [*message.get("headers", ()), (b"x-pid", pid)]}
        await send(message)

    await api(scope, receive, named if scope["type"] == "http" else send)
