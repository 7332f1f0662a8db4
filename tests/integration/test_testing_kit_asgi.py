"""The testing kit's fixtures against a real service: FastAPI + BrownoutMiddleware under
uvicorn on loopback, called with httpx. A bulkhead held full by ``brownout_force`` answers
503 for sheddable work and keeps health checks up; ``brownout_events`` says what was shed and
why; a forced degraded mode is announced; everything is back to normal after the forcing."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from tests.integration.servers import serve

import brownout
from brownout import Bulkhead, DegradedMode, DegradedModes, EdgePolicy, Priority, Reason, Route
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.testing import EventRecorder, Forcing

pytestmark = pytest.mark.integration


def service() -> tuple[FastAPI, Bulkhead, DegradedModes]:
    bulkhead = Bulkhead("api", FixedLimit(8))
    modes = DegradedModes([DegradedMode("recommendations", "hide recommendations")])
    app = FastAPI()

    @app.get("/search")
    async def search() -> dict[str, object]:
        return {"recommendations": not modes.active("recommendations")}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(
        BrownoutMiddleware,
        policy=EdgePolicy(
            bulkhead=bulkhead,
            degraded=modes,
            health_paths=("/health",),
            routes={"/search": Route(priority=Priority.SHEDDABLE)},
        ),
    )
    return app, bulkhead, modes


async def test_a_forced_full_bulkhead_sheds_over_real_http(
    brownout_events: EventRecorder, brownout_force: Forcing
) -> None:
    app, bulkhead, modes = service()
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.get("/search")).status_code == 200
        brownout_events.assert_not_shed()

        brownout_force.full(bulkhead)
        refused = await client.get("/search")
        assert refused.status_code == 503, refused.text
        assert (await client.get("/health")).status_code == 200  # CRITICAL_PLUS: the reserve
        (shed,) = brownout_events.assert_shed(
            reason=Reason.QUEUE_FULL, operation="/search", priority=Priority.SHEDDABLE, count=1
        )
        assert shed.source == "api" and not shed.false_positive
        brownout_events.assert_not_shed(operation="/health")

        brownout_force.restore()
        assert (await client.get("/search")).status_code == 200
        assert brownout_events.shed_counts() == {Reason.QUEUE_FULL: 1}

        brownout_force.mode(modes, "recommendations")
        degraded = await client.get("/search")
        assert degraded.status_code == 200
        assert degraded.json() == {"recommendations": False}
        assert "recommendations" in degraded.headers.get("brownout-degraded", "")
    assert bulkhead.in_flight == 0
    assert brownout_events in brownout.events.hub.sinks
