"""The gunicorn hooks read real gunicorn worker objects: the thread count a worker records,
the capacity and limit sized from it, and child_exit's no-op without a multiprocess
directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from gunicorn.config import Config
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker

from brownout import ThreadBulkhead
from brownout.integrations import gunicorn as hooks
from brownout.limits import Gradient2Limit


def worker(kind: type, threads: int) -> object:
    cfg = Config()
    cfg.set("threads", threads)
    w = kind(0, os.getpid(), [], None, 30, cfg, None)
    return w


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    hooks._threads = None
    yield
    hooks._threads = None


def test_outside_a_worker_the_thread_count_is_asked_for() -> None:
    with pytest.raises(RuntimeError, match="post_fork"):
        hooks.worker_threads()
    with pytest.raises(RuntimeError, match="post_fork"):
        hooks.worker_bulkhead("api")
    assert hooks.worker_capacity(threads=8) == 3  # 4 spare, 1 queued
    assert hooks.worker_bulkhead("api", threads=8)._limit.max_limit == 3


def test_a_gthread_worker_records_its_threads() -> None:
    w = worker(ThreadWorker, 16)
    hooks.post_fork(None, w)
    assert hooks.worker_threads() == 16
    assert hooks.worker_capacity() == 6  # half kept to refuse, a quarter of the rest queued
    assert hooks.worker_capacity(spare=2) == 11
    assert hooks.worker_capacity(spare=2, queued=0) == 14
    limit = hooks.worker_limit()
    assert isinstance(limit, Gradient2Limit)
    assert limit.limit == 3 and limit.max_limit == 6


def test_the_worker_bulkhead_leaves_half_the_threads_free_to_refuse() -> None:
    hooks.post_fork(None, worker(ThreadWorker, 16))
    b = hooks.worker_bulkhead("api")
    assert isinstance(b, ThreadBulkhead) and b.name == "api"
    assert b._limit.max_limit == 6 and b._queue.max_size == 2  # 8 threads never held
    assert b._queue.max_wait == 0.1
    b = hooks.worker_bulkhead("api", 4, queued=4, max_wait=0.05, initial=8)
    assert (b._limit.limit, b._limit.max_limit, b._queue.max_size) == (8, 8, 4)


def test_a_sync_worker_runs_one_request_whatever_threads_says() -> None:
    hooks.post_fork(None, worker(SyncWorker, 1))
    assert hooks.worker_threads() == 1
    assert hooks.worker_capacity() == 1
    assert hooks.worker_limit().limit == 1
    assert hooks.worker_bulkhead("api")._limit.max_limit == 1


def test_the_limit_stays_within_the_threads_however_it_is_fed() -> None:
    limit = hooks.worker_limit(spare=1, threads=5, queued=0)
    start = 0.0
    for i in range(5_000):  # fast, fully used: the limit grows as far as it may
        limit.on_sample(start, 0.001, limit.limit, False)
        start += 0.001
        assert 1 <= limit.limit <= 4, i


@pytest.mark.parametrize(
    ("spare", "threads", "initial"), [(4, 4, None), (-1, 4, None), (0, 0, None), (1, 4, 4)]
)
def test_bad_sizes_are_refused(spare: int, threads: int, initial: int | None) -> None:
    with pytest.raises(ValueError):
        hooks.worker_limit(spare, threads=threads, initial=initial)


def test_child_exit_without_a_multiprocess_directory_does_nothing(monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    hooks.child_exit(None, worker(SyncWorker, 1))  # no error, no file


def test_child_exit_folds_the_workers_counts(tmp_path, monkeypatch) -> None:
    import json

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    dead = 2**22 + 12345  # above any pid this host hands out
    families = {"brownout_x": ["counter", "x", [["brownout_x_total", {}, 3]]]}
    (tmp_path / f"brownout_{dead}.json").write_text(
        json.dumps({"pid": dead, "token": "t", "families": families})
    )
    w = worker(SyncWorker, 1)
    w.pid = dead  # type: ignore[attr-defined]
    hooks.child_exit(None, w)
    assert not (tmp_path / f"brownout_{dead}.json").exists()
    archive = json.loads((tmp_path / "brownout_archive.json").read_text())
    assert archive["families"]["brownout_x"][2] == [["brownout_x_total", {}, 3]]


class _Req:
    must_close = False


def test_the_closer_marks_this_threads_request_at_its_pace() -> None:
    t = [100.0]
    closer = hooks.ConnectionCloser(per_second=10, clock=lambda: t[0])
    closer()  # no request noted on this thread: nothing to close
    first, second, third = _Req(), _Req(), _Req()
    closer.note(first)
    closer()
    assert first.must_close
    closer.note(second)
    t[0] += 0.05  # within the 0.1 s between closes
    closer()
    assert not second.must_close
    closer.note(third)
    t[0] += 0.05
    closer()
    assert third.must_close
    with pytest.raises(ValueError):
        hooks.ConnectionCloser(per_second=0)


def test_the_closer_sees_only_its_own_threads_request() -> None:
    import threading

    closer = hooks.ConnectionCloser(per_second=1e9)
    mine = _Req()
    closer.note(mine)
    other = threading.Thread(target=closer)  # nothing noted on that thread
    other.start()
    other.join()
    assert not mine.must_close


def test_a_503_written_by_the_middleware_calls_the_hooks_a_504_does_not() -> None:
    from brownout import Reason
    from brownout._edge import Refusal
    from brownout.integrations import wsgi

    calls: list[int] = []

    def hook() -> None:
        calls.append(1)

    wsgi.on_capacity_refusal(hook)
    wsgi.on_capacity_refusal(hook)  # once per hook
    try:
        sent: list[str] = []
        full = Refusal(503, Reason.QUEUE_FULL, b"{}", None, False, ())
        late = Refusal(504, Reason.DEADLINE_TOO_SHORT, b"{}", None, False, ())
        wsgi.write_refusal(full, lambda status, headers: sent.append(status))
        wsgi.write_refusal(late, lambda status, headers: sent.append(status))
        assert sent == ["503 Service Unavailable", "504 Gateway Timeout"] and calls == [1]
    finally:
        wsgi._capacity_refused.remove(hook)
