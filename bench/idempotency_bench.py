"""The idempotency layer on a POST that stores its answer, Redis store over loopback (issue 27).

Per request, in process (an ASGI driver, no HTTP server: the layer's own cost plus its real
Redis round trips), measured in the same run, interleaved over rounds (medians of the
rounds' means):

- ``SET``: a Redis ``SET`` round trip on the same client (the unit of the figure);
- ``plain``: a trivial POST handler (JSON answer) without the layer;
- ``first``: the same handler under `IdempotencyMiddleware`, a new key each request: the
  handler runs and its answer is stored;
- ``replay``: a repeat of a stored key: the stored answer, the handler not run.

Two times each: **latency**, until the answer's last byte is handed to the server (what the
client waits for), and **cost**, until the middleware returns (all the work of the request,
the store's write after sending included).

Figures: ``(first - plain) latency <= 1.5 x SET``; ``replay cost < first cost`` (serving a
stored answer is cheaper than running the trivial handler and storing its answer).

Run: flock /tmp/brownout-bench.lock .venv/bin/python bench/idempotency_bench.py [--redis-port 6379]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import redis.asyncio as redis

from brownout.idempotency import Idempotency, RedisIdempotencyStore
from brownout.integrations.asgi_idempotency import IdempotencyMiddleware


async def trivial(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    body = json.dumps({"paid": 10, "currency": "EUR"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": body})


BODY = b'{"amount": 10, "currency": "EUR"}'


async def one(app: Any, key: bytes | None) -> tuple[float, float]:
    """(latency, cost) of one POST through ``app``, in seconds."""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"idempotency-key", key))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/payments",
        "raw_path": b"/payments",
        "query_string": b"",
        "headers": headers,
    }
    sent = False
    answered = 0.0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal answered
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered = time.perf_counter()

    t0 = time.perf_counter()
    await app(scope, receive, send)
    t1 = time.perf_counter()
    return answered - t0, t1 - t0


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--n", type=int, default=2000, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    client = redis.Redis(host="127.0.0.1", port=args.redis_port)
    prefix = f"bench:idem:{uuid.uuid4().hex[:8]}:"
    store = RedisIdempotencyStore(client, prefix=prefix, timeout=1.0)
    layered = IdempotencyMiddleware(trivial, Idempotency(store, ttl=120.0))
    await client.ping()
    replay_key = b'"replay-me"'
    await one(layered, replay_key)  # stored once; every later use is a replay

    async def set_rtt(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await client.set(f"{prefix}set", i, ex=120)
        return (time.perf_counter() - t0) / n

    async def variant(app: Any, keys: list[bytes | None]) -> tuple[float, float]:
        lat = cost = 0.0
        for k in keys:
            a, b = await one(app, k)
            lat += a
            cost += b
        return lat / len(keys), cost / len(keys)

    n = args.n
    for _ in range(2):  # warm-up: scripts loaded, connections open, code paths hot
        await set_rtt(200)
        await variant(trivial, [None] * 200)
        await variant(layered, [uuid.uuid4().hex.encode() for _ in range(200)])
        await variant(layered, [replay_key] * 200)

    rows: dict[str, list[float]] = {k: [] for k in ("set", "plain", "first", "replay")}
    costs: dict[str, list[float]] = {k: [] for k in ("plain", "first", "replay")}
    for _ in range(args.rounds):
        rows["set"].append(await set_rtt(n))
        for name, app, keys in (
            ("plain", trivial, [None] * n),
            ("first", layered, [uuid.uuid4().hex.encode() for _ in range(n)]),
            ("replay", layered, [replay_key] * n),
        ):
            lat, cost = await variant(app, keys)
            rows[name].append(lat)
            costs[name].append(cost)
    med = {k: statistics.median(v) for k, v in rows.items()}
    cmed = {k: statistics.median(v) for k, v in costs.items()}
    us = 1e6
    print(f"rounds={args.rounds} n={n} per variant per round; medians of round means (us)")
    print(f"  Redis SET round trip         {med['set'] * us:8.1f}")
    for name in ("plain", "first", "replay"):
        print(f"  {name:<8} latency {med[name] * us:8.1f}   cost {cmed[name] * us:8.1f}")
    added = med["first"] - med["plain"]
    ratio = added / med["set"]
    print(f"added latency (first - plain) {added * us:8.1f} us = {ratio:.2f} x SET (figure <= 1.5)")
    replay, first = cmed["replay"] * us, cmed["first"] * us
    print(
        f"replay cost / first cost       {replay / first:.2f} "
        f"(figure < 1: replay {replay:.1f} us, run + store {first:.1f} us)"
    )
    print(f"store round trips: {store.calls}")
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    for i in range(0, len(keys), 500):
        await client.delete(*keys[i : i + 500])
    await client.aclose()
    ok = ratio <= 1.5 and cmed["replay"] < cmed["first"]
    print("figures reached" if ok else "FIGURES NOT REACHED")


if __name__ == "__main__":
    asyncio.run(main())
