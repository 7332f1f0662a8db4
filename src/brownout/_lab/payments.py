"""The lab scenario "payments": client -> front -> payment service (issue 27, item 5).

Orders arrive open loop at a steady rate; a share of them is slow after commit (the payment
service commits, then answers after the client's per-attempt timeout). Two configurations,
each on fresh tables, with the processes of `brownout._lab.payments_service`:

- ``naive``: plain httpx with its own timeout and up to ``attempts`` attempts on a timeout, no
  idempotency key; the front forwards nothing; the payment service inserts on every request;
- ``brownout``: httpx with `BrownoutTransport` and a `Dependency` (per-attempt timeout,
  `RetryPolicy` under a `RetryBudget`, a `RedisOutcomeLedger`); the front runs behind
  `BrownoutMiddleware` and calls through `BrownoutTransport` (the key travels on, bound to
  each caller); the payment service runs the idempotency layer on PostgreSQL (row and stored
  answer in one transaction). After the run a `Reconciler` asks the payment service, by key,
  about every unknown outcome in the ledger; each one reconciled as applied is resent with its
  key to fetch the stored answer.

Each configuration is counted from PostgreSQL (rows per order): requested, applied once,
applied twice or more (duplicates), never applied; and from the client: unknown outcomes
recorded, reconciled as applied, replays served. Invariant (brownout): no duplicates, and no
unknown outcome left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from .system_checks import late_success_check

__all__ = [
    "PAYMENTS",
    "PAYMENTS_COLUMNS",
    "PAYMENTS_TITLE",
    "PaymentsSettings",
    "ServicesUnavailable",
    "chain",
    "chain_key",
    "payments_checks",
    "payments_description",
    "payments_rows",
    "payments_runs",
    "quick_settings",
    "run_payments",
]

PAYMENTS = "payments"
"""The scenario's name for ``brownout lab --scenarios``."""
CLIENT_CALLER = "shop"
"""The caller the client names itself to the front (``x-caller``)."""


class ServicesUnavailable(RuntimeError):
    """PostgreSQL or Redis did not answer (or a driver is missing): the scenario cannot run."""


