"""The lab scenario "backlog after an outage", on a real Redis Streams broker (issue 26, item 8).

A producer publishes at a steady rate, open loop, half the consumer's capacity, each message
valid for ``ttl`` seconds. The consumer's dependency goes down for ``outage`` seconds, then
recovers. Three runs, each on a fresh stream:

- ``naive``: plain redis-py, FIFO through the backlog, a failure requeued at once, no
  deadline check;
- ``brownout``: `brownout.integrations.redis_streams.Consumer` with the default
  `MessagePolicy` (expired work parked, transient failures retried later under the budget);
- ``brownout-killed``: the same, shorter, and its consumer process is SIGKILLed at each of
  ``kills`` (seconds after recovery) and restarted by the scenario's supervisor.

Every message is accounted for from Redis itself (the completion log the handlers write before
acknowledging, the parked stream, what is still in the stream and its retry set), so
``published = completed + parked + still queued + lost`` holds exactly and ``lost`` must be 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = [
    "BACKLOG",
    "BacklogSettings",
    "BrokerUnavailable",
    "fresh_recovery",
    "run_backlog",
]

BACKLOG = "backlog"
"""The scenario's name for ``brownout lab --scenarios``."""
GOOD_SHARE = 0.95
"""Share of a second's fresh messages that must complete in time for the second to count."""


class BrokerUnavailable(RuntimeError):
    """Redis did not answer (or redis-py is not installed): the scenario cannot run."""


@dataclass(frozen=True)
class BacklogSettings:
    """Timing of the scenario. The defaults take about 85 s in all (three runs)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    rate: float = 100.0
    """Messages published per second (open loop)."""
    dependency_concurrency: int = 4
    dependency_latency: float = 0.020
    """With the concurrency: the consumer's capacity (4 / 20 ms = 200 messages/s)."""
    fail_after: float = 0.05
    """A call to the down dependency fails after this long."""
    ttl: float = 3.0
    """Each message's deadline (valid-until), seconds after it is published."""
    before: float = 4.0
    outage: float = 10.0
    after: float = 12.0
    kills: tuple[float, ...] = (0.5, 2.5)
    """Seconds after recovery at which the killed run's consumer gets SIGKILL."""
    killed_scale: float = 0.5
    """The killed run's before and outage phases, as a share of the others'."""
    claim_idle: float = 3.5
    """Pending entries of a killed consumer are claimed after this (above ``ttl``)."""
    drain: float = 8.0
    """Brownout runs: seconds after the producer stops to wait for the queue to empty."""

    @classmethod
    def quick(cls) -> BacklogSettings:
        return cls(
            ttl=1.5, before=2.0, outage=6.0, after=7.0, claim_idle=2.0, drain=5.0, kills=(0.3, 1.5)
        )


@dataclass(frozen=True)
class _Run:
    name: str
    kind: str
    before: float
    outage: float
    after: float
    kills: tuple[float, ...] = ()


def _runs(s: BacklogSettings) -> list[_Run]:
    after_kills = max(s.kills, default=0.0) + 2 * s.claim_idle
    return [
        _Run("naive", "naive", s.before, s.outage, s.after),
        _Run("brownout", "brownout", s.before, s.outage, s.after),
        _Run(
            "brownout-killed",
            "brownout",
            s.before * s.killed_scale,
            s.outage * s.killed_scale,
            max(s.after * s.killed_scale, after_kills),
            s.kills,
        ),
    ]


