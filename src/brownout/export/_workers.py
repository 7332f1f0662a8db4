"""brownout's metrics summed over the worker processes of one service (uvicorn ``--workers``,
gunicorn), in prometheus_client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``).

Each worker counts in its own `Stats`; a scrape reaches one worker. So every worker publishes
what its `BrownoutCollector` would export as a snapshot file, ``brownout_<pid>.json``, written
atomically (a temporary file, then ``os.replace``) every ``period`` seconds by a daemon
thread, at exit, and by the serving worker at scrape time. The scrape merges the files:

- counters and histograms are summed (the bucket bounds are the same in every worker);
- gauges come from live workers only, summed (in-flight, limit, queue depth, retry tokens,
  series kept) or the maximum (ages, levels, 0/1 flags; unknown gauges);
- a worker that is gone (its pid no longer runs, or `mark_process_dead`) has its counters
  and histograms folded into ``brownout_archive.json`` and its file removed, so totals stay
  monotonic while its gauges vanish, and the directory holds one file per live worker plus
  the archive (itself capped at ``max_archived_series`` samples);
- a pid reused by a new worker: the new worker folds the old file into the archive before
  it first writes its own (each file carries its writer's random token).

Folding and merging hold an exclusive ``flock`` on ``brownout.lock`` in the directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["WorkersCollector", "mark_process_dead"]

_log = logging.getLogger("brownout.export")

_PREFIX = "brownout_"
_ARCHIVE = "brownout_archive.json"
_LOCK = "brownout.lock"
_ADDITIVE = frozenset(
    {
        "brownout_in_flight_requests",
        "brownout_concurrency_limit",
        "brownout_queue_depth_requests",
        "brownout_retry_budget_tokens",
        "brownout_stats_series",
    }
)
# A snapshot: {metric name: [type, help, [[sample name, {label: value}, value], ...]]}.
Families = dict[str, list[Any]]
_Key = tuple[str, tuple[tuple[str, str], ...]]


def _directory(path: str | None) -> str:
    path = path if path is not None else os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or not os.path.isdir(path):
        raise ValueError(
            "brownout's multiprocess metrics need a directory: pass path= or set "
            "PROMETHEUS_MULTIPROC_DIR to an existing directory"
        )
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, as another user
    return True


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    import fcntl  # Unix only, as prometheus_client's multiprocess mode in practice

    fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.warning("brownout metrics: skipping unreadable snapshot %s: %s", path, e)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("families"), dict):
        _log.warning("brownout metrics: skipping malformed snapshot %s", path)
        return None
    return data


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def _families_of(metrics: Iterable[Metric]) -> Families:
    return {
        m.name: [m.type, m.documentation, [[s.name, s.labels, s.value] for s in m.samples]]
        for m in metrics
    }


class _Merge:
    """Families being merged: sums for counters and histograms, a rule per gauge."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}
        self.values: dict[str, dict[_Key, float]] = {}

    def add(self, families: Families, *, gauges: bool, cap: int | None = None) -> int:
        """Add one snapshot; returns how many samples did not fit under ``cap``."""
        dropped = 0
        size = sum(len(v) for v in self.values.values())
        for name, (typ, help_text, samples) in families.items():
            if typ == "gauge" and not gauges:
                continue
            self.meta.setdefault(name, (typ, help_text))
            values = self.values.setdefault(name, {})
            summed = typ != "gauge" or name in _ADDITIVE
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                old = values.get(key)
                if old is None:
                    if cap is not None and size >= cap:
                        dropped += 1
                        continue
                    values[key] = value
                    size += 1
                else:
                    values[key] = old + value if summed else max(old, value)
        return dropped

    def families(self) -> Families:
        return {
            name: [
                typ,
                help_text,
                [[s, dict(labels), v] for (s, labels), v in self.values[name].items()],
            ]
            for name, (typ, help_text) in self.meta.items()
        }

    def metrics(self) -> Iterator[Metric]:
        for name, (typ, help_text) in self.meta.items():
            metric = Metric(name, help_text, typ)
            for (sample_name, labels), value in sorted(
                self.values[name].items(), key=lambda kv: _order(name, kv[0])
            ):
                metric.add_sample(sample_name, dict(labels), value)
            yield metric


def _order(name: str, key: _Key) -> tuple[Any, ...]:
    # Histogram samples grouped by label set, buckets by bound, then _count and _sum.
    sample_name, labels = key
    rest = tuple(kv for kv in labels if kv[0] != "le")
    le = next((float(v) for k, v in labels if k == "le"), 0.0)
    return (rest, sample_name[len(name) :] != "_bucket", sample_name, le)


def _fold(directory: str, dead: list[str], cap: int) -> None:
    """Fold the counters and histograms of ``dead`` snapshot files into the archive and remove
    them (the caller holds the lock)."""
    if not dead:
        return
    archive_path = os.path.join(directory, _ARCHIVE)
    merge = _Merge()
    archive = _read(archive_path)
    if archive is not None:
        merge.add(archive["families"], gauges=False)
    dropped = 0
    for path in dead:
        data = _read(path)
        if data is not None:
            dropped += merge.add(data["families"], gauges=False, cap=cap)
    if dropped:
        _log.warning(
            "brownout metrics: archive full (%d samples): %d series of exited workers dropped",
            cap,
            dropped,
        )
    _write(archive_path, {"families": merge.families()})
    for path in dead:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _snapshot_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{pid}.json")


