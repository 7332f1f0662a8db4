"""How ``dev.py test`` shares the integration tests between workers: every test that
touches PostgreSQL is marked ``postgres`` and runs in a serial pass of its own (several
count or terminate backends in ``pg_stat_activity``, which a neighbour would disturb); the
others run on two workers, a file to a worker (``--dist loadfile``), so a file's servers,
queues and keys stay its own.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgres: talks to PostgreSQL; run without neighbours")


def pytest_itemcollected(item: pytest.Item) -> None:
    if "postgres_server" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.postgres)
