"""``brownout queue``: work with the messages a durable queue parked.

    brownout queue list   --redis redis://127.0.0.1:6379/0 --queue orders [--reason expired]
    brownout queue show   --amqp amqp://guest:guest@127.0.0.1/ --queue orders ID
    brownout queue replay --redis ... --queue orders ID ... | --all [--ttl 300] [--yes]
    brownout queue purge  --redis ... --queue orders ID ... | --all [--yes]

``--redis`` works on a Redis Streams queue (`brownout.integrations.redis_streams.ParkedStream`),
``--amqp`` on a RabbitMQ queue (`brownout.integrations.aio_pika.ParkedQueue`). Replay and purge
change the queue: they ask for confirmation on a terminal and need ``--yes`` otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from ._cli import EXIT_MISSING_EXTRA, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from ._durable import ParkedMessage
from ._help import HelpFormatter

__all__ = ["add_arguments", "main"]


_DETAIL_WIDTH = 48
_BODY_PREVIEW = 2_000


class ParkedStore(Protocol):
    """What both brokers' parked stores offer (`ParkedStream`, `ParkedQueue`)."""

    async def list(self, limit: int = 100, reason: str | None = None) -> list[ParkedMessage]: ...

    async def get(self, id: str) -> ParkedMessage | None: ...

    async def replay(self, ids: Sequence[str] | None, *, ttl: float | None) -> int: ...

    async def purge(self, ids: Sequence[str] | None) -> int: ...


class Unreachable(Exception):
    """The broker did not answer: the message says which and how to start it."""


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive, finite number")
    return value


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1..100000")
    return value


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = "List, show, replay or purge the messages a durable queue parked."
    p.epilog = (
        "exit status: 0 ok, 2 usage error or an unconfirmed change, 3 the broker did not "
        "answer, 4 the broker's extra is not installed"
    )
    p.add_argument(
        "action",
        choices=("list", "show", "replay", "purge"),
        help="list parked messages (by reason), show one, replay some to the queue with a "
        "new deadline, or delete some",
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="parked message ids (show, replay, purge)")
    broker = p.add_mutually_exclusive_group(required=True)
    broker.add_argument(
        "--redis", metavar="URL", help="a Redis Streams queue, e.g. redis://127.0.0.1:6379/0"
    )
    broker.add_argument(
        "--amqp", metavar="URL", help="a RabbitMQ queue, e.g. amqp://guest:guest@127.0.0.1/"
    )
    p.add_argument("--queue", required=True, help="the queue (RabbitMQ) or stream (Redis) name")
    p.add_argument("--reason", help="list: only messages parked for this reason")
    p.add_argument("--limit", type=_limit, default=50, help="list: at most this many")
    p.add_argument("--all", action="store_true", help="replay or purge every parked message")
    p.add_argument(
        "--ttl",
        type=_ttl,
        help="replay: seconds the replayed messages stay valid (without it: no deadline of "
        "their own, only the consumer's maximum age)",
    )
    p.add_argument("--yes", action="store_true", help="replay or purge without asking")
    p.add_argument("--json", action="store_true", help="list, show: JSON lines instead of text")
    p.add_argument(
        "--timeout", type=_ttl, default=5.0, help="seconds to wait for the broker per operation"
    )
    return p


# -- the brokers ------------------------------------------------------------------------------


@asynccontextmanager
async def _redis_store(url: str, queue: str, within: float) -> AsyncIterator[ParkedStore]:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    from .integrations.redis_streams import ParkedStream

    client = Redis.from_url(url, socket_timeout=within, socket_connect_timeout=within)
    try:
        try:
            await asyncio.wait_for(client.ping(), within)
        except (RedisError, OSError, TimeoutError) as e:
            raise Unreachable(
                f"Redis at {url} did not answer ({type(e).__name__}: {e}); start it with "
                "`redis-server` or pass the right --redis URL"
            ) from e
        yield ParkedStream(client, queue, timeout=within)
    finally:
        await client.aclose()


@asynccontextmanager
async def _amqp_store(url: str, queue: str, within: float) -> AsyncIterator[ParkedStore]:
    import aio_pika

    from .integrations.aio_pika import ParkedQueue

    try:
        connection = await asyncio.wait_for(aio_pika.connect(url), within)
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as e:
        raise Unreachable(
            f"RabbitMQ at {url} did not answer ({type(e).__name__}: {e}); start it with "
            "`rabbitmq-server` (or `systemctl start rabbitmq-server`) or pass the right --amqp URL"
        ) from e
    try:
        channel = await connection.channel(publisher_confirms=True)
        yield ParkedQueue(channel, queue, timeout=within)
    finally:
        await connection.close()


# -- output -----------------------------------------------------------------------------------


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "?"
    seconds = max(0.0, now - at)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _as_json(m: ParkedMessage) -> dict[str, Any]:
    env = m.envelope
    return {
        "id": m.id,
        "reason": m.reason,
        "detail": m.detail,
        "parked_at": m.parked_at,
        "attempt": env.attempt if env else None,
        "operation": env.operation if env else None,
        "caller": env.caller if env else None,
        "priority": env.priority.label if env else None,
        "enqueued_at": env.enqueued_at if env else None,
        "valid_until": env.valid_until if env else None,
        "idempotency_key": env.idempotency_key if env else None,
        "history": [
            {"at": h.at, "event": h.event, "detail": h.detail} for h in (env.history if env else ())
        ],
        "headers": dict(m.headers),
        "body": m.body[:_BODY_PREVIEW].decode("utf-8", "replace"),
        "body_bytes": len(m.body),
    }


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_list(found: list[ParkedMessage], out: Callable[[str], None], now: float) -> None:
    by_reason: dict[str, int] = {}
    for m in found:
        by_reason[m.reason] = by_reason.get(m.reason, 0) + 1
    summary = ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items(), key=lambda x: -x[1]))
    out(f"{len(found)} parked message(s){': ' + summary if summary else ''}")
    if not found:
        return
    out(f"{'ID':<24} {'REASON':<10} {'PARKED':<10} {'TRY':>3} {'OPERATION':<16} DETAIL")
    for m in found:
        env = m.envelope
        out(
            f"{_clip(m.id, 24):<24} {m.reason:<10} {_ago(m.parked_at, now):<10} "
            f"{env.attempt if env else '-':>3} {_clip(env.operation if env else '-', 16):<16} "
            f"{_clip(m.detail, _DETAIL_WIDTH)}"
        )


