"""The lab scenario "database": a front whose queries meet a slow PostgreSQL (issue 29, item 5).

Requests arrive open loop at ``load`` times the database's capacity at normal speed (a pool of
``pool_size`` connections, each query ``work`` seconds: ``pool_size / work`` queries per
second), each with a client deadline. Mid-run the database slows: a session of the lab holds
an exclusive advisory lock that every query takes in shared mode, ``hold`` seconds at a time
with ``gap`` seconds free between, for ``slow`` seconds; then it lets go for good. Two
configurations of the front (`brownout._lab.database_service`), each on a fresh process:

- ``unprotected``: a plain asyncpg pool, an unbounded wait for a connection, no statement
  timeout;
- ``brownout``: `BrownoutMiddleware` and `BrownoutPool` (the pool as admission, the statement
  timeout from the budget, the server told to cancel at the deadline).

Per second (of sending): goodput (200 within the deadline), refusals by reason, client
timeouts, p99 of the successes, the pool wait's p99 (from the front, waits of callers who
left included), and from ``pg_stat_activity`` (sampled every ``sample_every`` seconds on the
lab's own connection) the lab's queries running on the server and how many of those run for
a caller who already gave up (each query's SQL comment carries its caller's give-up time).

Invariants (brownout): no query of the lab runs on the server more than ``overrun_limit``
seconds past its caller's deadline; the pool wait's p99 stays within the queue age bound
(plus ``wait_slack``); goodput is back to 90% of its level before the slowdown within
``recover_within`` seconds of its end; and during the slowdown brownout's goodput is at least
the unprotected front's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from .database_service import GIVE_UP_HEADER, QUERY_TAG, parse_tag

__all__ = [
    "DATABASE",
    "DATABASE_COLUMNS",
    "DATABASE_SECONDS_COLUMNS",
    "DATABASE_TITLE",
    "DatabaseSettings",
    "DatabaseUnavailable",
    "Outcome",
    "Sample",
    "database_checks",
    "database_description",
    "database_rows",
    "database_runs",
    "database_seconds",
    "quick_settings",
    "recovery_seconds",
    "run_database",
    "sample_queries",
    "summarize_seconds",
]

DATABASE = "database"
"""The scenario's name for ``brownout lab --scenarios``."""
CONFIGS = ("unprotected", "brownout")
RECOVERED_SHARE = 0.9
"""Goodput counts as recovered at this share of its level before the slowdown."""


class DatabaseUnavailable(RuntimeError):
    """PostgreSQL did not answer (or a driver is missing): the scenario cannot run."""


@dataclass(frozen=True)
class DatabaseSettings:
    """Timing of the scenario. The defaults take about 65 s in all (two configurations)."""

    dsn: str = "postgresql://postgres@127.0.0.1:5432/test"
    pool_size: int = 8
    work: float = 0.1
    """Seconds one query takes at normal speed."""
    load: float = 0.7
    """Offered load, as a share of the database's capacity at normal speed."""
    deadline: float = 1.0
    """The client's deadline per request (it gives up then)."""
    max_wait: float = 0.25
    """The brownout pool's queue age bound."""
    before: float = 8.0
    slow: float = 10.0
    after: float = 10.0
    hold: float = 1.5
    """Seconds the lab holds the lock at a time during the slowdown."""
    gap: float = 0.5
    """Seconds the lock is free between two holds."""
    sample_every: float = 0.2
    overrun_limit: float = 1.0
    """Seconds past its caller's deadline a query may still run on the server (brownout)."""
    wait_slack: float = 0.1
    """Scheduling slack over ``max_wait`` for the pool wait's p99."""
    recover_within: float = 3.0
    settle: float = 2.0
    """Seconds after the last request before the front's figures are read."""

    @property
    def capacity(self) -> float:
        """Queries per second the pool serves at normal speed."""
        return self.pool_size / self.work

    @property
    def rate(self) -> float:
        return self.load * self.capacity

    @classmethod
    def quick(cls) -> DatabaseSettings:
        return cls(before=4.0, slow=6.0, after=6.0, settle=1.5)


def quick_settings(s: DatabaseSettings) -> DatabaseSettings:
    """``s`` with the quick timings, keeping its server."""
    return replace(DatabaseSettings.quick(), dsn=s.dsn)


# -- what the lab observes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at ``pg_stat_activity``: the lab's queries running on the server."""

    at: float
    """Seconds since the run's start."""
    running: int
    gone: int
    """Of those, the ones whose caller already gave up."""
    overrun: float
    """The longest a running query's caller has been gone (seconds; 0 when none is)."""


