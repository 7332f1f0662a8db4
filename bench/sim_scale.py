"""The simulator at fleet scale: a 1,000-instance, 3-layer graph at its capacity.

web (20% of the instances) -> api (40%) -> db (40%). Per instance: web 2 workers x 125 ms
(16 req/s), api 2 workers x 250 ms (8 req/s), db 2 workers x 125 ms (16 req/s), log-normal
service times (sigma 0.5); with 200 / 400 / 400 instances each layer serves 3,200 req/s, and
the users offer ``--load`` times that (Poisson, 2 s deadline). Every instance has its own
`Bulkhead` (16 / 6 / 4); every calling instance its own `Dependency` per edge (web -> api:
1.8 s timeout, one attempt; api -> db: 0.5 s timeout, 3 attempts under a 10% `RetryBudget`);
deadlines propagate.

Prints one JSON line: simulated requests (offered at every layer, users and retries
included), wall and CPU seconds, requests per wall and per CPU second, per-layer goodput.
Run it under the lock (docs/benchmarks.md, "The simulator at fleet scale"):

    flock /tmp/brownout-bench.lock /usr/bin/time -v env PYTHONPATH=src \
        .venv/bin/python bench/sim_scale.py [--instances 1000] [--duration 60] [--load 1.0]
        [--profile N]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import sys
import time
from collections.abc import Callable

from brownout import Bulkhead, Dependency, ExponentialBackoff, RetryBudget, RetryPolicy
from brownout.limits import FixedLimit
from brownout.sim import Arrivals, Build, Call, LogNormal, Service, System, simulate


def fleet(instances: int, duration: float, load: float) -> System:
    web, api, db = round(instances * 0.2), round(instances * 0.4), round(instances * 0.4)

    def bulkhead(limit: int) -> Callable[[Build], Bulkhead]:
        return lambda b: Bulkhead(b.name, FixedLimit(limit), loop_lag=None)

    def edge(timeout: float, attempts: int) -> Callable[[Build], Dependency]:
        def build(b: Build) -> Dependency:
            retry = RetryPolicy(
                attempts, budget=RetryBudget(0.1), backoff=ExponentialBackoff(0.01, rng=b.rng)
            )
            return Dependency(b.name, timeout=timeout, reserve=0.01, retry=retry)

        return build

    zones = ("a", "b", "c")
    # Each layer can serve 16 req/s per web instance: 3,200 req/s for 1,000 instances.
    capacity = min(web * 2 / 0.125, api * 2 / 0.25, db * 2 / 0.125 / 2)
    return System(
        services=(
            Service(
                "web", instances=web, workers=2, service_time=LogNormal(0.125, 0.5),
                zones=zones, bulkhead=bulkhead(16), deadline=2.0,
                calls=(Call("api", dependency=edge(1.8, 1)),),
            ),
            Service(
                "api", instances=api, workers=2, service_time=LogNormal(0.25, 0.5),
                zones=zones, bulkhead=bulkhead(6),
                calls=(Call("db", dependency=edge(0.5, 3)),),
            ),
            Service(
                "db", instances=db, workers=2, service_time=LogNormal(0.125, 0.5),
                zones=zones, bulkhead=bulkhead(4),
            ),
        ),
        arrivals=(
            Arrivals("users", rate=load * capacity, call=Call("web"), deadline=2.0),
        ),
        duration=duration,
        bucket=5.0,
        seed=1,
        metadata={"capacity": capacity},
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=1000)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--load", type=float, default=1.0, help="offered / capacity")
    p.add_argument("--profile", type=int, default=0, help="print the top N of a cProfile")
    args = p.parse_args()
    system = fleet(args.instances, args.duration, args.load)
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    wall0 = time.perf_counter()
    if args.profile:
        prof = cProfile.Profile()
        result = prof.runcall(simulate, system)
    else:
        result = simulate(system)
    wall = time.perf_counter() - wall0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    n = result.requests
    d = args.duration
    report = {
        "instances": args.instances,
        "duration": d,
        "offered_per_s": system.arrivals[0].rate,
        "capacity_per_s": system.metadata["capacity"],
        "requests": n,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "per_wall_s": round(n / wall),
        "per_cpu_s": round(n / cpu),
        "max_rss_mb": round(usage1.ru_maxrss / 1024),
        "loadavg": os.getloadavg(),
        "python": sys.version.split()[0],
        "goodput_per_s": {
            name: round(result.metric(name, "completed"), 1) for name in result.layers
        },
        "users_success_ratio": round(result.metric("users", "success_ratio"), 4),
    }
    print(json.dumps(report))
    if args.profile:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
