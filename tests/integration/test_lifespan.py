"""Background work starts and stops with real servers: a Starlette app under uvicorn with
`starlette_lifespan`, an aiohttp app with `aiohttp_cleanup_ctx`; and `Background`'s stop is
clean, bounded and idempotent on a real loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from tests.integration.servers import serve_aiohttp

from brownout import DegradedMode, DegradedModes, OverloadManager
from brownout.integrations.lifespan import Background, aiohttp_cleanup_ctx, starlette_lifespan
from brownout.signals import EventLoopLag, FunctionSignal, LoopLag

pytestmark = pytest.mark.integration


class Counted:
    """A signal that counts its reads: the manager's periodic task is what reads it."""

    def __init__(self) -> None:
        self.reads = 0
        self.signal = FunctionSignal("counted", self._read)

    def _read(self) -> float:
        self.reads += 1
        return 0.0


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def brownout_tasks() -> list[asyncio.Task[Any]]:
    return [
        t
        for t in asyncio.all_tasks()
        if t.get_name().startswith("brownout:") or t.get_name() == "lifespan-test"
    ]


@contextlib.asynccontextmanager
async def serve_with_lifespan(app: Any) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """uvicorn with its lifespan on, shut down gracefully (a forced exit skips the lifespan's
    shutdown)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or task.done())
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


def parts() -> tuple[Counted, OverloadManager, EventLoopLag, DegradedModes]:
    counted = Counted()
    lag = EventLoopLag(interval=0.05)
    manager = OverloadManager([counted.signal, lag], interval=0.05, name="lifespan-test")
    modes = DegradedModes([DegradedMode("recs", "cached recommendations", enter_at_level=1)])
    return counted, manager, lag, modes


async def test_starlette_lifespan_runs_the_manager_while_serving() -> None:
    counted, manager, lag, modes = parts()
    entered: list[str] = []

    @contextlib.asynccontextmanager
    async def own(app: Any) -> AsyncIterator[dict[str, str]]:
        entered.append("up")
        yield {"greeting": "hello"}
        entered.append("down")

    async def home(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.state.greeting)

    lifespan = starlette_lifespan(manager, lambda: modes.run(0.05), inner=own)
    app = Starlette(routes=[Route("/", home)], lifespan=lifespan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with serve_with_lifespan(app) as (url, _server):
            await wait_for(lambda: counted.reads >= 5)
            assert lag.running
            assert len(brownout_tasks()) == 2  # the manager's tick and the modes' loop
            async with httpx.AsyncClient() as client:
                response = await client.get(url + "/")
            assert response.text == "hello"
        assert entered == ["up", "down"]
        assert not lag.running
        assert brownout_tasks() == []
        reads = counted.reads
        await asyncio.sleep(0.3)
        assert counted.reads == reads, "the manager still ticks after shutdown"
        gc.collect()


async def test_aiohttp_cleanup_ctx_runs_the_manager_while_serving() -> None:
    counted, manager, lag, modes = parts()

    async def home(request: web.Request) -> web.Response:
        return web.Response(text=str(manager.level))

    app = web.Application()
    app.router.add_get("/", home)
    probe = LoopLag()  # the bulkheads' shared probe: started and stopped on its own
    app.cleanup_ctx.append(aiohttp_cleanup_ctx(manager, probe, lambda: modes.run(0.05)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with serve_aiohttp(app) as url:
            await wait_for(lambda: counted.reads >= 5)
            assert lag.running
            assert len(brownout_tasks()) == 2
            async with httpx.AsyncClient() as client:
                response = await client.get(url + "/")
            assert response.text == "0"
            assert probe.running
        assert not lag.running and not probe.running
        assert brownout_tasks() == []
        reads = counted.reads
        await asyncio.sleep(0.3)
        assert counted.reads == reads
        gc.collect()


async def test_stop_is_bounded_idempotent_and_reports_a_crashed_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="brownout.lifespan")  # whatever the root's level
    released = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await released.wait()  # ignores the first cancel until the test lets it go

    async def crashes() -> None:
        raise RuntimeError("probe broke")

    background = Background(stubborn, crashes, stop_timeout=0.2)
    await background.stop()  # before start: nothing
    await background.start()
    await background.start()  # idempotent
    assert len(background.tasks) == 2
    stubborn_task = background.tasks[0]
    await asyncio.sleep(0.05)
    began = time.monotonic()
    await background.stop()
    assert time.monotonic() - began < 3.0  # bounded by stop_timeout (0.2 s), generous margin
    assert not background.running and background.tasks == []
    assert "did not stop within" in caplog.text
    assert "probe broke" in caplog.text or "had failed" in caplog.text
    await background.stop()  # idempotent
    released.set()
    await asyncio.wait_for(stubborn_task, 5)


def test_background_refuses_what_it_cannot_run() -> None:
    with pytest.raises(TypeError, match="start"):
        Background(42)
    with pytest.raises(ValueError, match="stop_timeout"):
        Background(stop_timeout=0)