def sample_queries(queries: Sequence[str], run: str, now: float, start: float) -> Sample:
    """A `Sample` from the texts of the active queries (``now``, ``start``: the lab's
    ``time.monotonic()``); queries that are not this run's are left out."""
    running = gone = 0
    overrun = 0.0
    for text in queries:
        tag = parse_tag(text)
        if tag is None or tag[0] != run:
            continue
        running += 1
        past = now - tag[1]
        if past > 0:
            gone += 1
            overrun = max(overrun, past)
    return Sample(round(now - start, 3), running, gone, round(overrun, 3))


@dataclass
class Outcome:
    sent: float
    """Seconds since the run's start."""
    kind: str
    """``ok``, ``late``, ``timeout``, ``refused:<reason>`` or ``error``."""
    latency: float


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def summarize_seconds(
    outcomes: Sequence[Outcome],
    waits: Sequence[tuple[float, float]],
    samples: Sequence[Sample],
    seconds: int,
) -> list[dict[str, Any]]:
    """Per second of the run (by sending time; ``waits``: (start since the run's start, wait)
    by the acquisition's start): the figures of the scenario's per-second table."""
    out: list[dict[str, Any]] = []
    for i in range(seconds):
        mine = [o for o in outcomes if i <= o.sent < i + 1]
        kinds = Counter(o.kind for o in mine)
        refused = {k.split(":", 1)[1]: n for k, n in sorted(kinds.items()) if ":" in k}
        waited = [w for s, w in waits if i <= s < i + 1]
        looks = [s for s in samples if i <= s.at < i + 1]
        # Connections waited for at once: acquisitions started and not done at the second's end.
        end = i + 1
        out.append(
            {
                "second": i,
                "offered": len(mine),
                "goodput": kinds["ok"],
                "late": kinds["late"],
                "timeouts": kinds["timeout"],
                "errors": kinds["error"],
                "refused": refused,
                "p99_ms": _ms(_p99([o.latency for o in mine if o.kind == "ok"])),
                "pool_wait_p99_ms": _ms(_p99(waited)),
                "pool_waiters": sum(1 for s, w in waits if s < end < s + w),
                "running_max": max((s.running for s in looks), default=0),
                "gone_max": max((s.gone for s in looks), default=0),
                "overrun_max": max((s.overrun for s in looks), default=0.0),
            }
        )
    return out


def recovery_seconds(goodput: Sequence[int], before: int, slow_end: int) -> float | None:
    """Seconds after the slowdown's end (``slow_end``, an index) from which every second's
    goodput is at least `RECOVERED_SHARE` of the mean over the seconds before the slowdown
    (the first left out: warm-up); None when it never is to the end."""
    base = goodput[1:before] or goodput[:before]
    if not base or slow_end >= len(goodput):
        return None
    level = RECOVERED_SHARE * sum(base) / len(base)
    for k in range(slow_end, len(goodput)):
        if all(g >= level for g in goodput[k:]):
            return float(k - slow_end)
    return None


