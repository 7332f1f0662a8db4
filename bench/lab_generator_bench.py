"""How much load the lab's generator sustains on one core, against httpx in the same run.

A trivial keep-alive HTTP/1.1 server runs in its own process on one core; the generator runs
open loop in another process on the other core at rising rates. A rate counts as sustained
when every request got its 2xx and the generator's p99 lateness stayed <= 5 ms. The baseline
is httpx.AsyncClient, closed loop with 64 concurrent workers, against the same server.

    flock /tmp/brownout-bench.lock .venv/bin/python bench/lab_generator_bench.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

from brownout._lab.generator import MAX_LATENESS, LoadPlan, LoadStep, TrafficClass
from brownout._lab.process import GeneratorProcess, new_event_loop, pin_to, usable_cpus
from brownout._lab.tally import Tally

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(RESPONSE * data.count(b"\r\n\r\n"))  # type: ignore[attr-defined]


def _serve(port_queue: multiprocessing.Queue, cpus: list[int]) -> None:  # type: ignore[type-arg]
    pin_to(cpus)
    loop = new_event_loop()
    server = loop.run_until_complete(loop.create_server(_Echo, "127.0.0.1", 0))
    port_queue.put(server.sockets[0].getsockname()[1])
    loop.run_forever()


async def _httpx_baseline(port: int, seconds: float = 2.0) -> float:
    import httpx

    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                r = await client.get(f"http://127.0.0.1:{port}/")
                if r.status_code == 200:
                    done += 1

        await asyncio.gather(*(worker() for _ in range(64)))
    return done / seconds


def main() -> None:
    cpus = usable_cpus()
    gen_cpus, server_cpus = [cpus[0]], [cpus[-1]]
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    server = ctx.Process(target=_serve, args=(ports, server_cpus), daemon=True)
    server.start()
    port = ports.get(timeout=10)
    pin_to(gen_cpus)
    baseline = asyncio.run(_httpx_baseline(port))
    print(f"httpx.AsyncClient (64 workers, closed loop): {baseline:,.0f} req/s")
    best = 0.0
    with GeneratorProcess(gen_cpus) as gen:
        for rate in (2_000, 4_000, 8_000, 12_000, 16_000, 20_000):
            plan = LoadPlan(
                "127.0.0.1",
                port,
                (TrafficClass("a", "/"),),
                (LoadStep("run", rate, 3.0, (("a", 1.0),), settle=0.5),),
                deadline=1.0,
            )
            step = gen.run(plan).steps[0]
            t = Tally.merged(step.steady.values())
            ok = t.ok == t.offered
            sustained = ok and step.lateness_p99 <= MAX_LATENESS
            print(
                f"open loop {rate:>6,} req/s: goodput {t.ok / step.steady_seconds:>8,.0f}/s, "
                f"p99 latency {t.summary(1)['success_p99_ms']} ms, generator p99 lateness "
                f"{step.lateness_p99 * 1000:.2f} ms, connections {step.connections_opened}"
                f" -> {'sustained' if sustained else 'NOT sustained'}"
            )
            if sustained:
                best = max(best, rate)
    print(f"sustained {best:,.0f} req/s on one core = {best / baseline:.1f}x httpx")
    server.kill()


if __name__ == "__main__":
    main()
