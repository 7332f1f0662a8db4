# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this marker)
"""The ``brownout`` command: ``brownout lab`` (the overload lab) and ``brownout top``.

``brownout lab`` starts the embedded demo system (real uvicorn processes), measures its
capacity, drives it past the breaking point with an open-loop generator in four
configurations side by side, prints a table per scenario, writes ``lab-report/`` (PNG plots,
raw JSON, an HTML page) and exits non-zero when a brownout invariant fails, so it can run in
CI. ``brownout lab --target http://127.0.0.1:PORT/path`` runs the ramp against your own
service instead (loopback addresses only); ``brownout lab --scenario FILE`` runs a scenario
file (endpoints, steps, invariants) against its base URL, any http(s) URL.

Exit statuses, the same for every command (docs/cli.md): `EXIT_OK`, `EXIT_INVARIANT`,
`EXIT_USAGE` (argparse's own), `EXIT_UNREACHABLE`, `EXIT_MISSING_EXTRA`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from ._help import HelpFormatter
from ._version import VERSION

if TYPE_CHECKING:  # (the lab's imports stay lazy: `brownout top` does not need them)
    from rich.console import Console

    from ._lab.verdict import Check

__all__ = ["main", "parse_target"]

EXIT_OK = 0
EXIT_INVARIANT = 1
"""``brownout lab``: an invariant failed (or held only on a host-bound step)."""
EXIT_USAGE = 2
"""Bad arguments: argparse's own status, kept for every usage error."""
EXIT_UNREACHABLE = 3
"""The service could not be read (``top``) or the run could not complete (``lab``)."""
EXIT_MISSING_EXTRA = 4
"""The command needs an extra that is not installed."""


class TargetError(ValueError):
    """A ``--target`` the lab refuses to load-test."""


