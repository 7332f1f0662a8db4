"""Deadline scope, context lookup and codec costs (issue #2).

Prints ratios against baselines measured in the same run:
- ``async with brownout.deadline(...)`` vs ``async with asyncio.timeout(...)`` (target <= 1.2x)
- context lookups per second (``brownout.current()``, ``brownout.remaining()``)
- grpc-timeout and budget-ms encode/decode cost

Run: .venv/bin/python bench/deadline_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import brownout
from brownout.wire import (
    decode_budget_ms,
    decode_grpc_timeout,
    encode_budget_ms,
    encode_grpc_timeout,
)

N = 100_000


# Every 50 scopes the loop turns, as a server's does between requests: that is when asyncio
# drops cancelled timers from its heap. A loop that never turns piles up 100,000 cancelled
# timers, and every garbage collection then walks them: that measures the pile, not the scope.
TURN_EVERY = 50


async def scope_asyncio_timeout(n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        async with asyncio.timeout(1.0):
            pass
        if i % TURN_EVERY == 0:
            await asyncio.sleep(0)
    return time.perf_counter() - t0


async def scope_brownout_deadline(n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        async with brownout.deadline(1.0):
            pass
        if i % TURN_EVERY == 0:
            await asyncio.sleep(0)
    return time.perf_counter() - t0


async def scope_brownout_nested(n: int) -> float:
    async with brownout.deadline(5.0):
        t0 = time.perf_counter()
        for i in range(n):
            async with brownout.deadline(1.0):
                pass
            if i % TURN_EVERY == 0:
                await asyncio.sleep(0)
        return time.perf_counter() - t0


def per_op(fn: Callable[[], object], n: int = N) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def best_of(rounds: int, make: Callable[[], float]) -> float:
    return min(make() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    try:
        ratios = []
        base_us = ours_us = nested_us = 0.0
        for _ in range(args.rounds):  # interleave, so drift on a noisy machine hits both sides
            base = loop.run_until_complete(scope_asyncio_timeout(N)) / N * 1e6
            ours = loop.run_until_complete(scope_brownout_deadline(N)) / N * 1e6
            nested = loop.run_until_complete(scope_brownout_nested(N)) / N * 1e6
            ratios.append(ours / base)
            base_us, ours_us, nested_us = (
                min(base_us or base, base),
                min(ours_us or ours, ours),
                min(nested_us or nested, nested),
            )
    finally:
        loop.close()
    print(f"asyncio.timeout scope            {base_us:8.3f} us")
    print(f"brownout._deadline scope          {ours_us:8.3f} us")
    print(f"brownout._deadline nested scope   {nested_us:8.3f} us")
    print(
        f"ratio deadline/timeout           {statistics.median(ratios):8.3f}x (median of "
        f"{len(ratios)} interleaved rounds; best {min(ratios):.3f}x; target <= 1.2x)"
    )
    with brownout.request(deadline=5.0, caller="bench"):
        cur = per_op(brownout.current)
        rem = per_op(brownout.remaining)
    print(f"brownout.current()               {1 / cur / 1e6:8.2f} M lookups/s ({cur * 1e9:.0f} ns)")
    print(f"brownout.remaining()             {1 / rem / 1e6:8.2f} M lookups/s ({rem * 1e9:.0f} ns)")
    for name, fn in [
        ("encode_grpc_timeout(1.234)", lambda: encode_grpc_timeout(1.234)),
        ("decode_grpc_timeout('1234000u')", lambda: decode_grpc_timeout("1234000u")),
        ("encode_budget_ms(1.234)", lambda: encode_budget_ms(1.234)),
        ("decode_budget_ms('1234')", lambda: decode_budget_ms("1234")),
    ]:
        print(f"{name:32} {per_op(fn) * 1e9:8.0f} ns")
    signer = brownout.BudgetSigner({"k1": b"0123456789abcdef0123"})
    signed = signer.sign(1.5)
    print(f"{'BudgetSigner.sign':32} {per_op(lambda: signer.sign(1.5), 20_000) * 1e6:8.2f} us")
    print(
        f"{'BudgetSigner.verify':32} {per_op(lambda: signer.verify(signed), 20_000) * 1e6:8.2f} us"
    )


if __name__ == "__main__":
    main()
