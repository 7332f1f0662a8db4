"""`brownout proxy` (`FaultProxy`) against real servers over loopback: each fault measured
from the client's side, with margins a shared 2-core host allows."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from tests.integration.servers import serve_aiohttp

from brownout._lab.faults import Faults, Timeline
from brownout._lab.proxy import FaultProxy, ProxyError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SRC = str(Path(__file__).resolve().parents[2] / "src")


def make_app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked
        await response.prepare(request)
        for _ in range(4):
            await response.write(b"x" * 1000)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_post("/echo", echo)
    app.router.add_get("/stream", stream)
    return app


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, int]]:
    async with serve_aiohttp(make_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def base(proxy: FaultProxy) -> str:
    return f"http://{proxy.address[0]}:{proxy.address[1]}"


def assert_no_proxy_tasks() -> None:
    names = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("brownout-proxy")]
    assert names == []


async def timed_get(client: httpx.AsyncClient, url: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = await client.get(url)
    return time.perf_counter() - started, response


async def test_http_passes_requests_bodies_and_chunked_answers(upstream: tuple[str, int]) -> None:
    async with FaultProxy(upstream, mode="http") as proxy, httpx.AsyncClient() as client:
        assert (await client.get(base(proxy) + "/hello")).text == "hello"
        body = os.urandom(300_000)
        assert (await client.post(base(proxy) + "/echo", content=body)).content == body
        chunks = iter([b"a" * 70_000, b"b" * 5])
        streamed = await client.post(base(proxy) + "/echo", content=_aiter(chunks))
        assert streamed.content == b"a" * 70_000 + b"b" * 5
        assert (await client.get(base(proxy) + "/stream")).content == b"x" * 4000
        stats = proxy.stats()
        assert stats.requests == 4
        assert stats.connections == 1  # keep-alive through the proxy
        assert sum(stats.faults_injected.values()) == 0
    assert_no_proxy_tasks()


async def _aiter(chunks: object) -> AsyncIterator[bytes]:
    for chunk in chunks:  # type: ignore[attr-defined]
        yield chunk


async def test_http_latency_is_added_to_each_request(upstream: tuple[str, int]) -> None:
    faults = Faults(latency=0.1, jitter=0.05)
    async with FaultProxy(upstream, mode="http", faults=faults) as proxy:
        async with httpx.AsyncClient() as client:
            took = [await timed_get(client, base(proxy) + "/hello") for _ in range(10)]
    assert all(r.status_code == 200 for _, r in took)
    assert min(t for t, _ in took) >= 0.09
    assert sorted(t for t, _ in took)[5] < 0.15 + 0.5  # the median, with room for a busy host
    assert proxy.stats().faults_injected["latency"] == 10


async def test_http_error_rate_within_a_binomial_bound(upstream: tuple[str, int]) -> None:
    n, rate = 400, 0.3
    faults = Faults(error_rate=rate, error_status=503, error_body="injected\n")
    async with FaultProxy(upstream, mode="http", faults=faults, seed=7) as proxy:
        async with httpx.AsyncClient() as client:
            statuses = [(await client.get(base(proxy) + "/hello")).status_code for _ in range(n)]
            injected = await client.get(base(proxy) + "/hello")
    errors = statuses.count(503)
    assert statuses.count(200) + errors == n
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(errors - n * rate) <= 5 * sd  # 5 standard deviations: about 1 in 2 million
    assert proxy.stats().faults_injected["error"] == errors + (injected.status_code == 503)
    assert proxy.stats().connections == 1  # an injected error keeps the connection


async def test_http_reset_is_a_transport_error(upstream: tuple[str, int]) -> None:
    async with FaultProxy(upstream, mode="http", faults=Faults(reset_rate=1.0)) as proxy:
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.TransportError):
                await client.get(base(proxy) + "/hello")
    assert proxy.stats().faults_injected["reset"] == 1


async def test_http_stall_ends_in_the_clients_timeout(upstream: tuple[str, int]) -> None:
    async with FaultProxy(upstream, mode="http", faults=Faults(stall_rate=1.0)) as proxy:
        async with httpx.AsyncClient(timeout=0.3) as client:
            started = time.perf_counter()
            with pytest.raises(httpx.ReadTimeout):
                await client.get(base(proxy) + "/hello")
            assert time.perf_counter() - started >= 0.29
        assert proxy.stats().active_connections <= 1
    assert proxy.stats().faults_injected["stall"] == 1
    assert_no_proxy_tasks()


async def test_http_timeline_and_runtime_changes(upstream: tuple[str, int]) -> None:
    timeline = Timeline.of((0.0, Faults()), (0.4, Faults(error_rate=1.0, error_status=502)))
    async with FaultProxy(upstream, mode="http", timeline=timeline) as proxy:
        async with httpx.AsyncClient() as client:
            assert (await client.get(base(proxy) + "/hello")).status_code == 200
            assert proxy.stats().timeline_step == 0
            await asyncio.sleep(0.6)
            assert (await client.get(base(proxy) + "/hello")).status_code == 502
            assert proxy.stats().timeline_step == 1
            proxy.set_faults(Faults())
            assert (await client.get(base(proxy) + "/hello")).status_code == 200


async def test_control_endpoint_sets_faults_and_reports_stats(upstream: tuple[str, int]) -> None:
    async with FaultProxy(upstream, mode="http", control=("127.0.0.1", 0)) as proxy:
        assert proxy.control_address is not None
        control = f"http://127.0.0.1:{proxy.control_address[1]}"
        async with httpx.AsyncClient() as client:
            put = await client.put(control + "/faults", json={"error_rate": 1, "error_status": 429})
            assert put.status_code == 200 and put.json()["error_status"] == 429
            assert (await client.get(base(proxy) + "/hello")).status_code == 429
            stats = (await client.get(control + "/stats")).json()
            assert stats["faults_injected"]["error"] == 1 and stats["requests"] == 1
            bad = await client.put(control + "/faults", json={"latncy": 1})
            assert bad.status_code == 400 and "latncy" in bad.json()["error"]
            assert (await client.get(control + "/faults")).json()["error_status"] == 429
            assert (await client.get(control + "/nope")).status_code == 404


async def test_remote_listen_is_refused_without_allow_remote() -> None:
    with pytest.raises(ProxyError, match="not loopback"):
        FaultProxy(("127.0.0.1", 1), listen=("0.0.0.0", 0))
    FaultProxy(("127.0.0.1", 1), listen=("0.0.0.0", 0), allow_remote=True)  # no error


async def test_unreachable_upstream_is_a_502_in_http_mode() -> None:
    async with FaultProxy(("127.0.0.1", 1), mode="http") as proxy:
        async with httpx.AsyncClient() as client:
            assert (await client.get(base(proxy) + "/hello")).status_code == 502
    assert proxy.stats().upstream_failures == 1


# -- tcp mode against the real Redis and PostgreSQL ---------------------------------------------


def redis_through(proxy: FaultProxy, **options: object) -> aioredis.Redis:
    return aioredis.Redis(host=proxy.address[0], port=proxy.address[1], **options)  # type: ignore[arg-type]


async def timed_ping(client: aioredis.Redis) -> float:
    started = time.perf_counter()
    assert await client.ping()
    return time.perf_counter() - started


async def test_tcp_latency_on_redis(redis_server: object) -> None:
    async with FaultProxy(("127.0.0.1", 6379)) as proxy:
        client = redis_through(proxy)
        try:
            await client.ping()  # connected without faults
            proxy.set_faults(Faults(latency=0.1))
            took = [await timed_ping(client) for _ in range(5)]
            proxy.set_faults(Faults())
            quick = await timed_ping(client)
        finally:
            await client.aclose()
    assert min(took) >= 0.09
    assert quick < 0.09
    assert_no_proxy_tasks()


async def test_tcp_loss_delays_chunks_both_ways_on_redis(redis_server: object) -> None:
    faults = Faults(loss_rate=1.0, loss_delay=0.2)
    async with FaultProxy(("127.0.0.1", 6379)) as proxy:
        client = redis_through(proxy)
        try:
            await client.ping()
            proxy.set_faults(faults)
            took = await timed_ping(client)
        finally:
            await client.aclose()
    assert took >= 0.38  # one chunk each way, each held back 0.2 s
    assert proxy.stats().faults_injected["loss"] >= 2


async def test_tcp_reset_on_redis_existing_and_new_connections(redis_server: object) -> None:
    async with FaultProxy(("127.0.0.1", 6379)) as proxy:
        client = redis_through(proxy, retry_on_error=[], retry=None)
        try:
            await client.ping()
            proxy.set_faults(Faults(reset_rate=1.0))  # drawn again on the next command
            with pytest.raises(aioredis.ConnectionError):
                await client.ping()
            with pytest.raises(aioredis.ConnectionError):
                await client.ping()  # a new connection, reset at accept
        finally:
            await client.aclose()
    assert proxy.stats().faults_injected["reset"] >= 2


async def test_tcp_stall_ends_in_the_redis_clients_timeout(redis_server: object) -> None:
    async with FaultProxy(("127.0.0.1", 6379)) as proxy:
        client = redis_through(proxy, socket_timeout=0.3, retry_on_error=[], retry=None)
        try:
            await client.ping()
            proxy.set_faults(Faults(stall_rate=1.0))
            started = time.perf_counter()
            with pytest.raises(aioredis.TimeoutError):
                await client.ping()
            assert time.perf_counter() - started >= 0.29
        finally:
            await client.aclose()
    assert_no_proxy_tasks()


async def test_tcp_postgres_latency_reset_and_stall(postgres_server: object) -> None:
    async with FaultProxy(("127.0.0.1", 5432)) as proxy:
        port = proxy.address[1]
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{port}/test", timeout=5)
        try:
            proxy.set_faults(Faults(latency=0.1))
            started = time.perf_counter()
            assert await conn.fetchval("select 1") == 1
            assert time.perf_counter() - started >= 0.09
            proxy.set_faults(Faults(stall_rate=1.0))
            with pytest.raises(TimeoutError):
                await conn.fetchval("select 2", timeout=0.3)
        finally:
            conn.terminate()
        proxy.set_faults(Faults())
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{port}/test", timeout=5)
        try:
            proxy.set_faults(Faults(reset_rate=1.0))
            with pytest.raises((ConnectionError, asyncpg.PostgresConnectionError)):
                await conn.fetchval("select 3")
        finally:
            conn.terminate()
    stats = proxy.stats()
    assert stats.faults_injected["stall"] >= 1 and stats.faults_injected["reset"] >= 1
    assert_no_proxy_tasks()


async def test_tcp_backpressure_keeps_memory_bounded() -> None:
    """An upstream that sends 32 MiB to a client reading slowly: the proxy holds at most its
    queue's worth, not the whole answer."""
    total = 32 * 1024 * 1024

    async def blast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        block = b"z" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(blast, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with FaultProxy(("127.0.0.1", port)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            received = 0
            while received < total:
                data = await reader.read(65536)
                if not data:
                    break
                received += len(data)
                if received < 4 * 1024 * 1024:
                    await asyncio.sleep(0.002)  # slow at first: the proxy must push back
            writer.close()
            assert received == total
            stats = proxy.stats()
    finally:
        server.close()
        await server.wait_closed()
    assert stats.max_buffered_bytes <= 2 * 18 * 65536
    assert stats.bytes_to_client == total


async def test_close_cancels_connections_in_flight(upstream: tuple[str, int]) -> None:
    proxy = FaultProxy(upstream, mode="http", faults=Faults(stall_rate=1.0))
    await proxy.start()
    async with httpx.AsyncClient(timeout=5) as client:
        pending = asyncio.ensure_future(client.get(base(proxy) + "/hello"))
        await asyncio.sleep(0.2)
        await proxy.close()
        with pytest.raises(httpx.TransportError):
            await pending
    assert_no_proxy_tasks()
    assert proxy.stats().active_connections == 0


async def test_cli_runs_a_timeline_and_prints_its_stats(
    upstream: tuple[str, int], tmp_path: Path
) -> None:
    timeline = tmp_path / "faults.toml"
    timeline.write_text("[[step]]\nat = 0\n\n[[step]]\nat = 0.5\nerror_rate = 1.0\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "brownout", "proxy", "--mode", "http",
        "--upstream", f"{upstream[0]}:{upstream[1]}", "--timeline", str(timeline),
        "--control", "127.0.0.1:0", "--duration", "20",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": SRC},
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = json.loads(await asyncio.wait_for(process.stdout.readline(), 15))
        assert first["event"] == "listening" and first["mode"] == "http"
        url = f"http://{first['listen']}/hello"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url)).status_code == 200
            await asyncio.sleep(0.8)
            assert (await client.get(url)).status_code == 503
        process.send_signal(signal.SIGTERM)
        last = json.loads(await asyncio.wait_for(process.stdout.readline(), 15))
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert last["event"] == "stopped"
    assert last["stats"]["requests"] == 2 and last["stats"]["faults_injected"]["error"] == 1
    assert last["stats"]["timeline_step"] == 1


async def test_http_mixed_faults_under_concurrency_are_all_counted(
    upstream: tuple[str, int],
) -> None:
    """200 requests from 10 concurrent aiohttp connections, errors and resets mixed in: every
    request ends in one outcome the counters agree with, and nothing is left open."""
    import aiohttp

    faults = Faults(error_rate=0.2, reset_rate=0.1, latency=0.005, jitter=0.01)
    outcomes = {"ok": 0, "error": 0, "transport": 0}
    async with FaultProxy(upstream, mode="http", faults=faults, seed=3) as proxy:
        connector = aiohttp.TCPConnector(limit=10)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                try:
                    async with session.get(base(proxy) + "/hello") as response:
                        await response.read()
                        outcomes["ok" if response.status == 200 else "error"] += 1
                except aiohttp.ClientError:
                    outcomes["transport"] += 1

            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(200))), 30)
        await asyncio.sleep(0.1)  # the proxy sees the client's connections close
        stats = proxy.stats()
    assert sum(outcomes.values()) == 200
    assert outcomes["error"] == stats.faults_injected["error"]
    # aiohttp sends a GET again, once, when a reused connection was reset under it
    resets = stats.faults_injected["reset"]
    assert outcomes["transport"] <= resets
    assert stats.requests == outcomes["ok"] + outcomes["error"] + resets
    assert outcomes["ok"] > 100
    assert stats.active_connections == 0
    assert_no_proxy_tasks()