@dataclass(frozen=True)
class PaymentsSettings:
    """Timing of the scenario. The defaults take about 60 s in all (two configurations)."""

    dsn: str = "postgresql://postgres@127.0.0.1:5432/test"
    redis_url: str = "redis://127.0.0.1:6379/0"
    rate: float = 20.0
    """Orders per second (open loop)."""
    seconds: float = 20.0
    slow_share: float = 0.2
    """Share of orders whose payment answers ``slow`` seconds after its commit."""
    slow: float = 1.5
    timeout: float = 0.5
    """The client's per-attempt timeout (below ``slow``: a slow answer is never seen)."""
    attempts: int = 3
    retry_ratio: float = 0.1
    """brownout's retry budget: retries per original, over its window."""
    retry_min_per_second: float = 1.0
    settle: float = 4.0
    """Seconds after the last order for answers to land before counting."""

    @classmethod
    def quick(cls) -> PaymentsSettings:
        return cls(seconds=8.0, settle=3.0)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class _Proc:
    role: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _spawn(args: list[str], within: float = 30.0) -> _Proc:
    """``python -m brownout._lab.payments_service ARGS``, once it prints its port."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "brownout._lab.payments_service",
            *args,
            "--parent-pid",
            str(os.getpid()),
        ],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], within)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("PORT "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"payments {args[0]} did not start (said {line!r})")
    return _Proc(args[0], int(line.split()[1]), proc)


@contextlib.contextmanager
def chain(mode: str, dsn: str, table: str) -> Iterator[tuple[str, str]]:
    """A payment service and a front in ``mode`` (``brownout`` or ``naive``) on fresh
    processes; yields (front URL, payment URL); both stopped on exit."""
    payment = _spawn(["payment", "--mode", mode, "--dsn", dsn, "--table", table])
    try:
        front = _spawn(["front", "--mode", mode, "--payment-url", payment.url])
        try:
            yield front.url, payment.url
        finally:
            front.stop()
    finally:
        payment.stop()


def chain_key(key: str) -> str:
    """The client's idempotency key as the payment service stores it: bound to the client by
    the front's edge, then to the front by the payment service's edge (I1)."""
    from brownout.wire import bind_idempotency_key

    from .payments_service import FRONT_CALLER

    return bind_idempotency_key(FRONT_CALLER, bind_idempotency_key(CLIENT_CALLER, key))


# -- the runs ----------------------------------------------------------------------------------


async def _check_services(s: PaymentsSettings) -> tuple[Any, Any]:
    try:
        import asyncpg
        import redis.asyncio as redis_asyncio
    except ImportError as e:
        raise ServicesUnavailable(
            f"the payments scenario needs asyncpg and redis-py ({e.name} is missing)"
        ) from e
    try:
        pool = await asyncio.wait_for(asyncpg.create_pool(s.dsn, min_size=1, max_size=4), 5)
    except Exception as e:
        raise ServicesUnavailable(
            f"PostgreSQL at {s.dsn} did not answer ({type(e).__name__}: {e}); start it "
            "(e.g. `service postgresql start`) or leave out --scenarios payments"
        ) from e
    try:
        client = redis_asyncio.Redis.from_url(s.redis_url, socket_timeout=5)
        await asyncio.wait_for(client.ping(), 5)
    except Exception as e:
        await pool.close()
        raise ServicesUnavailable(
            f"Redis at {s.redis_url} did not answer ({type(e).__name__}: {e}); start it "
            "(e.g. `redis-server`) or leave out --scenarios payments"
        ) from e
    return pool, client


async def _drive(s: PaymentsSettings, send: Any) -> list[str]:
    """Open loop: ``send(order, slow)`` at ``rate`` for ``seconds``; the orders sent."""
    n = int(s.rate * s.seconds)
    every = max(1, round(1 / s.slow_share)) if s.slow_share > 0 else 0
    start = time.monotonic() + 0.2
    tasks = []
    orders = []
    for i in range(n):
        delay = start + i / s.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        order = f"o{i}"
        orders.append(order)
        tasks.append(asyncio.create_task(send(order, every > 0 and i % every == 0)))
    await asyncio.gather(*tasks, return_exceptions=True)
    return orders


async def _naive(s: PaymentsSettings, front: str) -> dict[str, int]:
    import httpx

    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=front, timeout=s.timeout) as http:

        async def send(order: str, slow: bool) -> None:
            headers = {"x-slow-after-commit": str(s.slow)} if slow else {}
            for _ in range(s.attempts):
                try:
                    r = await http.post(
                        "/checkout", json={"order": order, "amount": 10}, headers=headers
                    )
                except httpx.TimeoutException:
                    counts["timeouts"] += 1
                    continue
                counts[f"status_{r.status_code}"] += 1
                return
            counts["gave_up"] += 1

        await _drive(s, send)
    return dict(counts)


async def _brownout(s: PaymentsSettings, front: str, payment: str, redis: Any) -> dict[str, int]:
    import httpx

    from brownout import (
        Dependency,
        ExponentialBackoff,
        OutcomeState,
        Reconciler,
        RedisOutcomeLedger,
        RetryBudget,
        RetryPolicy,
        UnknownOutcome,
    )
    from brownout.integrations.httpx import BrownoutTransport
    from brownout.wire import IDEMPOTENCY_HEADER

    prefix = f"brownout-lab-payments-{secrets.token_hex(4)}"
    ledger = RedisOutcomeLedger(redis, prefix=prefix, ttl=600)
    counts: Counter[str] = Counter()
    lost: dict[str, str] = {}  # idempotency key -> order, for the unknown outcomes
    payments = Dependency(
        "payments",
        timeout=s.timeout,
        retry=RetryPolicy(
            s.attempts,
            budget=RetryBudget(s.retry_ratio, min_per_second=s.retry_min_per_second),
            backoff=ExponentialBackoff(0.01, cap=0.05),
        ),
        ledger=ledger,
    )
    transport = BrownoutTransport(httpx.AsyncHTTPTransport(), dependency=payments)
    try:
        async with (
            httpx.AsyncClient(
                base_url=front, transport=transport, headers={"x-caller": CLIENT_CALLER}
            ) as http,
            httpx.AsyncClient(base_url=payment, timeout=5) as ask,
        ):

            async def send(order: str, slow: bool) -> None:
                headers = {"x-slow-after-commit": str(s.slow)} if slow else {}
                try:
                    r = await http.post(
                        "/checkout", json={"order": order, "amount": 10}, headers=headers
                    )
                except UnknownOutcome as unknown:
                    counts["unknown"] += 1
                    if unknown.idempotency_key is not None:
                        lost[unknown.idempotency_key] = order
                    return
                except Exception as e:
                    counts[f"error_{type(e).__name__}"] += 1
                    return
                counts[f"status_{r.status_code}"] += 1
                if r.headers.get("idempotent-replayed") == "true":
                    counts["replays"] += 1
                    counts["replays_in_call"] += 1

            await _drive(s, send)
            await asyncio.sleep(s.settle)

            async def check(record: Any) -> OutcomeState:
                r = await ask.get(f"/payments/{chain_key(record.key)}")
                applied = int(r.json()["applied"])
                return OutcomeState.APPLIED if applied else OutcomeState.NOT_APPLIED

            counts["recorded"] = len(await ledger.pending())
            resolved = await Reconciler(ledger, check, batch=10_000).run_once()
            counts["pending_after"] = len(await ledger.pending())
            for record in resolved:
                if record.state is not OutcomeState.APPLIED:
                    counts["reconciled_not_applied"] += 1
                    continue
                counts["reconciled_applied"] += 1
                # The stored answer, fetched with the same key and body: never a second payment.
                r = await http.post(
                    "/checkout",
                    json={"order": lost[record.key], "amount": 10},
                    headers={IDEMPOTENCY_HEADER: record.key},
                )
                if r.headers.get("idempotent-replayed") == "true":
                    counts["replays"] += 1
    finally:
        keys = [k async for k in redis.scan_iter(match=f"*{prefix}*")]
        if keys:
            await redis.delete(*keys)
    return dict(counts)


async def _rows(pool: Any, table: str, orders: list[str]) -> dict[str, int]:
    """Rows per order, from PostgreSQL: the payments actually applied."""
    per: Counter[str] = Counter()
    for order, n in await pool.fetch(f"SELECT order_id, count(*) FROM {table} GROUP BY order_id"):
        per[order] = int(n)
    return {
        "requested": len(orders),
        "applied_once": sum(1 for o in orders if per[o] == 1),
        "duplicates": sum(1 for o in orders if per[o] >= 2),
        "extra_rows": sum(max(0, per[o] - 1) for o in orders),
        "not_applied": sum(1 for o in orders if per[o] == 0),
    }


async def _run_all(s: PaymentsSettings, on_stage: Any) -> list[dict[str, Any]]:
    pool, redis = await _check_services(s)
    out = []
    try:
        for mode in ("naive", "brownout"):
            table = f"lab_pay_{mode}_{secrets.token_hex(4)}"
            on_stage(f"payments: {mode} ({s.seconds:.0f} s at {s.rate:g}/s)")
            try:
                with chain(mode, s.dsn, table) as (front, payment):
                    started = time.monotonic()
                    if mode == "naive":
                        client = await _naive(s, front)
                        await asyncio.sleep(s.settle)
                    else:
                        client = await _brownout(s, front, payment, redis)
                    orders = [f"o{i}" for i in range(int(s.rate * s.seconds))]
                    rows = await _rows(pool, table, orders)
                    took = time.monotonic() - started
            finally:
                await pool.execute(f"DROP TABLE IF EXISTS {table}, {table}_idem")
            out.append(
                {
                    "configuration": mode,
                    "scenario": PAYMENTS,
                    **rows,
                    "unknown_recorded": client.get("recorded", 0),
                    "reconciled_applied": client.get("reconciled_applied", 0),
                    "reconciled_not_applied": client.get("reconciled_not_applied", 0),
                    "pending_after": client.get("pending_after", 0),
                    "replays": client.get("replays", 0),
                    "client_errors": sum(
                        n
                        for k, n in client.items()
                        if (k.startswith("status_") and k != "status_201")
                        or k.startswith("error_")
                        or k == "gave_up"
                    ),
                    "client": client,
                    "seconds": round(took, 1),
                }
            )
    finally:
        await pool.close()
        await redis.aclose()
    return out


def run_payments(s: PaymentsSettings, on_stage: Any = None) -> dict[str, Any]:
    """Run both configurations and return the scenario's JSON (`ServicesUnavailable` if
    PostgreSQL or Redis does not answer)."""
    stage = on_stage or (lambda _msg: None)
    runs = asyncio.run(_run_all(s, stage))
    return {"settings": asdict(s), "runs": runs}


def quick_settings(s: PaymentsSettings) -> PaymentsSettings:
    """``s`` with the quick timings, keeping its servers."""
    return replace(PaymentsSettings.quick(), dsn=s.dsn, redis_url=s.redis_url)


def _check(name: str, value: int, limit: int, passed: bool, unit: str) -> dict[str, Any]:
    return {
        "configuration": "brownout",
        "scenario": PAYMENTS,
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


def payments_checks(lab: dict[str, Any]) -> list[dict[str, Any]]:
    """The invariants: brownout's late successes are replayed, never applied twice
    (``late_success_reconciled``), and no unknown outcome is left pending."""
    checks: list[dict[str, Any]] = []
    for run in payments_runs(lab):
        if run["configuration"] != "brownout":
            continue
        counts = {"duplicates": int(run["duplicates"]), "replayed": int(run["replays"])}
        checks.append(late_success_check(run, counts))
        left = (
            int(run["unknown_recorded"])
            - int(run["reconciled_applied"])
            - int(run["reconciled_not_applied"])
        )
        left = max(left, int(run["pending_after"]))
        checks.append(_check("unknown outcomes not reconciled", left, 0, left == 0, "keys"))
    return checks


PAYMENTS_TITLE = "Payments slow after commit (client -> front -> payment)"


def payments_runs(lab: dict[str, Any]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = (lab.get(PAYMENTS) or {}).get("runs", [])
    return runs


def payments_description(lab: dict[str, Any]) -> str:
    """What the payments scenario did, with its settings."""
    st = (lab.get(PAYMENTS) or {}).get("settings") or {}
    if not st:
        return ""
    return (
        f"{st['rate']:g} orders/s for {st['seconds']:g} s, open loop; {st['slow_share']:.0%} "
        f"answered {st['slow']:g} s after their commit; client timeout {st['timeout']:g} s per "
        f"attempt, up to {st['attempts']} attempts (brownout: retry budget "
        f"{st['retry_ratio']:g} per original); rows counted in PostgreSQL"
    )


PAYMENTS_COLUMNS = [
    "configuration",
    "requested",
    "applied once",
    "applied 2+ (duplicates)",
    "extra rows",
    "never applied",
    "unknown outcomes",
    "reconciled as applied",
    "replays served",
    "errors seen by the client",
]


def payments_rows(lab: dict[str, Any]) -> list[list[str]]:
    """One table row per configuration of the payments scenario."""
    return [
        [
            run["configuration"],
            str(run["requested"]),
            str(run["applied_once"]),
            str(run["duplicates"]),
            str(run["extra_rows"]),
            str(run["not_applied"]),
            str(run["unknown_recorded"]),
            str(run["reconciled_applied"]),
            str(run["replays"]),
            str(run.get("client_errors", 0)),
        ]
        for run in payments_runs(lab)
    ]