def parse_target(url: str) -> tuple[str, int, str]:
    """(host, port, path) of a loopback ``http://`` URL; `TargetError` for anything else.

    The lab only ever sends load to this machine: a load test aimed at another host by
    mistake is an attack on it.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise TargetError(f"--target must be an http:// URL, not {url!r}")
    host = parts.hostname or ""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise TargetError(
            f"--target host {parts.hostname!r} is not a loopback address; the lab only "
            "load-tests services on this machine (127.0.0.0/8, ::1 or localhost)"
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise TargetError(f"--target needs an explicit port: {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return host, port, path


def _seconds_up_to(ceiling: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in (0, ceiling]. A negative, zero, NaN or
    infinite duration would otherwise start a lab run that measures nothing useful (or never
    ends), so it is refused before anything starts."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (0.0 < value <= ceiling):  # also false for NaN
            raise argparse.ArgumentTypeError(
                f"{text!r}: must be more than 0 and at most {ceiling:g} seconds"
            )
        return value

    return seconds


def _lab_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from ._lab.runner import CONFIGURATIONS
    from ._lab.scenarios import DEFAULT_SCENARIOS, OPT_IN_SCENARIOS, SCENARIOS

    if p is None:
        p = argparse.ArgumentParser(prog="brownout lab", formatter_class=HelpFormatter)
    p.description = "Overload lab: goodput past the breaking point, protected vs unprotected."
    p.epilog = (
        "exit status: 0 every invariant held, 1 an invariant failed, 2 usage error, "
        "3 the run could not complete, 4 the lab extra is not installed"
    )
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument(
        "--target", help="your own service: http://127.0.0.1:PORT/path (loopback only; the ramp)"
    )
    p.add_argument(
        "--health-path", help="with --target: also flood at 10x and time this health path"
    )
    p.add_argument(
        "--scenario",
        metavar="FILE",
        help="run this scenario file (TOML, docs/lab.md) against its base_url; --target "
        "then replaces the base URL (any http:// or https:// URL)",
    )
    p.add_argument(
        "--metrics-url",
        metavar="URL",
        help="with --target or --scenario: your service's brownout metrics (Prometheus text; a "
        "path such as /metrics is taken on the target's host), scraped to show the server's "
        "view beside the client's",
    )
    p.add_argument(
        "--server-view",
        action="store_true",
        help="the demo's protected fronts serve brownout's metrics and the lab scrapes them to "
        "show the server's view beside the client's (off by default: exporting adds the "
        "front's event tallies to its work; needs prometheus-client)",
    )
    p.add_argument(
        "--find-capacity",
        action="store_true",
        help="with --scenario: find the knee first and take the load multiples of it, even "
        "when the file declares a capacity",
    )
    p.add_argument(
        "--configs",
        help=f"comma-separated configurations (default: all of {','.join(CONFIGURATIONS)})",
    )
    p.add_argument(
        "--scenarios",
        help=f"comma-separated scenarios (default: {','.join(DEFAULT_SCENARIOS)}; "
        f"opt-in: {','.join(OPT_IN_SCENARIOS)},backlog,payments,database; known: "
        f"{','.join(SCENARIOS)},backlog,payments,database; backlog runs on Redis Streams, see "
        "--redis; payments on PostgreSQL and Redis, database on PostgreSQL, see --postgres)",
    )
    p.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="the Redis the backlog and payments scenarios use (they create and delete their "
        "own keys)",
    )
    p.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="the PostgreSQL the payments and database scenarios use (payments creates and drops "
        "its own tables; database only runs queries and takes advisory locks)",
    )
    p.add_argument(
        "--drill",
        metavar="MODE",
        help="force this declared degraded mode of the demo front on for the whole run "
        "(protected configurations; known: recommendations)",
    )
    p.add_argument("--out", default="lab-report", help="report folder")
    p.add_argument("--markdown", help="also write this Markdown page (e.g. docs/lab.md)")
    p.add_argument(
        "--compare",
        metavar="OLD.json",
        help="after the run, compare with this older report.json: print the steps that "
        "regressed and write compare.md into --out (the exit status is unchanged)",
    )
    p.add_argument(
        "--deadline",
        type=_seconds_up_to(60.0),
        help="client deadline in seconds, more than 0 and at most 60 "
        "(default: 1, or 0.5 with --quick)",
    )
    p.add_argument(
        "--step",
        type=_seconds_up_to(3600.0),
        help="seconds per step, at least 3x the deadline and at most 3600 "
        "(default: 6, or 1.5 with --quick)",
    )
    p.add_argument(
        "--poisson", action="store_true", help="Poisson arrivals (default: constant rate)"
    )
    p.add_argument(
        "--no-fail", action="store_true", help="exit 0 even when an invariant fails (report only)"
    )
    return p


def lab_main(argv: list[str]) -> int:
    """``brownout lab``: run, report, and return the exit status (1 when an invariant fails)."""
    from dataclasses import asdict, replace

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    from ._lab.backlog import (
        BACKLOG,
        BacklogSettings,
        quick_settings,
        run_backlog,
    )
    from ._lab.database import DATABASE, DatabaseSettings, run_database
    from ._lab.database import quick_settings as quick_database
    from ._lab.payments import PAYMENTS, PaymentsSettings, run_payments
    from ._lab.payments import quick_settings as quick_payments
    from ._lab.runner import CONFIGURATIONS, Configuration, LabSettings, Target, run_lab
    from ._lab.scenarios import DEFAULT_SCENARIOS, QUICK_SCENARIOS, SCENARIOS, quick_variant
    from ._lab.verdict import evaluate, judged_runs

    args = _lab_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file or CI: do not squeeze the tables
    old = _load_compare(args.compare, console)
    if old is False:
        return EXIT_USAGE
    if args.scenario:
        return _scenario_main(args, argv, console, old)
    if args.find_capacity:
        console.print("[red]error:[/] --find-capacity goes with --scenario FILE")
        return EXIT_USAGE
    if args.metrics_url and not args.target:
        console.print("[red]error:[/] --metrics-url goes with --target URL or --scenario FILE")
        return EXIT_USAGE
    if args.server_view:
        if args.target:
            console.print(
                "[red]error:[/] --server-view is the demo's; with --target: --metrics-url"
            )
            return EXIT_USAGE
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            console.print(
                "[red]error:[/] --server-view needs prometheus-client: pip install "
                "'brownout[lab,prometheus]'"
            )
            return EXIT_USAGE
    settings = LabSettings.quick() if args.quick else LabSettings()
    if args.deadline is not None:
        settings = replace(settings, deadline=args.deadline, settle_seconds=min(args.deadline, 1))
    if args.step is not None:
        settings = replace(settings, step_seconds=args.step)
    if args.poisson:
        settings = replace(settings, arrivals="poisson")
    if args.drill:
        from ._lab.protect import DEMO_MODES

        if args.target:
            console.print("[red]error:[/] --drill drives the demo's degraded modes, not --target")
            return 2
        if args.drill not in DEMO_MODES:
            console.print(
                f"[red]error:[/] --drill {args.drill!r}: the demo declares {', '.join(DEMO_MODES)}"
            )
            return 2
        settings = replace(settings, drill=args.drill)
    if args.server_view:
        settings = replace(settings, server_view=True)
    if settings.step_seconds < 3 * settings.deadline:
        console.print(
            f"[yellow]note:[/] steps of {settings.step_seconds:g}s are shorter than 3x the "
            f"{settings.deadline:g}s deadline; figures may not reach steady state"
        )
    target: Target | None = None
    try:
        if args.target:
            host, port, path = parse_target(args.target)
            metrics = _metrics_url(args.metrics_url, args.target)
            target = Target(host, port, path, args.health_path, metrics_url=metrics)
            configs = [Configuration("target", args.target, "target", None, True)]
            names = ["ramp", "health"] if args.health_path else ["ramp"]
        else:
            configs = [
                CONFIGURATIONS[n]
                for n in (args.configs.split(",") if args.configs else list(CONFIGURATIONS))
            ]
            default = QUICK_SCENARIOS if args.quick else DEFAULT_SCENARIOS
            names = args.scenarios.split(",") if args.scenarios else list(default)
        backlog = BACKLOG in names
        payments = PAYMENTS in names
        database = DATABASE in names
        names = [n for n in names if n not in (BACKLOG, PAYMENTS, DATABASE)]
        scenarios = [SCENARIOS[n] for n in names]
        if args.quick:
            scenarios = [quick_variant(s) for s in scenarios]
    except TargetError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except KeyError as e:
        console.print(f"[red]error:[/] unknown configuration or scenario {e}")
        return 2
    if target is not None:
        scenarios = [s for s in scenarios if not s.needs_dependency]

    started = time.monotonic()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        tasks: dict[tuple[str, str], TaskID] = {}
        for c in configs:
            for s in scenarios:
                if c.runs(s):  # the runner skips the others
                    tasks[(c.name, s.name)] = progress.add_task(f"{c.title}: {s.title}", total=None)

        def on_progress(config: str, scenario: str, done: float, total: float) -> None:
            task = tasks[(config, scenario)]
            progress.update(task, completed=done, total=total)

        def on_stage(message: str) -> None:
            progress.console.print(f"[dim]{time.monotonic() - started:6.1f}s[/] {message}")

        try:
            if scenarios:
                lab = run_lab(
                    settings,
                    configs,
                    scenarios,
                    target=target,
                    on_progress=on_progress,
                    on_stage=on_stage,
                )
            else:  # backlog, payments, database alone need no HTTP demo and no calibration
                lab = {
                    "settings": asdict(settings),
                    "target": None,
                    "calibration": None,
                    "configurations": [],
                    "scenarios": [],
                    "runs": [],
                }
        except RuntimeError as e:
            console.print(f"[red]error:[/] {e}")
            return EXIT_UNREACHABLE
        if backlog:
            base = BacklogSettings(redis_url=args.redis)
            try:
                lab["backlog"] = run_backlog(quick_settings(base) if args.quick else base, on_stage)
            except RuntimeError as e:  # BrokerUnavailable, or a consumer that did not start
                console.print(f"[yellow]backlog scenario not measured:[/] {e}")
                lab["backlog"] = {"skipped": str(e)}
                if not scenarios:
                    return EXIT_UNREACHABLE
        if payments:
            pay = PaymentsSettings(dsn=args.postgres, redis_url=args.redis)
            try:
                lab["payments"] = run_payments(quick_payments(pay) if args.quick else pay, on_stage)
            except RuntimeError as e:  # ServicesUnavailable, or a process that did not start
                console.print(f"[yellow]payments scenario not measured:[/] {e}")
                lab["payments"] = {"skipped": str(e)}
                if not scenarios and not backlog:
                    return EXIT_UNREACHABLE
        if database:
            db = DatabaseSettings(dsn=args.postgres)
            try:
                lab["database"] = run_database(quick_database(db) if args.quick else db, on_stage)
            except RuntimeError as e:  # DatabaseUnavailable, or a front that did not start
                console.print(f"[yellow]database scenario not measured:[/] {e}")
                lab["database"] = {"skipped": str(e)}
                if not scenarios and not backlog and not payments:
                    return EXIT_UNREACHABLE
        for task in tasks.values():
            t = progress.tasks[task]
            if t.total:
                progress.update(task, completed=t.total)
    _write_lab(lab, args, argv, started, old, console)
    if args.markdown:
        console.print(f"markdown: {args.markdown}")
    console.print(f"took {lab['elapsed_seconds']:.0f}s")
    return conclude(evaluate(lab), console, judged=bool(judged_runs(lab)), no_fail=args.no_fail)


def _load_compare(path: str | None, console: Console) -> dict[str, Any] | Literal[False] | None:
    """The ``--compare`` report, read before the run so a bad path costs no run (False)."""
    if path is None:
        return None
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        console.print(f"[red]error:[/] --compare {path}: {e}", highlight=False)
        return False
    if not isinstance(old, dict) or "runs" not in old:
        console.print(f"[red]error:[/] --compare {path}: not a lab report.json")
        return False
    return old


def _write_lab(
    lab: dict[str, Any],
    args: argparse.Namespace,
    argv: list[str],
    started: float,
    old: Any,
    console: Any,
) -> None:
    """Stamp a finished lab run (time, command, host), print its tables and write its report,
    the comparison with ``--compare`` and the ``--markdown`` page."""
    from ._lab.ci_report import environment
    from ._lab.report import print_tables, write_markdown, write_report

    lab["elapsed_seconds"] = round(time.monotonic() - started, 1)
    lab["command"] = ("brownout lab " + shlex.join(argv)).strip()
    lab["environment"] = environment()
    print_tables(lab, console)
    out = Path(args.out)
    write_report(lab, out, command=lab["command"])
    console.print(
        f"report: {out / 'index.html'} (plots, raw JSON, report.md, junit.xml, steps.csv)"
    )
    _compare(old, args.compare, lab, out, console)
    if args.markdown:
        write_markdown(lab, out, Path(args.markdown), lab["command"])


def _compare(
    old: dict[str, Any] | None, path: str | None, lab: dict[str, Any], out: Path, console: Console
) -> None:
    """Print the steps that regressed against ``old`` and write compare.md beside the report."""
    if old is None or path is None:
        return
    from ._lab.compare import COMPARE_COLUMNS, compare_markdown, compare_reports, compare_rows
    from ._lab.report import rich_table

    deltas = compare_reports(old, lab)
    (out / "compare.md").write_text(compare_markdown(deltas, path))
    rows = compare_rows(deltas)
    if not rows:
        console.print(f"compared with {path}: no step regressed ({len(deltas)} steps)")
        return
    console.print(rich_table(f"regressed against {path}", COMPARE_COLUMNS, rows))
    console.print(f"compare: {out / 'compare.md'}")


def _scenario_main(
    args: argparse.Namespace,
    argv: list[str],
    console: Console,
    old: dict[str, Any] | None = None,
) -> int:
    """``brownout lab --scenario FILE``: run a scenario file, report, return the status."""
    from dataclasses import replace

    from ._lab.runner import run_scenario_file, settings_for
    from ._lab.scenario_file import ScenarioFileError, load_scenario, parse_base_url
    from ._lab.verdict import evaluate

    for flag in ("configs", "scenarios", "drill", "health_path", "server_view"):
        if getattr(args, flag):
            option = "--" + flag.replace("_", "-")
            console.print(f"[red]error:[/] {option} does not go with --scenario")
            return EXIT_USAGE
    try:
        sf = load_scenario(args.scenario)
        url = args.target or (sf.base_url.url if sf.base_url is not None else None)
        if url is None:
            console.print(f"[red]error:[/] {args.scenario} declares no base_url: give --target URL")
            return EXIT_USAGE
        base = parse_base_url(url)
        metrics_url = _metrics_url(args.metrics_url or sf.server.metrics_url, base.url)
    except (ScenarioFileError, TargetError) as e:
        console.print(f"[red]error:[/] {e}", highlight=False)
        return EXIT_USAGE
    settings = settings_for(sf)
    if args.deadline is not None:
        settings = replace(settings, deadline=args.deadline)
    if args.step is not None:
        settings = replace(settings, step_seconds=args.step)
    if args.poisson:
        settings = replace(settings, arrivals="poisson")
    started = time.monotonic()

    def on_stage(message: str) -> None:
        console.print(f"[dim]{time.monotonic() - started:6.1f}s[/] {message}", highlight=False)

    try:
        lab = run_scenario_file(
            sf,
            base,
            settings,
            find_capacity=args.find_capacity,
            metrics_url=metrics_url,
            on_stage=on_stage,
        )
    except RuntimeError as e:
        console.print(f"[red]error:[/] {e}")
        return EXIT_UNREACHABLE
    _write_lab(lab, args, argv, started, old, console)
    checks = evaluate(lab)
    if not checks:
        console.print("[yellow]no invariant was checked:[/] the scenario file declares none")
        return EXIT_OK
    return conclude(checks, console, no_fail=args.no_fail)


def _metrics_url(url: str | None, base: str) -> str | None:
    """``--metrics-url`` (or the file's) as an absolute URL; `TargetError` when malformed."""
    from ._lab.server_view import resolve_metrics_url

    try:
        return resolve_metrics_url(url, base) if url else None
    except ValueError as e:
        raise TargetError(str(e)) from None


def conclude(
    checks: list[Check], console: Console, *, judged: bool = True, no_fail: bool = False
) -> int:
    """Print the lab's verdict line; the exit status (1 when a check failed). ``judged``:
    some run was of a configuration the invariants apply to."""
    if not checks:  # nothing was checked, so nothing "held"
        if judged:
            why = "the scenarios that ran have none (their targets, if any, are reported above)"
        else:
            why = "they apply to brownout's configurations (or --target), and none of them ran"
        console.print(f"[yellow]no invariant was checked:[/] {why}")
        return 0
    failed = [c for c in checks if not c["passed"]]
    if failed:
        bound = sum(1 for c in failed if c.get("status") == "host-bound")
        unmeasured = sum(1 for c in failed if c.get("status") == "not measured")
        if len(failed) > bound + unmeasured:
            console.print(f"[red]{len(failed) - bound - unmeasured} invariant check(s) failed[/]")
        if unmeasured:
            console.print(
                f"[yellow]{unmeasured} check(s) not measured, so not counted as a pass[/] "
                "(the report says which figures were missing)"
            )
        if bound:
            console.print(
                f"[yellow]{bound} check(s) passed on a host-bound step, so not counted as a "
                "pass[/] (the report says why each step was host-bound)"
            )
        return EXIT_OK if no_fail else EXIT_INVARIANT
    console.print(f"[green]all invariants held[/] ({len(checks)} checks)")
    return 0


LAB_PACKAGES = ("uvicorn", "httptools", "aiohttp", "starlette", "rich", "matplotlib", "httpx")
"""What ``brownout[lab]`` installs (and uvloop, off Windows)."""


def _lab_entry(argv: list[str]) -> int:
    import importlib.util

    wanted = LAB_PACKAGES + (("uvloop",) if sys.platform != "win32" else ())
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        # Not a traceback from deep inside the demo's imports: say what to install.
        print(
            f"brownout lab needs {', '.join(missing)}, which come with brownout's 'lab' extra: "
            "pip install 'brownout[lab]'",
            file=sys.stderr,
        )
        return EXIT_MISSING_EXTRA
    return lab_main(argv)


def _queue_main(argv: list[str]) -> int:
    from ._queue_cli import main as queue

    return queue(argv)


def _proxy_main(argv: list[str]) -> int:
    from ._lab.proxy_cli import main as proxy

    return proxy(argv)


def _top_main(argv: list[str]) -> int:
    try:
        from .export._top import main as top
    except ModuleNotFoundError as e:  # brownout's missing-extra error says what to install
        print(f"brownout top: {e}", file=sys.stderr)
        return EXIT_MISSING_EXTRA
    return top(argv)


USAGE = """usage: brownout [--version] [--help] COMMAND [options]

commands:
  lab    the overload lab: protected vs unprotected past the breaking point
  top    live view of a service's brownout metrics
  queue  list, show, replay or purge the messages a durable queue parked
  proxy  a fault-injecting TCP/HTTP proxy in front of one dependency
  sim    run a simulated system (a TOML model) on virtual time

'brownout COMMAND --help' describes a command's options.

exit status: 0 ok, 1 a lab invariant failed, 2 usage error, 3 the service could not be
read or the run could not complete, 4 an extra the command needs is not installed
"""


def _completion_parser() -> argparse.ArgumentParser:
    """The whole command tree, built only for shell completion (it loads the lab's modules)."""
    from .export._top import add_arguments

    p = argparse.ArgumentParser(prog="brownout", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"brownout {VERSION}")
    commands = p.add_subparsers(dest="command")
    _lab_parser(commands.add_parser("lab", formatter_class=HelpFormatter))
    add_arguments(commands.add_parser("top", formatter_class=HelpFormatter))
    from ._queue_cli import add_arguments as queue_arguments

    queue_arguments(commands.add_parser("queue", formatter_class=HelpFormatter))
    from ._lab.proxy_cli import parser as proxy_parser

    proxy_parser(commands.add_parser("proxy", formatter_class=HelpFormatter))
    from ._sim_cli import add_arguments as sim_arguments

    sim_arguments(commands.add_parser("sim", formatter_class=HelpFormatter))
    return p


def _complete() -> None:
    """Shell completion when argcomplete is installed (it is not a dependency): exits the
    process when the shell asks for completions, does nothing otherwise."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete  # type: ignore[import-not-found, unused-ignore]
    except ModuleNotFoundError:
        return
    try:
        parser = _completion_parser()
    except ImportError:  # an extra is missing: no completion rather than a traceback
        return
    argcomplete.autocomplete(parser)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``brownout`` console script; returns the exit status."""
    if argv is None:
        _complete()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if args[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK
    if args[0] == "--version":
        print(f"brownout {VERSION}")
        return EXIT_OK
    command, rest = args[0], args[1:]
    if command == "lab":
        return _lab_entry(rest)
    if command == "top":
        return _top_main(rest)
    if command == "queue":
        return _queue_main(rest)
    if command == "proxy":
        return _proxy_main(rest)
    if command == "sim":
        from ._sim_cli import main as sim_main

        return sim_main(rest)
    print(f"brownout: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