# -- processes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _front(mode: str, s: DatabaseSettings, key: int, run: str) -> Iterator[str]:
    """The front in ``mode`` on a fresh process; yields its URL; stopped on exit."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "brownout._lab.database_service",
            "--mode",
            mode,
            "--dsn",
            s.dsn,
            "--pool-size",
            str(s.pool_size),
            "--work",
            str(s.work),
            "--max-wait",
            str(s.max_wait),
            "--lock-key",
            str(key),
            "--run",
            run,
            "--parent-pid",
            str(os.getpid()),
        ],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"database front ({mode}) did not start (said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        proc.stdout.close()


# -- one run -----------------------------------------------------------------------------------


async def _connect(dsn: str) -> Any:
    try:
        import aiohttp  # noqa: F401  (the client the scenario drives the front with)
        import asyncpg
    except ImportError as e:
        raise DatabaseUnavailable(
            f"the database scenario needs asyncpg and aiohttp ({e.name} is missing)"
        ) from e
    try:
        return await asyncio.wait_for(asyncpg.connect(dsn), 5)
    except Exception as e:
        raise DatabaseUnavailable(
            f"PostgreSQL at {dsn} did not answer ({type(e).__name__}: {e}); start it "
            "(e.g. `service postgresql start`: trust auth on loopback, a database named test) "
            "or leave out --scenarios database"
        ) from e


async def _slow_down(conn: Any, s: DatabaseSettings, key: int, start: float) -> None:
    """Hold the lock ``hold`` s at a time, ``gap`` s apart, from ``before`` for ``slow`` s."""
    await asyncio.sleep(max(0.0, start + s.before - time.monotonic()))
    end = start + s.before + s.slow
    try:
        while time.monotonic() < end:
            await conn.execute("SELECT pg_advisory_lock($1::bigint)", key)
            try:
                await asyncio.sleep(max(0.0, min(s.hold, end - time.monotonic())))
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1::bigint)", key)
            await asyncio.sleep(max(0.0, min(s.gap, end - time.monotonic())))
    finally:
        if not conn.is_closed():
            await conn.execute("SELECT pg_advisory_unlock_all()")


_ACTIVE = (
    "SELECT query FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
    "AND query LIKE $1"
)


async def _sample(
    conn: Any, s: DatabaseSettings, run: str, start: float, until: float
) -> list[Sample]:
    out: list[Sample] = []
    pattern = f"%{QUERY_TAG} run={run}%"
    while time.monotonic() < until:
        rows = await conn.fetch(_ACTIVE, pattern)
        out.append(sample_queries([r[0] for r in rows], run, time.monotonic(), start))
        await asyncio.sleep(s.sample_every)
    return out


async def _reason(response: Any) -> str:
    try:
        doc = await response.json(content_type=None)
        reason = str(doc.get("reason", ""))
    except Exception:
        reason = ""
    return reason.rsplit("/", 1)[-1].rsplit(":", 1)[-1] or f"http_{response.status}"


async def _drive(s: DatabaseSettings, url: str, start: float) -> list[Outcome]:
    import aiohttp

    from brownout.wire import BUDGET_HEADER

    n = int(s.rate * (s.before + s.slow + s.after))
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=s.deadline)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one(at: float) -> None:
            sent = time.monotonic()
            headers = {
                BUDGET_HEADER: str(round(s.deadline * 1000)),
                GIVE_UP_HEADER: f"{sent + s.deadline:.3f}",
            }
            try:
                async with http.get(url + "/api/query", headers=headers) as r:
                    await r.read()
                    took = time.monotonic() - sent
                    if r.status == 200:
                        kind = "ok" if took <= s.deadline else "late"
                    elif r.status in (429, 503, 504):
                        kind = f"refused:{await _reason(r)}"
                    else:
                        kind = "error"
            except TimeoutError:
                kind, took = "timeout", time.monotonic() - sent
            except aiohttp.ClientError:
                kind, took = "error", time.monotonic() - sent
            outcomes.append(Outcome(round(at, 4), kind, took))

        tasks = []
        for i in range(n):
            at = i / s.rate
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(at)))
        await asyncio.gather(*tasks)
    return outcomes


async def _pool_waits(url: str, start: float) -> list[tuple[float, float]]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/lab/pool", timeout=aiohttp.ClientTimeout(total=10)) as r,
    ):
        doc = await r.json()
    return [(st - start, w) for st, w in (*doc["waits"], *doc["still_waiting"])]


async def _run_one(mode: str, s: DatabaseSettings, url: str, run: str, key: int) -> dict[str, Any]:
    holder = await _connect(s.dsn)
    sampler = await _connect(s.dsn)
    try:
        start = time.monotonic() + 0.5
        total = s.before + s.slow + s.after
        slowing = asyncio.create_task(_slow_down(holder, s, key, start))
        sampling = asyncio.create_task(_sample(sampler, s, run, start, start + total + s.settle))
        outcomes = await _drive(s, url, start)
        await slowing
        samples = await sampling
        waits = await _pool_waits(url, start)
    finally:
        await holder.close()
        await sampler.close()
    seconds = summarize_seconds(outcomes, waits, samples, math.ceil(total))
    kinds = Counter(o.kind for o in outcomes)
    all_waits = [w for _, w in waits]
    before, slow_end = round(s.before), round(s.before + s.slow)
    goodput = [sec["goodput"] for sec in seconds]
    return {
        "configuration": mode,
        "scenario": DATABASE,
        "requests": len(outcomes),
        "goodput_before": _per_s(goodput[1:before]),
        "goodput_slow": _per_s(goodput[before:slow_end]),
        "goodput_after": _per_s(goodput[slow_end:]),
        "good_slow": sum(goodput[before:slow_end]),
        "refused": {k.split(":", 1)[1]: n for k, n in sorted(kinds.items()) if ":" in k},
        "timeouts": kinds["timeout"],
        "late": kinds["late"],
        "errors": kinds["error"],
        "p99_ms": _ms(_p99([o.latency for o in outcomes if o.kind == "ok"])),
        "pool_wait_p99_ms": _ms(_p99(all_waits)),
        "pool_wait_max_ms": _ms(max(all_waits, default=None)),
        "pool_waiters_max": max((sec["pool_waiters"] for sec in seconds), default=0),
        "running_max": max((x.running for x in samples), default=0),
        "gone_max": max((x.gone for x in samples), default=0),
        "gone_sample_share": round(sum(1 for x in samples if x.gone) / len(samples), 3)
        if samples
        else 0.0,
        "overrun_max": max((x.overrun for x in samples), default=0.0),
        "recovery_s": recovery_seconds(goodput, before, slow_end),
        "seconds": seconds,
        "samples": [asdict(x) for x in samples],
    }


def _per_s(values: Sequence[int]) -> float:
    return round(sum(values) / len(values), 1) if values else 0.0


async def _run_all(s: DatabaseSettings, on_stage: Callable[[str], None]) -> list[dict[str, Any]]:
    probe = await _connect(s.dsn)
    await probe.close()
    out = []
    for mode in CONFIGS:
        run = secrets.token_hex(4)
        key = secrets.randbelow(2**62)
        on_stage(
            f"database: {mode} ({s.rate:g}/s for {s.before + s.slow + s.after:g} s, "
            f"slowed from {s.before:g} s for {s.slow:g} s)"
        )
        with _front(mode, s, key, run) as url:
            out.append(await _run_one(mode, s, url, run, key))
    return out


def run_database(
    s: DatabaseSettings, on_stage: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run both configurations and return the scenario's JSON (`DatabaseUnavailable` if
    PostgreSQL does not answer)."""
    stage = on_stage or (lambda _msg: None)
    runs = asyncio.run(_run_all(s, stage))
    return {"settings": asdict(s), "runs": runs}