def _print_one(m: ParkedMessage, out: Callable[[str], None], now: float) -> None:
    data = _as_json(m)
    out(f"id:          {m.id}")
    out(f"reason:      {m.reason}")
    out(f"detail:      {m.detail}")
    out(f"parked:      {_ago(m.parked_at, now)}")
    env = m.envelope
    if env is None:
        out("envelope:    none (missing or unreadable)")
    else:
        out(f"attempt:     {env.attempt}")
        out(f"operation:   {env.operation}   caller: {env.caller}   priority: {env.priority.label}")
        out(f"enqueued:    {_ago(env.enqueued_at, now)}")
        valid = (
            "no deadline" if env.valid_until is None else f"{env.valid_until - now:+.1f}s from now"
        )
        out(f"valid until: {valid}")
        out(f"key:         {env.idempotency_key}")
        for h in env.history:
            out(f"  {_ago(h.at, now):<10} {h.event:<9} {h.detail}")
    for k, v in m.headers.items():
        out(f"header:      {k}: {v}")
    more = (
        "" if len(m.body) <= _BODY_PREVIEW else f" (first {_BODY_PREVIEW} of {len(m.body)} bytes)"
    )
    out(f"body{more}:")
    out(data["body"])


# -- the command ------------------------------------------------------------------------------


def _confirm(question: str, yes: bool, stdin: Any, out: Callable[[str], None]) -> bool | None:
    """True to go on; False when the user said no; None when nobody can be asked."""
    if yes:
        return True
    if not (hasattr(stdin, "isatty") and stdin.isatty()):
        return None
    out(f"{question} [y/N] ")
    answer = stdin.readline().strip().lower()
    return answer in ("y", "yes")


async def _run(
    args: argparse.Namespace, out: Callable[[str], None], err: Callable[[str], None], stdin: Any
) -> int:
    opener = (
        _redis_store(args.redis, args.queue, args.timeout)
        if args.redis
        else _amqp_store(args.amqp, args.queue, args.timeout)
    )
    now = time.time()
    async with opener as store:
        if args.action == "list":
            found = await store.list(limit=args.limit, reason=args.reason)
            if args.json:
                for m in found:
                    out(json.dumps(_as_json(m)))
            else:
                _print_list(found, out, now)
            return EXIT_OK
        if args.action == "show":
            missing = 0
            for ident in args.ids:
                try:
                    got = await store.get(ident)
                except ValueError:  # not an id this broker could have given
                    got = None
                if got is None:
                    err(f"brownout queue: no parked message {ident!r}")
                    missing += 1
                elif args.json:
                    out(json.dumps(_as_json(got)))
                else:
                    _print_one(got, out, now)
            return EXIT_USAGE if missing else EXIT_OK
        ids: list[str] | None = None if args.all else list(args.ids)
        what = "every parked message" if ids is None else f"{len(ids)} parked message(s)"
        if args.action == "replay":
            deadline = "no deadline of their own" if args.ttl is None else f"{args.ttl:g} s to run"
            question = f"Replay {what} of {args.queue!r} to the queue ({deadline})?"
        else:
            question = f"Delete {what} of {args.queue!r} for good?"
        go = _confirm(question, args.yes, stdin, out)
        if go is None:
            err(f"brownout queue {args.action}: not a terminal, so nobody can confirm; add --yes")
            return EXIT_USAGE
        if not go:
            err("brownout queue: nothing changed")
            return EXIT_USAGE
        if args.action == "replay":
            n = await store.replay(ids, ttl=args.ttl)
            out(f"replayed {n} message(s) to {args.queue!r}")
        else:
            n = await store.purge(ids)
            out(f"purged {n} message(s) from {args.queue!r}'s parked messages")
        return EXIT_OK


def main(
    argv: list[str],
    *,
    out: Callable[[str], None] | None = None,
    err: Callable[[str], None] | None = None,
    stdin: Any = None,
) -> int:
    """``brownout queue``: returns the exit status."""
    p = add_arguments(argparse.ArgumentParser(prog="brownout queue", formatter_class=HelpFormatter))
    args = p.parse_intermixed_args(argv)
    if args.action in ("show", "replay", "purge") and not args.ids and not args.all:
        p.error(f"{args.action} needs message ids" + ("" if args.action == "show" else " or --all"))
    if args.all and args.ids:
        p.error("give message ids or --all, not both")
    if args.all and args.action in ("list", "show"):
        p.error(f"--all is for replay and purge, not {args.action}")
    write = out or (lambda line: print(line, flush=True))
    complain = err or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        return asyncio.run(_run(args, write, complain, stdin if stdin is not None else sys.stdin))
    except ModuleNotFoundError as e:
        extra = "redis" if args.redis else "rabbitmq"
        complain(f"brownout queue needs the {extra!r} extra ({e}): pip install 'brownout[{extra}]'")
        return EXIT_MISSING_EXTRA
    except Unreachable as e:
        complain(f"brownout queue: {e}")
        return EXIT_UNREACHABLE