class _Worker:
    """One consumer process; the supervisor restarts it after a kill under a new name."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen[str] | None = None

    def start(self, name: str) -> None:
        argv = [*self.argv[:4], name, *self.argv[5:]]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "brownout._lab.backlog_worker", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    async def ready(self, within: float = 30.0) -> None:
        proc = self.proc
        assert proc is not None
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), within)
        if line.strip() != "ready":
            raise RuntimeError(f"backlog consumer did not start (exit {proc.poll()})")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    async def stop(self, within: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), within)
        except TimeoutError:
            proc.kill()
            proc.wait()


_RETRY_BODIES = """
local out = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local ok, copy = pcall(cmsgpack.unpack, m)
  if ok and type(copy) == 'table' then
    for i = 2, #copy - 1, 2 do
      if copy[i] == 'body' then out[#out + 1] = copy[i + 1] end
    end
  end
end
return out
"""


async def _stream_bodies(client: Any, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of stream ``key`` (the run's size bounds it), as (body, fields)."""
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    start = "-"
    while True:
        batch = await client.xrange(key, min=start, count=1000)
        if not batch:
            return out
        for _id, fields in batch:
            out.append((fields.get(b"body", b""), fields))
        last = batch[-1][0].decode()
        ms, seq = last.split("-")
        start = f"{ms}-{int(seq) + 1}"


def _seq(body: bytes) -> int | None:
    try:
        return int(body.split()[0])
    except (ValueError, IndexError):
        return None


async def _measure(client: Any, s: BacklogSettings, run: _Run) -> dict[str, Any]:
    """One run on a fresh stream; the raw figures (see `summarize`)."""
    from brownout.integrations.redis_streams import Producer, stream_keys

    queue = f"brownout-lab-backlog-{secrets.token_hex(4)}"
    keys = stream_keys(queue)
    log = f"{keys.stream}:completed"
    group = "lab"
    await client.xgroup_create(keys.stream, group, id="0", mkstream=True)
    start = time.time() + 3.0  # the consumer processes start in this margin
    down_from = start + run.before
    down_until = down_from + run.outage
    end = down_until + run.after
    worker = _Worker(
        [
            run.kind,
            s.redis_url,
            queue if run.kind == "brownout" else keys.stream,
            group,
            "",
            log,
            f"{down_from:.6f}",
            f"{down_until:.6f}",
            str(s.dependency_latency),
            str(s.dependency_concurrency),
            str(s.fail_after),
            str(s.claim_idle),
        ]
    )
    producer = Producer(client, queue, ttl=s.ttl)
    published: dict[int, float] = {}
    unknown: list[int] = []
    depth: list[tuple[float, int]] = []
    kills: list[dict[str, float]] = []
    name = f"{run.name}-0"
    try:
        worker.start(name)
        await worker.ready()

        async def produce() -> None:
            n = int((end - start) * s.rate)
            for i in range(n):
                delay = start + i / s.rate - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                at = time.time()
                try:
                    await producer.publish(f"{i} {at:.6f}".encode(), idempotency_key=f"m{i}")
                except Exception:  # an unanswered XADD may be stored: accounted apart
                    unknown.append(i)
                    continue
                published[i] = at

        async def sample() -> None:
            while True:
                pipe = client.pipeline(transaction=False)
                pipe.xlen(keys.stream)
                pipe.zcard(keys.retry)
                length, retries = await pipe.execute()
                depth.append((round(time.time() - start, 2), int(length) + int(retries)))
                await asyncio.sleep(0.5)

        async def supervise() -> None:
            nonlocal name
            for i, after in enumerate(run.kills, start=1):
                await asyncio.sleep(max(0.0, down_until + after - time.time()))
                worker.kill()
                killed = time.time()
                # what the dead process held unacknowledged: the kill landed mid-handler
                held = await client.xpending_range(
                    keys.stream, group, min="-", max="+", count=10_000, consumername=name
                )
                name = f"{run.name}-{i}"
                worker.start(name)
                await worker.ready()
                kills.append(
                    {
                        "at": round(killed - start, 3),
                        "held": len(held),
                        "restarted_in": round(time.time() - killed, 3),
                    }
                )

        sampler = asyncio.create_task(sample())
        supervisor = asyncio.create_task(supervise())
        await produce()
        await supervisor
        await asyncio.sleep(max(0.0, end - time.time()))
        if run.kind == "brownout":  # claimed, retried and parked work settles within drain
            for _ in range(int(s.drain / 0.25)):
                if depth and depth[-1][1] == 0:
                    break
                await asyncio.sleep(0.25)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await worker.stop()
        # -- account for every message from Redis itself
        completions = [
            tuple(float(x) for x in line.split()) for line in await client.lrange(log, 0, -1)
        ]
        parked = [
            (_seq(body), fields) for body, fields in await _stream_bodies(client, keys.parked)
        ]
        queued = [_seq(body) for body, _ in await _stream_bodies(client, keys.stream)]
        queued += [_seq(b) for b in await client.eval(_RETRY_BODIES, 1, keys.retry)]
    finally:
        worker.kill()
        await client.delete(keys.stream, keys.retry, keys.parked, log)
    return {
        "run": run,
        "start": start,
        "published": published,
        "unknown": unknown,
        "completions": completions,
        "parked": [
            (
                seq,
                fields.get(b"brownout-park-reason", b"?").decode(),
                float(fields.get(b"brownout-parked-at", b"0") or 0),
            )
            for seq, fields in parked
        ],
        "queued": queued,
        "depth": depth,
        "kills": kills,
    }


def fresh_recovery(
    published: dict[int, float],
    done: dict[int, float],
    recovered: float,
    until: float,
    ttl: float,
) -> float | None:
    """Seconds from ``recovered`` until fresh messages were served within their deadline
    again, for good; ``None`` if that never happened before ``until``.

    Fresh messages (published at or after ``recovered``, before ``until - ttl`` so each had
    its whole deadline inside the window) are binned by the second they were published in. A
    second is good when at least `GOOD_SHARE` of its messages completed within ``ttl``
    (``done``: seq -> seconds from publish to completion, first completion). The answer is
    the time the first message of the first second after which all seconds are good
    completed in time.
    """
    last = until - ttl
    bins: dict[int, list[int]] = {}
    for seq, at in published.items():
        if recovered <= at < last:
            bins.setdefault(int(at - recovered), []).append(seq)
    if not bins:
        return None
    good = {
        b: sum(1 for q in seqs if done.get(q, ttl + 1) <= ttl) >= GOOD_SHARE * len(seqs)
        for b, seqs in bins.items()
    }
    first: int | None = None
    for b in sorted(bins, reverse=True):
        if not good[b]:
            break
        first = b
    if first is None:
        return None
    times = [published[q] + done[q] - recovered for q in bins[first] if done.get(q, ttl + 1) <= ttl]
    return round(max(0.0, min(times)), 2)


def summarize(raw: dict[str, Any], s: BacklogSettings) -> dict[str, Any]:
    """A run as JSON: per-second timeline, phases, recovery time, accounting."""
    run: _Run = raw["run"]
    start: float = raw["start"]
    published: dict[int, float] = raw["published"]
    recovered = start + run.before + run.outage
    end = recovered + run.after
    done: dict[int, float] = {}
    runs: Counter[int] = Counter()
    seconds = int(run.before + run.outage + run.after)
    timeline = [
        {"published": 0, "in_time": 0, "late": 0, "parked": 0, "depth": 0} for _ in range(seconds)
    ]
    for seq_f, pub, completed in raw["completions"]:
        seq = int(seq_f)
        runs[seq] += 1
        latency = completed - pub
        if seq not in done:
            done[seq] = latency
        b = int(completed - start)
        if 0 <= b < seconds:
            timeline[b]["in_time" if latency <= s.ttl else "late"] += 1
    for at in published.values():
        b = int(at - start)
        if 0 <= b < seconds:
            timeline[b]["published"] += 1
    parked_seqs: set[int] = set()
    reasons: Counter[str] = Counter()
    for seq, reason, at in raw["parked"]:
        reasons[reason] += 1
        if seq is not None:
            parked_seqs.add(seq)
        b = int(at - start)
        if 0 <= b < seconds:
            timeline[b]["parked"] += 1
    for t, d in raw["depth"]:
        b = int(t)
        if 0 <= b < seconds:
            timeline[b]["depth"] = max(timeline[b]["depth"], d)
    queued_seqs = {q for q in raw["queued"] if q is not None}
    # each published message lands in exactly one class, the first that holds it
    completed = [q for q in published if q in done]
    parked = [q for q in published if q not in done and q in parked_seqs]
    queued = [q for q in published if q not in done and q not in parked_seqs and q in queued_seqs]
    lost = sorted(set(published) - set(done) - parked_seqs - queued_seqs)
    in_time = sum(1 for q in completed if done[q] <= s.ttl)
    after_in_time = sum(
        1 for seq_f, pub, c in raw["completions"] if recovered <= c < end and c - pub <= s.ttl
    )
    after_late = sum(
        1 for seq_f, pub, c in raw["completions"] if recovered <= c < end and c - pub > s.ttl
    )
    recovery = fresh_recovery(published, done, recovered, end, s.ttl)
    return {
        "configuration": run.name,
        "scenario": BACKLOG,
        "kind": run.kind,
        "before": run.before,
        "outage": run.outage,
        "after": run.after,
        "recovered_at": round(run.before + run.outage, 3),
        "kills": raw["kills"],
        "kills_planned": len(run.kills),
        "timeline": timeline,
        "fresh_recovery_s": recovery,
        "after_in_time_per_s": round(after_in_time / run.after, 1),
        "after_late_per_s": round(after_late / run.after, 1),
        "accounting": {
            "published": len(published),
            "completed": len(completed),
            "completed_in_time": in_time,
            "completed_late": len(completed) - in_time,
            "parked": len(parked),
            "queued": len(queued),
            "lost": len(lost),
            "lost_sample": lost[:10],
            "unknown_publishes": len(raw["unknown"]),
            "duplicates": sum(n - 1 for n in runs.values())
            + sum(1 for q in parked_seqs if q in done),
        },
        "parked_by_reason": dict(sorted(reasons.items())),
    }


async def _check_broker(url: str) -> Any:
    try:
        import redis.asyncio as redis_asyncio
    except ImportError as e:
        raise BrokerUnavailable(
            "the backlog scenario needs redis-py: pip install 'brownout[redis]'"
        ) from e
    try:
        client = redis_asyncio.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    except ValueError as e:
        raise BrokerUnavailable(f"--redis {url!r} is not a Redis URL: {e}") from e
    try:
        await asyncio.wait_for(client.ping(), 5)
        info = await client.info("server")
    except Exception as e:
        await client.aclose()
        raise BrokerUnavailable(
            f"Redis at {url} did not answer ({type(e).__name__}: {e}); start it "
            "(e.g. `redis-server` or `docker run -p 6379:6379 redis:7`) or leave out "
            "--scenarios backlog"
        ) from e
    major = int(str(info.get("redis_version", "0")).split(".")[0] or 0)
    if major < 7:
        await client.aclose()
        raise BrokerUnavailable(f"the backlog scenario needs Redis 7 or newer, {url} runs {major}")
    return client


async def _run_all(s: BacklogSettings, on_stage: Any) -> list[dict[str, Any]]:
    client = await _check_broker(s.redis_url)
    from redis.exceptions import RedisError

    out = []
    try:
        for run in _runs(s):
            total = run.before + run.outage + run.after
            on_stage(f"backlog after an outage: {run.name} ({total:.0f} s)")
            try:
                raw = await _measure(client, s, run)
            except (OSError, RedisError) as e:  # Redis went away mid-run: no figures to trust
                raise BrokerUnavailable(
                    f"Redis at {s.redis_url} failed during the {run.name} run: "
                    f"{type(e).__name__}: {e}"
                ) from e
            out.append(summarize(raw, s))
    finally:
        await client.aclose()
    return out


def run_backlog(s: BacklogSettings, on_stage: Any = None) -> dict[str, Any]:
    """Run the three runs and return the scenario's JSON (`BrokerUnavailable` if Redis does
    not answer)."""
    stage = on_stage or (lambda _msg: None)
    runs = asyncio.run(_run_all(s, stage))
    settings = asdict(s)
    settings["kills"] = list(s.kills)
    return {"settings": settings, "runs": runs}


def quick_settings(s: BacklogSettings) -> BacklogSettings:
    """``s`` with the quick timings, keeping its broker."""
    return replace(BacklogSettings.quick(), redis_url=s.redis_url)
