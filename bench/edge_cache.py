"""Why the in-process edge overhead is larger inside FastAPI: the middleware's cost in cache.

`bench/edge_instructions.py` counts the same ~28.7k instructions added by `BrownoutMiddleware`
per request around a no-op ASGI app and around a trivial FastAPI endpoint, yet in time the
middleware adds ~2 us to the first and ~6 us to the second (`bench/edge_bench.py`). This
checks the explanation that the difference is the cost of those instructions, not their
number: FastAPI's ~30 us of work between the middleware's two halves pushes the middleware's
code and data out of the CPU caches, so they are fetched again on every request.

The app here is the no-op app of `edge_bench.py` that, between its two ``send`` calls, sweeps
``K`` KB of data through the caches (a copy of ``K`` KB and a walk over ``16 * K`` objects),
as a framework's own work would. The middleware executes the same instructions for every
``K``; the time it adds is printed per ``K``. If it rises with ``K``, the overhead is memory
bound, and fewer instructions alone will not bring it down.

    flock /tmp/brownout-bench.lock .venv/bin/python bench/edge_cache.py
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from edge_bench import _BODY, _START, App, per_request

from brownout import Bulkhead, EdgePolicy
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit

REPS = 9
SIZES_KB = (0, 128, 256, 512, 1024)


def sweeping_app(kb: int) -> App:
    dirty = bytearray(kb * 1024)
    source = bytes(kb * 1024)
    objects = [object() for _ in range(kb * 16)]

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await send(_START)
        dirty[:] = source
        for _ in objects:
            pass
        await send(_BODY)

    return app


async def main() -> None:
    print("no-op app sweeping K KB between response start and body; best of", REPS, "rounds")
    for kb in SIZES_KB:
        bare = sweeping_app(kb)
        protected = BrownoutMiddleware(
            bare, policy=EdgePolicy(bulkhead=Bulkhead("api", FixedLimit(1000)))
        )
        await per_request(bare, "/hello", 200)
        await per_request(protected, "/hello", 200)
        n = max(500, 4_000 * 64 // max(kb, 64))
        best_bare = best_mw = float("inf")
        for _ in range(REPS):
            best_bare = min(best_bare, await per_request(bare, "/hello", n))
            best_mw = min(best_mw, await per_request(protected, "/hello", n))
        print(
            f"K = {kb:5d} KB: bare {best_bare * 1e6:7.1f} us, with middleware "
            f"{best_mw * 1e6:7.1f} us, the middleware adds {(best_mw - best_bare) * 1e6:4.2f} us"
        )


if __name__ == "__main__":
    asyncio.run(main())
