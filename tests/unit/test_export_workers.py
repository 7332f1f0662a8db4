"""brownout's metrics summed over worker processes through the multiprocess directory: sums
of counters and histograms, live gauges only, dead workers' counts kept (monotonic), bounded
files. Other workers are snapshot files of real pids (a running and an exited child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from brownout import Priority, Stats
from brownout.events import RequestAdmitted, RequestCompleted, RequestOffered
from brownout.export._workers import _families_of
from brownout.export.prometheus import (
    BrownoutCollector,
    WorkersCollector,
    mark_process_dead,
    register_multiprocess,
)


def req(cls, caller="alice", **kw):
    return cls(
        at=0.0, source="api", operation="/w", priority=Priority.CRITICAL, caller=caller, **kw
    )


def served(stats: Stats, n: int, caller: str = "alice") -> Stats:
    for _ in range(n):
        stats.emit(req(RequestOffered, caller=caller, remaining=1.0))
        stats.emit(req(RequestAdmitted, caller=caller, queue_wait=0.0))
        stats.emit(req(RequestCompleted, caller=caller, latency=0.01, useful=True))
    return stats


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples, name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)


def other_worker(directory: Path, pid: int, stats: Stats, token: str = "other") -> None:
    families = _families_of(BrownoutCollector(stats).collect())
    data = {"pid": pid, "token": token, "families": families}
    (directory / f"brownout_{pid}.json").write_text(json.dumps(data))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def collectors() -> Iterator[list[WorkersCollector]]:
    made: list[WorkersCollector] = []
    yield made
    for c in made:
        c.close()


def test_counts_sum_over_workers_and_an_exited_worker_keeps_its_counts(
    tmp_path, child, collectors
) -> None:
    stats = served(Stats(), 3)
    stats.watch_gauge("in_flight", {"source": "api"}, lambda: 2)
    stats.watch_gauge("queue_oldest_age", {"source": "api"}, lambda: 0.5)
    theirs = served(Stats(), 4, caller="bob")
    theirs.watch_gauge("in_flight", {"source": "api"}, lambda: 5)
    theirs.watch_gauge("queue_oldest_age", {"source": "api"}, lambda: 0.25)
    other_worker(tmp_path, child.pid, theirs)
    registry = CollectorRegistry()
    collectors.append(register_multiprocess(stats, registry, path=str(tmp_path), period=60))

    s = scrape(registry)
    assert total(s, "brownout_requests_offered_total") == 7
    assert total(s, "brownout_requests_completed_total") == 7
    assert total(s, "brownout_success_latency_seconds_count") >= 1
    assert total(s, "brownout_in_flight_requests") == 7  # summed
    assert total(s, "brownout_queue_oldest_age_seconds") == 0.5  # the oldest
    # Buckets stay cumulative and ordered after the merge.
    buckets = [v for (n, _l), v in s.items() if n == "brownout_success_latency_seconds_bucket"]
    assert buckets == sorted(buckets)
    # The merged families are valid OpenMetrics too (histogram samples grouped and ordered).
    om = generate_openmetrics(registry).decode()
    parsed = {f.name: f for f in openmetrics_families(om)}
    assert parsed["brownout_success_latency_seconds"].type == "histogram"

    child.kill()
    child.wait()
    s = scrape(registry)
    assert total(s, "brownout_requests_offered_total") == 7  # monotonic
    assert total(s, "brownout_in_flight_requests") == 2  # its gauges are gone
    assert {p.name for p in tmp_path.iterdir()} == {
        "brownout.lock",
        "brownout_archive.json",
        f"brownout_{os.getpid()}.json",
    }
    served(stats, 1)
    assert total(scrape(registry), "brownout_requests_offered_total") == 8


def test_mark_process_dead_folds_counts_and_drops_gauges(tmp_path, child, collectors) -> None:
    theirs = served(Stats(), 4)
    theirs.watch_gauge("in_flight", {"source": "api"}, lambda: 5)
    other_worker(tmp_path, child.pid, theirs)
    (tmp_path / f"gauge_livesum_{child.pid}.db").write_bytes(b"")
    mark_process_dead(child.pid, str(tmp_path))  # the child still runs: the hook decides
    assert not (tmp_path / f"brownout_{child.pid}.json").exists()
    assert not (tmp_path / f"gauge_livesum_{child.pid}.db").exists()  # prometheus_client's
    registry = CollectorRegistry()
    collectors.append(register_multiprocess(Stats(), registry, path=str(tmp_path), period=60))
    s = scrape(registry)
    assert total(s, "brownout_requests_offered_total") == 4
    assert total(s, "brownout_in_flight_requests") == 0


def test_a_reused_pid_does_not_overwrite_the_previous_workers_counts(tmp_path, collectors) -> None:
    other_worker(tmp_path, os.getpid(), served(Stats(), 5), token="previous-worker")
    registry = CollectorRegistry()
    collectors.append(
        register_multiprocess(served(Stats(), 1), registry, path=str(tmp_path), period=60)
    )
    assert total(scrape(registry), "brownout_requests_offered_total") == 6


def test_stale_live_files_lose_gauges_and_bad_files_are_skipped(
    tmp_path, child, collectors
) -> None:
    theirs = served(Stats(), 2)
    theirs.watch_gauge("in_flight", {"source": "api"}, lambda: 5)
    other_worker(tmp_path, child.pid, theirs)
    os.utime(tmp_path / f"brownout_{child.pid}.json", (0, 0))  # not refreshed for ages
    (tmp_path / "brownout_12.json").write_text("{not json")
    (tmp_path / "brownout_x.json").write_text("{}")
    registry = CollectorRegistry()
    stats = Stats()
    c = WorkersCollector(BrownoutCollector(stats), str(tmp_path), period=60, stale_after=5)
    collectors.append(c)
    registry.register(c)
    s = scrape(registry)
    assert total(s, "brownout_requests_offered_total") == 2
    assert total(s, "brownout_in_flight_requests") == 0


def test_the_archive_is_bounded(tmp_path, collectors) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    pid = int(dead.stdout)
    theirs = Stats()
    for i in range(30):
        served(theirs, 1, caller=f"c{i}")
    other_worker(tmp_path, pid, theirs)
    mark_process_dead(pid, str(tmp_path), max_archived_series=10)
    archive = json.loads((tmp_path / "brownout_archive.json").read_text())
    assert sum(len(f[2]) for f in archive["families"].values()) == 10


def test_a_directory_is_required(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        register_multiprocess(Stats(), CollectorRegistry())
    with pytest.raises(ValueError, match="period"):
        WorkersCollector(BrownoutCollector(Stats()), str(tmp_path), period=0)


def test_publishing_runs_on_its_period_and_close_writes_a_last_snapshot(tmp_path) -> None:
    stats = served(Stats(), 1)
    c = WorkersCollector(BrownoutCollector(stats), str(tmp_path), period=60)
    path = Path(c.snapshot_path)
    assert not path.exists()  # the first write comes after one period (or at a scrape)
    served(stats, 2)
    c.close()
    data = json.loads(path.read_text())
    offered = data["families"]["brownout_requests_offered"][2]
    assert sum(v for _name, _labels, v in offered) == 3
