"""The README's quick start: a FastAPI service protected at the edge and on its way out.

Run it: .venv/bin/python examples/quickstart.py (tests/unit/test_readme.py runs it too).
"""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse

# isort: split
# --- the ten lines the README shows ---------------------------------------------------------
import httpx
from fastapi import FastAPI

from brownout import Bulkhead, Dependency, EdgePolicy, InboundDeadlinePolicy, RetryPolicy
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.integrations.httpx import BrownoutTransport
from brownout.limits import Gradient2Limit

app = FastAPI()
edge = EdgePolicy(
    bulkhead=Bulkhead("api", limit=Gradient2Limit()),  # adaptive limit, early 503s
    deadline=InboundDeadlinePolicy(default=2.0, maximum=5.0),  # one deadline per request
)
app.add_middleware(BrownoutMiddleware, policy=edge)
payments = Dependency("payments", timeout=0.8, reserve=0.05, retry=RetryPolicy(attempts=3))
transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=payments)
client = httpx.AsyncClient(transport=transport)  # remaining budget, retries under a budget
# ---------------------------------------------------------------------------------------------

PAYMENTS_URL = "http://127.0.0.1:0"  # set by main() to the fake payments service below


@app.post("/checkout")
async def checkout() -> dict[str, object]:
    r = await client.post(f"{PAYMENTS_URL}/charge", headers={"idempotency-key": "order-42"})
    return {"charged": r.json()}


async def fake_payments(scope, receive, send):  # type: ignore[no-untyped-def]
    """A downstream that echoes the budget and idempotency key it received."""
    request = Request(scope, receive)
    body = {k: request.headers.get(k) for k in ("brownout-budget-ms", "idempotency-key")}
    await JSONResponse(body)(scope, receive, send)


async def serve(asgi_app):  # type: ignore[no-untyped-def]
    server = uvicorn.Server(uvicorn.Config(asgi_app, port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def main() -> None:
    global PAYMENTS_URL
    pay_server, pay_task, pay_port = await serve(fake_payments)
    PAYMENTS_URL = f"http://127.0.0.1:{pay_port}"
    api_server, api_task, api_port = await serve(app)
    async with httpx.AsyncClient() as caller:
        r = await caller.post(
            f"http://127.0.0.1:{api_port}/checkout", headers={"brownout-budget-ms": "1500"}
        )
    seen = r.json()["charged"]
    # The caller gave 1.5 s; payments saw what remained minus the reserve, never a fresh timeout.
    assert 0 < int(seen["brownout-budget-ms"]) <= 800, seen
    assert seen["idempotency-key"] == "order-42"
    print("payments saw:", seen)
    for server in (api_server, pay_server):
        server.should_exit = True
    await asyncio.gather(api_task, pay_task)
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
