"""Start and stop brownout's background work with the server: a Starlette/FastAPI lifespan
and an aiohttp cleanup context, both around `Background`.

What runs in the background: objects with ``start()``/``stop()`` (`brownout.OverloadManager`,
the probes in `brownout.signals`, `brownout.signals.LoopLag`), started in order and stopped in
reverse; and loops given as functions that return a coroutine (``DegradedModes.run``,
``Reconciler.run``, ``ShedLog.run``), run as tasks and cancelled at stop. Stopping
is bounded by ``stop_timeout`` and idempotent. Nothing here decides anything; no framework
is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

__all__ = ["Background", "aiohttp_cleanup_ctx", "starlette_lifespan"]

_log = logging.getLogger("brownout.lifespan")


def _startable(service: object) -> bool:
    return callable(getattr(service, "start", None)) and callable(getattr(service, "stop", None))


class Background:
    """Background work started and stopped together (``async with``, or `start`/`stop`).

    Each of ``services`` is an object with ``start()`` and ``stop()`` (either may be a
    coroutine function) or a function returning a coroutine to run as a task until stopped.
    `stop` cancels the tasks and awaits them, then stops the objects in reverse order, each
    step bounded by ``stop_timeout`` seconds (what overruns is logged and left); a task that
    crashed earlier has its exception logged. Calling `stop` twice, or before `start`, does
    nothing.
    """

    def __init__(
        self, *services: object | Callable[[], Coroutine[Any, Any, Any]], stop_timeout: float = 5.0
    ) -> None:
        if not stop_timeout > 0:  # NaN too
            raise ValueError("stop_timeout must be > 0")
        for s in services:
            if not _startable(s) and not callable(s):
                raise TypeError(
                    f"{s!r} has no start()/stop() and is not a function returning a coroutine"
                )
        self.services = services
        self.stop_timeout = stop_timeout
        self.tasks: list[asyncio.Task[Any]] = []
        self._started: list[object] = []
        self._running = False

    @property
    def running(self) -> bool:
        """Started and not stopped since."""
        return self._running

    async def start(self) -> None:
        """Start every service (idempotent); if one fails to start, stop those started."""
        if self._running:
            return
        self._running = True
        loop = asyncio.get_running_loop()
        try:
            for s in self.services:
                service: Any = s
                if _startable(service):
                    result = service.start()
                    if inspect.isawaitable(result):
                        await result
                    self._started.append(service)
                else:
                    name = getattr(s, "__qualname__", None) or repr(s)
                    coro = service()
                    self.tasks.append(loop.create_task(coro, name=f"brownout:{name}"))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Cancel and await the tasks, then stop the objects in reverse order (idempotent)."""
        if not self._running:
            return
        self._running = False
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.stop_timeout)
            for task in tasks:
                if task in pending:
                    _log.warning("%s did not stop within %ss", task.get_name(), self.stop_timeout)
                elif not task.cancelled() and task.exception() is not None:
                    _log.error("%s had failed", task.get_name(), exc_info=task.exception())
        started, self._started = self._started, []
        for s in reversed(started):
            service: Any = s
            try:
                result = service.stop()
                if inspect.isawaitable(result):
                    await asyncio.wait_for(result, self.stop_timeout)
            except TimeoutError:
                _log.warning("%r did not stop within %ss", s, self.stop_timeout)
            except Exception:
                _log.exception("%r failed to stop", s)

    async def __aenter__(self) -> Background:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def starlette_lifespan(
    *services: object | Callable[[], Coroutine[Any, Any, Any]],
    inner: Callable[[Any], contextlib.AbstractAsyncContextManager[Any]] | None = None,
    stop_timeout: float = 5.0,
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]:
    """A lifespan for ``Starlette(lifespan=...)`` or ``FastAPI(lifespan=...)`` that runs
    ``services`` (see `Background`) while the app serves. ``inner``: the app's own lifespan,
    entered after the services start and left before they stop; its state is passed on."""
    background = Background(*services, stop_timeout=stop_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with background:
            if inner is None:
                yield None
            else:
                async with inner(app) as state:
                    yield state

    lifespan.background = background  # type: ignore[attr-defined]
    return lifespan


def aiohttp_cleanup_ctx(
    *services: object | Callable[[], Coroutine[Any, Any, Any]],
    stop_timeout: float = 5.0,
) -> Callable[[Any], AsyncIterator[None]]:
    """For ``app.cleanup_ctx.append(...)`` of an aiohttp ``web.Application``: runs
    ``services`` (see `Background`) from startup to cleanup."""
    background = Background(*services, stop_timeout=stop_timeout)

    async def ctx(app: Any) -> AsyncIterator[None]:
        async with background:
            yield

    ctx.background = background  # type: ignore[attr-defined]
    return ctx
