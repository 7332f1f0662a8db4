"""``brownout proxy``: the command line of `FaultProxy` (standard library only)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from .._help import HelpFormatter
from .faults import Faults, FaultsError, Timeline, load_timeline
from .netem import netem_status
from .proxy import FaultProxy, ProxyError, parse_address

__all__ = ["main", "parser"]

FAULT_OPTIONS: list[tuple[str, type, str]] = [  # (name, type, help); metavar from the type
    ("latency", float, "seconds added to each request (http) or chunk towards the upstream (tcp)"),
    ("jitter", float, "up to this many seconds more, uniformly drawn, on top of --latency"),
    ("connect-latency", float, "seconds added before the upstream is dialled, per connection"),
    ("error-rate", float, "http: answer this fraction of requests with --error-status"),
    ("error-status", int, "the status of an injected error (default 503)"),
    ("error-body", str, "the body of an injected error"),
    ("reset-rate", float, "reset (RST) this fraction of requests (http) or connections (tcp)"),
    ("stall-rate", float, "go silent on this fraction of requests (http) or connections (tcp)"),
    ("loss-rate", float, "hold back this fraction of chunks --loss-delay (emulated loss)"),
    ("loss-delay", float, "seconds a 'lost' chunk is held back (default 0.2, a minimum RTO)"),
]


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if p is None:
        p = argparse.ArgumentParser(prog="brownout proxy", formatter_class=HelpFormatter)
    p.description = (
        "A fault-injecting TCP/HTTP proxy between your service and one of its dependencies."
    )
    p.epilog = (
        "Prints one JSON line when listening and one with its counters when stopped "
        "(SIGINT, SIGTERM or --duration). exit status: 0 stopped, 2 usage error, "
        "3 could not listen"
    )
    p.add_argument(
        "--listen", default="127.0.0.1:0", metavar="ADDR", help="HOST:PORT or PORT (port 0: any)"
    )
    p.add_argument("--upstream", metavar="HOST:PORT", help="HOST:PORT of the dependency")
    p.add_argument(
        "--mode",
        choices=("tcp", "http"),
        default="tcp",
        help="tcp: bytes, any protocol; http: HTTP/1.1 requests (error responses possible)",
    )
    for name, kind, text in FAULT_OPTIONS:
        metavar = {float: "P" if name.endswith("rate") else "S", int: "N", str: "TEXT"}[kind]
        p.add_argument(f"--{name}", type=kind, metavar=metavar, help=text)
    p.add_argument(
        "--timeline", metavar="FILE", help="a TOML file of [[step]] tables (at = seconds, faults)"
    )
    p.add_argument(
        "--control",
        metavar="ADDR",
        help="HOST:PORT of the control endpoint (GET/PUT /faults, GET /stats, GET /arrivals)",
    )
    p.add_argument("--duration", type=float, metavar="S", help="stop after this many seconds")
    p.add_argument("--seed", type=int, help="seed of the fault draws (repeatable runs)")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback addresses")
    p.add_argument(
        "--netem-check", action="store_true", help="say whether tc netem is usable here, and exit"
    )
    return p


def _print(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


async def _run(proxy: FaultProxy, duration: float | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    control = proxy.control_address
    _print(
        "listening",
        listen=f"{proxy.address[0]}:{proxy.address[1]}",
        upstream=f"{proxy.upstream[0]}:{proxy.upstream[1]}",
        mode=proxy.mode,
        control=f"{control[0]}:{control[1]}" if control else None,
    )
    try:
        await asyncio.wait_for(stop.wait(), duration)
    except TimeoutError:
        pass
    finally:
        await proxy.close()
        _print("stopped", stats=proxy.stats().as_dict())


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.netem_check:
        status = netem_status()
        _print("netem", usable=status.usable, how=status.how, detail=status.detail)
        return 0
    try:
        if not args.upstream:
            raise ProxyError("--upstream HOST:PORT is required")
        values = {
            name.replace("-", "_"): getattr(args, name.replace("-", "_"))
            for name, _, _ in FAULT_OPTIONS
            if getattr(args, name.replace("-", "_")) is not None
        }
        faults = Faults.from_mapping(values)
        timeline: Timeline | None = load_timeline(args.timeline) if args.timeline else None
        if args.duration is not None and not 0 < args.duration <= 86400:
            raise ProxyError("--duration must be more than 0 and at most 86400 seconds")
        proxy = FaultProxy(
            parse_address(args.upstream),
            listen=parse_address(args.listen, default_host="127.0.0.1"),
            mode=args.mode,
            faults=faults,
            timeline=timeline,
            control=parse_address(args.control, default_host="127.0.0.1") if args.control else None,
            allow_remote=args.allow_remote,
            seed=args.seed,
        )
    except (ProxyError, FaultsError) as e:
        print(f"brownout proxy: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(proxy, args.duration))
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"brownout proxy: could not listen: {e}", file=sys.stderr)
        return 3
    return 0
