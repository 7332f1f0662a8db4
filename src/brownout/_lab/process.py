"""Run the load generator in its own process, pinned to its own core.

The generator must not share an event loop, or ideally a core, with the servers it measures;
`GeneratorProcess` starts a spawned worker that installs uvloop, pins itself with
`os.sched_setaffinity`, and runs plans and calibrations sent over a pipe, streaming progress
back while it works.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .generator import Calibration, LoadPlan, PlanResult, calibrate, run_plan

__all__ = ["GeneratorProcess", "pin_to", "usable_cpus"]


def usable_cpus() -> list[int]:
    """The cores this process may run on (all of them where affinity is unsupported)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return list(range(os.cpu_count() or 1))


def pin_to(cpus: list[int] | None) -> None:
    """Pin the calling process to ``cpus`` (ignored where unsupported or not allowed)."""
    if not cpus:
        return
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.sched_setaffinity(0, set(cpus))


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _worker(conn: Connection, cpus: list[int] | None) -> None:
    pin_to(cpus)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "stop":
                return
            try:
                if command == "run":

                    def progress(step: int, elapsed: float, counts: dict[str, int]) -> None:
                        conn.send(("progress", (step, elapsed, counts)))

                    # A full collection can stall the loop for milliseconds, which would show
                    # up as generator lateness; nothing here lives long enough to need it.
                    gc.disable()
                    try:
                        result: Any = loop.run_until_complete(run_plan(args, progress))
                    finally:
                        gc.enable()
                        gc.collect()
                elif command == "calibrate":
                    result = loop.run_until_complete(calibrate(**args))
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("result", result))
            except Exception as e:  # report, keep serving
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        loop.close()


class GeneratorProcess:
    """A load generator in a separate, pinned process. Use as a context manager."""

    def __init__(self, cpus: list[int] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, cpus), daemon=True)
        self._proc.start()
        child.close()

    def __enter__(self) -> GeneratorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        command: str,
        args: Any,
        progress: Callable[[int, float, dict[str, int]], None] | None,
    ) -> Any:
        self._conn.send((command, args))
        while True:
            if not self._conn.poll(600):
                raise RuntimeError("the load generator stopped answering")
            kind, payload = self._conn.recv()
            if kind == "progress":
                if progress is not None:
                    progress(*payload)
            elif kind == "result":
                return payload
            else:
                raise RuntimeError(f"load generator failed: {payload}")

    def run(
        self,
        plan: LoadPlan,
        progress: Callable[[int, float, dict[str, int]], None] | None = None,
    ) -> PlanResult:
        """Run ``plan`` in the worker; ``progress`` is called from this process as it goes."""
        result: PlanResult = self._call("run", plan, progress)
        return result

    def calibrate(self, **kwargs: Any) -> Calibration:
        """Run `brownout._lab.generator.calibrate` in the worker."""
        result: Calibration = self._call("calibrate", kwargs, None)
        return result

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("stop", None))
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._conn.close()
