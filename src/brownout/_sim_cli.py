"""``brownout sim FILE``: run a simulated system described in TOML and judge its invariants.

Prints progress on stderr, a per-layer table of offered / admitted / shed / retried /
completed-in-deadline over time on stdout, writes the JSON result (``--json``) and, with
``--out DIR``, plots and an HTML report; exits 1 when a declared invariant fails (2 for a
model that cannot run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ._help import HelpFormatter
from ._sim import ModelError, load, simulate
from ._sim_report import write_report

__all__ = ["add_arguments", "main"]

EXIT_OK, EXIT_INVARIANT, EXIT_USAGE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Run a simulated system (a TOML model) on virtual time."
    p.add_argument("file", type=Path, help="the model, a TOML file (docs/simulator.md)")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the result (default: sim-result.json; with --out, DIR/result.json)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write plots and an HTML report (index.html) into this directory",
    )
    p.add_argument("--seed", type=int, default=None, help="override the file's seed")
    p.add_argument(
        "--every",
        type=int,
        default=None,
        help="buckets per table row (default: about 15 rows per layer)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="brownout sim", formatter_class=HelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        system = load(args.file)
    except ModelError as e:
        print(f"brownout sim: {args.file} cannot run:", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.out is not None and importlib.util.find_spec("matplotlib") is None:
        # Said before a long run, not after it.
        print("brownout sim: --out needs matplotlib (pip install 'brownout[lab]')", file=sys.stderr)
        return EXIT_USAGE
    if args.seed is not None:
        system = replace(system, seed=args.seed)
    started = time.perf_counter()

    def progress(t: float, duration: float) -> None:
        if not args.quiet:
            wall = time.perf_counter() - started
            print(f"sim: {t:g}/{duration:g} s simulated, {wall:.1f} s wall", file=sys.stderr)

    result = simulate(system, progress=progress)
    every = args.every if args.every else max(1, result.n // 15)
    print(result.table(every=every))
    print()
    if result.verdicts:
        for verdict in result.verdicts:
            print(verdict.describe())
    else:
        print("no invariants declared")
    wall = result.wall_seconds
    print(
        f"{result.requests} requests simulated in {wall:.1f} s wall"
        f" ({result.requests / wall if wall > 0 else 0.0:.0f} per second)",
        file=sys.stderr,
    )
    if args.json is not None or args.out is None:
        path = args.json if args.json is not None else Path("sim-result.json")
        path.write_text(json.dumps(result.to_json(), indent=1))
        print(f"result written to {path}", file=sys.stderr)
    if args.out is not None:
        write_report(result, args.out, source=str(args.file))
        print(f"report written to {args.out / 'index.html'}", file=sys.stderr)
    return EXIT_OK if result.passed else EXIT_INVARIANT
