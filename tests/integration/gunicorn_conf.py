"""gunicorn settings for a multiprocess brownout service (docs/observability.md)."""

from __future__ import annotations

from typing import Any

from brownout.export.prometheus import mark_process_dead


def child_exit(server: Any, worker: Any) -> None:
    # Keeps the exited worker's counts, drops its gauges (brownout's and the application's).
    mark_process_dead(worker.pid)
