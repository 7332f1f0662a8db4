"""Outbound-call overhead: retry policy and circuit breaker on the success path (issue 6).

Prints, in one run, the cost added to a call that succeeds at once (the common case):
- ``RetryPolicy.call`` and ``Dependency.call`` vs tenacity and stamina (target: at least 5x
  cheaper than stamina);
- ``CircuitBreaker.call`` vs aiobreaker's ``call_async``.
Overhead = time per call minus a bare ``await fn()`` measured in the same round; each figure
is the median of several interleaved rounds, so noise on a shared machine hits all sides
alike. (The httpx transport-vs-bare-httpx figure belongs to the adapter benchmark.)

    flock /tmp/brownout-bench.lock .venv/bin/python bench/retry_bench.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiobreaker
import stamina
import tenacity

from brownout import CircuitBreaker, Dependency, RetryBudget, RetryPolicy

logging.getLogger("stamina").setLevel(logging.ERROR)


async def ok() -> int:
    return 1


Runner = Callable[[int], Awaitable[None]]


def bare() -> Runner:
    async def run(n: int) -> None:
        for _ in range(n):
            await ok()

    return run


def brownout_policy() -> Runner:
    policy = RetryPolicy(3, budget=RetryBudget(ratio=0.1, min_per_second=10))

    async def run(n: int) -> None:
        call = policy.call
        for _ in range(n):
            await call(ok, idempotent=True)

    return run


def brownout_policy_mutation() -> Runner:
    """A mutation: one idempotency key generated per call and set in the context."""
    policy = RetryPolicy(3)

    async def run(n: int) -> None:
        call = policy.call
        for _ in range(n):
            await call(ok)

    return run


def brownout_dependency(**kw: Any) -> Runner:
    dep = Dependency("bench", retry=RetryPolicy(3), **kw)

    async def run(n: int) -> None:
        call = dep.call
        for _ in range(n):
            await call(ok, idempotent=True)

    return run


def tenacity_retry() -> Runner:
    wrapped = tenacity.retry(
        stop=tenacity.stop_after_attempt(3),
        wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
        reraise=True,
    )(ok)

    async def run(n: int) -> None:
        for _ in range(n):
            await wrapped()

    return run


def stamina_retry() -> Runner:
    wrapped = stamina.retry(on=Exception, attempts=3)(ok)

    async def run(n: int) -> None:
        for _ in range(n):
            await wrapped()

    return run


def brownout_breaker() -> Runner:
    breaker = CircuitBreaker()

    async def run(n: int) -> None:
        call = breaker.call
        for _ in range(n):
            await call(ok)

    return run


def aiobreaker_breaker() -> Runner:
    breaker = aiobreaker.CircuitBreaker()

    async def run(n: int) -> None:
        call = breaker.call_async
        for _ in range(n):
            await call(ok)

    return run


async def per_call(runner: Runner, n: int) -> float:
    t = time.perf_counter()
    await runner(n)
    return (time.perf_counter() - t) / n


def fmt(seconds: float) -> str:
    ns = seconds * 1e9
    return f"{ns / 1000:.2f} us" if ns >= 1000 else f"{ns:.0f} ns"


async def main(calls: int, rounds: int) -> None:
    cases: dict[str, Runner] = {
        "bare await": bare(),
        "RetryPolicy.call (idempotent)": brownout_policy(),
        "RetryPolicy.call (mutation, keyed)": brownout_policy_mutation(),
        "Dependency.call (retry only)": brownout_dependency(),
        "Dependency.call (timeout=1s)": brownout_dependency(timeout=1.0),
        "Dependency.call (+breaker)": brownout_dependency(breaker=CircuitBreaker()),
        "tenacity.retry (3 attempts)": tenacity_retry(),
        "stamina.retry (3 attempts)": stamina_retry(),
        "CircuitBreaker.call": brownout_breaker(),
        "aiobreaker call_async": aiobreaker_breaker(),
    }
    for runner in cases.values():  # warm up
        await per_call(runner, min(calls, 2000))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        base = await per_call(cases["bare await"], calls)
        for name, runner in cases.items():
            if name == "bare await":
                samples[name].append(base)
            else:
                samples[name].append(max(0.0, await per_call(runner, calls) - base))
    over = {name: statistics.median(v) for name, v in samples.items()}

    print(f"retry/breaker success-path overhead: {calls} calls x {rounds} rounds (median)")
    print(f"  {'bare await (per call, not overhead)':44s} {fmt(over['bare await']):>10s}")
    for name in cases:
        if name != "bare await":
            print(f"  {name:44s} {fmt(over[name]):>10s}")
    policy = over["RetryPolicy.call (idempotent)"]
    dep = over["Dependency.call (retry only)"]
    st, ten = over["stamina.retry (3 attempts)"], over["tenacity.retry (3 attempts)"]
    br, aio = over["CircuitBreaker.call"], over["aiobreaker call_async"]
    print("ratios (competitor overhead / brownout overhead; higher = brownout cheaper):")
    print(f"  stamina  / RetryPolicy.call   {st / policy:6.1f}x   (target >= 5x)")
    print(f"  stamina  / Dependency.call    {st / dep:6.1f}x")
    print(f"  tenacity / RetryPolicy.call   {ten / policy:6.1f}x")
    print(f"  aiobreaker / CircuitBreaker   {aio / br:6.1f}x")
    verdict = "PASS" if st / policy >= 5 else "MISS"
    print(f"target stamina >= 5x RetryPolicy: {verdict}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds))