# -- verdict and report ------------------------------------------------------------------------


def database_runs(lab: dict[str, Any]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = (lab.get(DATABASE) or {}).get("runs", [])
    return runs


def _check(name: str, value: Any, limit: Any, passed: bool, unit: str) -> dict[str, Any]:
    return {
        "configuration": "brownout",
        "scenario": DATABASE,
        "step": "whole run",
        "check": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "passed": passed,
        "status": "passed" if passed else "failed",
        "host_bound": [],
        "generator_late": False,
    }


def database_checks(lab: dict[str, Any]) -> list[dict[str, Any]]:
    """The invariants, on the brownout run (see the module's docstring)."""
    st = (lab.get(DATABASE) or {}).get("settings") or {}
    runs = {r["configuration"]: r for r in database_runs(lab)}
    ours = runs.get("brownout")
    if ours is None or not st:
        return []
    checks = []
    overrun = float(ours["overrun_max"])
    limit = float(st["overrun_limit"])
    checks.append(
        _check("query running past its caller's deadline", overrun, limit, overrun <= limit, "s")
    )
    wait = ours["pool_wait_p99_ms"]
    bound = round((float(st["max_wait"]) + float(st["wait_slack"])) * 1000, 1)
    checks.append(_check("pool wait p99", wait, bound, wait is not None and wait <= bound, "ms"))
    rec = ours["recovery_s"]
    within = float(st["recover_within"])
    checks.append(
        _check(
            "seconds to goodput >= 90% of before, after the slowdown",
            rec,
            within,
            rec is not None and rec <= within,
            "s",
        )
    )
    plain = runs.get("unprotected")
    if plain is not None:
        good, theirs = int(ours["good_slow"]), int(plain["good_slow"])
        checks.append(
            _check(
                "goodput during the slowdown vs unprotected",
                good,
                theirs,
                good >= theirs,
                "requests",
            )
        )
    return checks


DATABASE_TITLE = "Slow database (front -> PostgreSQL pool)"


def database_description(lab: dict[str, Any]) -> str:
    """What the database scenario did, with its settings."""
    st = (lab.get(DATABASE) or {}).get("settings") or {}
    if not st:
        return ""
    capacity = st["pool_size"] / st["work"]
    return (
        f"{st['load'] * capacity:g} requests/s open loop ({st['load']:.0%} of a pool of "
        f"{st['pool_size']} connections x {st['work'] * 1000:g} ms queries), client deadline "
        f"{st['deadline']:g} s; from {st['before']:g} s for {st['slow']:g} s a session holds a "
        f"lock every query needs, {st['hold']:g} s at a time with {st['gap']:g} s free between; "
        f"brownout's pool waits at most {st['max_wait'] * 1000:g} ms; pg_stat_activity "
        f"sampled every {st['sample_every'] * 1000:g} ms"
    )


DATABASE_COLUMNS = [
    "configuration",
    "goodput/s before",
    "goodput/s slowed",
    "goodput/s after",
    "recovered after (s)",
    "refused (reason)",
    "client timeouts",
    "errors",
    "p99 ok (ms)",
    "pool wait p99 (ms)",
    "pool wait max (ms)",
    "max waiting for a connection",
    "max queries running",
    "max running for a caller gone",
    "longest past the deadline (s)",
]


def _refused(refused: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in refused.items()) or "0"


def database_rows(lab: dict[str, Any]) -> list[list[str]]:
    """One table row per configuration of the database scenario."""
    return [
        [
            run["configuration"],
            f"{run['goodput_before']:g}",
            f"{run['goodput_slow']:g}",
            f"{run['goodput_after']:g}",
            "never" if run["recovery_s"] is None else f"{run['recovery_s']:g}",
            _refused(run["refused"]),
            str(run["timeouts"]),
            str(run["errors"]),
            str(run["p99_ms"]),
            str(run["pool_wait_p99_ms"]),
            str(run["pool_wait_max_ms"]),
            str(run["pool_waiters_max"]),
            str(run["running_max"]),
            str(run["gone_max"]),
            f"{run['overrun_max']:g}",
        ]
        for run in database_runs(lab)
    ]


DATABASE_SECONDS_COLUMNS = [
    "second",
    "phase",
    "configuration",
    "goodput",
    "refused",
    "timeouts",
    "p99 ok (ms)",
    "pool wait p99 (ms)",
    "running (max)",
    "caller gone (max)",
]


def database_seconds(lab: dict[str, Any]) -> list[list[str]]:
    """The per-second table: each second, one row per configuration."""
    st = (lab.get(DATABASE) or {}).get("settings") or {}
    runs = database_runs(lab)
    if not st or not runs:
        return []
    before, slow_end = round(st["before"]), round(st["before"] + st["slow"])
    rows = []
    for i in range(max(len(r["seconds"]) for r in runs)):
        phase = "before" if i < before else "slowed" if i < slow_end else "after"
        for run in runs:
            if i >= len(run["seconds"]):
                continue
            sec = run["seconds"][i]
            rows.append(
                [
                    str(i),
                    phase,
                    run["configuration"],
                    str(sec["goodput"]),
                    _refused(sec["refused"]),
                    str(sec["timeouts"]),
                    str(sec["p99_ms"]),
                    str(sec["pool_wait_p99_ms"]),
                    str(sec["running_max"]),
                    str(sec["gone_max"]),
                ]
            )
    return rows


def plot_database(lab: dict[str, Any], out: Any, plt: Any) -> str:
    """Queries running on the server over time (and those whose caller is gone), and goodput
    per second, both configurations; the slowdown shaded. Returns the file's name."""
    st = (lab.get(DATABASE) or {}).get("settings") or {}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for i, run in enumerate(database_runs(lab)):
        xs = [x["at"] for x in run["samples"]]
        (line,) = top.step(
            xs,
            [x["running"] for x in run["samples"]],
            where="post",
            linewidth=3.0 if i == 0 else 1.5,  # the first stays visible under the second
            label=f"{run['configuration']}: running",
        )
        top.step(
            xs,
            [x["gone"] for x in run["samples"]],
            where="post",
            linestyle=":",
            color=line.get_color(),
            label=f"{run['configuration']}: caller gone",
        )
        bottom.step(
            [sec["second"] for sec in run["seconds"]],
            [sec["goodput"] for sec in run["seconds"]],
            where="post",
            color=line.get_color(),
            label=run["configuration"],
        )
    if st:
        for ax in (top, bottom):
            ax.axvspan(
                st["before"],
                st["before"] + st["slow"],
                color="0.92",
                label="database slowed" if ax is top else None,
            )
    top.set_ylabel("lab queries active on the server")
    top.set_title("Slow database: queries running (pg_stat_activity) and for callers gone (dotted)")
    top.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    bottom.set_ylabel("goodput (200 within deadline) /s")
    bottom.set_xlabel("seconds into the run (by sending time)")
    bottom.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    name = "timeline-database.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