def mark_process_dead(
    pid: int, path: str | None = None, *, max_archived_series: int = 50_000
) -> None:
    """A worker has exited: keep its brownout counters (folded into the archive), drop its
    gauges, and call prometheus_client's ``multiprocess.mark_process_dead`` for the
    application's own live gauges. For gunicorn's ``child_exit`` hook."""
    from prometheus_client import multiprocess

    directory = _directory(path)
    snapshot = _snapshot_path(directory, pid)
    with _locked(directory):
        if os.path.exists(snapshot):
            _fold(directory, [snapshot], max_archived_series)
    multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


class WorkersCollector(Collector):
    """brownout's metrics summed over every worker process sharing ``path`` (default:
    ``PROMETHEUS_MULTIPROC_DIR``); see the module docstring for the rules.

    ``source`` is this worker's collector (a `BrownoutCollector`, or anything whose
    ``collect`` gives the families to publish). Publishing starts at once, from a daemon
    thread every ``period`` seconds (so another worker's figures are at most that old at a
    scrape); `close` stops it after a last snapshot (also run at interpreter exit).
    """

    def __init__(
        self,
        source: Collector,
        path: str | None = None,
        *,
        period: float = 1.0,
        stale_after: float | None = None,
        max_archived_series: int = 50_000,
    ) -> None:
        if not period > 0:
            raise ValueError("period must be > 0")
        if max_archived_series < 1:
            raise ValueError("max_archived_series must be >= 1")
        self.directory = _directory(path)
        self.source = source
        self.period = period
        # A live pid whose file is not refreshed (a stuck or unrelated process) loses its
        # gauges, never its counts.
        self.stale_after = stale_after if stale_after is not None else max(10 * period, 10.0)
        if not self.stale_after > 0:
            raise ValueError("stale_after must be > 0")
        self.max_archived_series = max_archived_series
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start()
        ref = weakref.ref(self)

        def restart_in_child() -> None:  # a fork (gunicorn --preload): a new worker
            me = ref()
            if me is not None and not me._stop.is_set():
                me._write_lock = threading.Lock()
                me._stop = threading.Event()
                me._start()

        os.register_at_fork(after_in_child=restart_in_child)
        import atexit

        atexit.register(self.close)

    def _start(self) -> None:
        self.pid = os.getpid()
        self.token = secrets.token_hex(8)
        self._last: bytes | None = None
        self._claimed = False
        self._thread = threading.Thread(
            target=self._run, name="brownout-metrics-publisher", daemon=True
        )
        self._thread.start()

    @property
    def snapshot_path(self) -> str:
        """This worker's snapshot file."""
        return _snapshot_path(self.directory, self.pid)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.publish()
            except Exception:  # a full disk must not kill the publisher: try again later
                _log.exception("brownout metrics: could not publish this worker's snapshot")

    def publish(self) -> None:
        """Write this worker's snapshot now (only touch the file when nothing changed)."""
        families = _families_of(self.source.collect())
        data = {"pid": self.pid, "token": self.token, "families": families}
        encoded = json.dumps(data, separators=(",", ":")).encode()
        path = self.snapshot_path
        with self._write_lock:
            if not self._claimed:
                with _locked(self.directory):
                    old = _read(path)
                    if old is not None and old.get("token") != self.token:
                        _fold(self.directory, [path], self.max_archived_series)  # reused pid
                    _write(path, data)
                self._claimed = True
            elif encoded == self._last:
                try:
                    os.utime(path)  # still alive
                except FileNotFoundError:  # someone cleaned the directory
                    _write(path, data)
            else:
                _write(path, data)
            self._last = encoded

    def close(self) -> None:
        """Stop publishing, after a last snapshot (counts since the previous one kept)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(Exception):
            if self.pid == os.getpid():
                self.publish()
        import atexit

        atexit.unregister(self.close)

    def describe(self) -> Iterable[Metric]:
        describe = getattr(self.source, "describe", None)
        return describe() if describe is not None else ()

    def collect(self) -> Iterable[Metric]:
        self.publish()  # this worker's figures are exact at its own scrape
        directory = self.directory
        merge = _Merge()
        now = time.time()  # file ages compare across processes: the wall clock
        with _locked(directory):
            live: list[tuple[str, bool]] = []
            dead: list[str] = []
            for entry in os.scandir(directory):
                name = entry.name
                if not (name.startswith(_PREFIX) and name.endswith(".json")):
                    continue
                if name == _ARCHIVE:
                    continue
                try:
                    pid = int(name[len(_PREFIX) : -len(".json")])
                except ValueError:
                    continue
                if pid != self.pid and not _alive(pid):
                    dead.append(entry.path)
                    continue
                try:
                    fresh = now - entry.stat().st_mtime <= self.stale_after
                except FileNotFoundError:
                    continue
                live.append((entry.path, fresh))
            _fold(directory, dead, self.max_archived_series)
            archive = _read(os.path.join(directory, _ARCHIVE))
            if archive is not None:
                merge.add(archive["families"], gauges=False)
            for path, fresh in live:
                data = _read(path)
                if data is not None:
                    merge.add(data["families"], gauges=fresh)
        return list(merge.metrics())
