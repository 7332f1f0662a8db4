"""Review of degradation (G1-G4), local overload signals (A7) and exporters (O1-O5): defects
found by reading the code, each pinned by a test on virtual time (looptime)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from brownout import (
    Bulkhead,
    DegradedMode,
    DegradedModes,
    EventHub,
    FifoQueue,
    FixedLimit,
    OverloadManager,
    Priority,
    StaleCache,
)
from brownout.events import Event, OverloadLevelChanged
from brownout.overload import FunctionSignal


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


@pytest.mark.looptime
async def test_hung_background_refresh_does_not_block_the_key_forever() -> None:
    """G1/D5: with the default ``load_timeout=None`` a background refresh that hangs must not
    pin the key: once the value is too old, callers join that refresh; when they all give up
    it is cancelled, and the next caller loads again (the origin has recovered by then)."""
    c: StaleCache[str, str] = StaleCache(max_entries=10, fresh_for=1.0, max_staleness=5.0)
    state = {"hang": False, "calls": 0}

    async def loader() -> str:
        state["calls"] += 1
        n = state["calls"]
        if state["hang"]:
            await asyncio.Event().wait()  # a black-holed connection: never answers
        return f"v{n}"

    assert (await c.get("k", loader)).value == "v1"
    await asyncio.sleep(2)
    state["hang"] = True
    assert (await c.get("k", loader)).value == "v1"  # stale: one background refresh, hung
    await asyncio.sleep(10)  # now older than max_staleness: nothing may be served from memory
    state["hang"] = False  # the origin is back
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await c.get("k", loader)  # joins the hung refresh, gives up
    async with asyncio.timeout(1):
        served = await c.get("k", loader)  # must load again, not wait on the hung refresh
    assert served.value == "v3"


@pytest.mark.looptime
async def test_stopped_overload_manager_stops_shedding() -> None:
    """A7: a stopped manager reads no signal any more; it must not keep shedding at the level
    it last saw (nothing would ever lower it), and its subscribers must hear the level drop."""
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    pressure = {"x": 1.0}
    m = OverloadManager([FunctionSignal("x", lambda: pressure["x"])], interval=0.25, events=hub)
    api = Bulkhead("api", FixedLimit(4), FifoQueue(4, 1.0))
    m.attach(api)
    async with m:
        await asyncio.sleep(0.5)
        assert m.level == 3
    assert m.level == 0 and m.shed_below == 0
    async with api.admit(priority=Priority.SHEDDABLE):  # not refused as OVERLOADED
        pass
    changes = [(e.old, e.new) for e in rec.events if isinstance(e, OverloadLevelChanged)]
    assert changes[-1] == (3, 0)


@pytest.mark.looptime
async def test_discarded_modes_registry_stops_polling_and_announcing() -> None:
    """G2: the loop timer of a registry nobody holds any more must not keep it alive, polling
    its predicates and emitting mode changes for ever (a reconfigured service leaks one per
    reload)."""
    hub = EventHub()
    rec = Recorder()
    hub.subscribe(rec)
    calls: list[float] = []
    flag = {"on": False}

    def signal() -> bool:
        calls.append(asyncio.get_running_loop().time())
        return flag["on"]

    modes = DegradedModes(
        [DegradedMode("m", "hide m", enter_when=signal, poll_interval=0.1)], events=hub
    )
    await asyncio.sleep(0.35)
    assert calls  # polled while in use
    del modes
    gc.collect()
    seen = len(calls)
    flag["on"] = True
    await asyncio.sleep(1.0)
    assert len(calls) == seen
    assert rec.events == []
