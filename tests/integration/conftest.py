"""How the integration tests share the two workers of ``dev.py test``.

Each file runs on one worker (its module-scoped servers, queues and keys stay its own), and
every test that touches PostgreSQL runs on the same worker, one after another: several of
them count or terminate backends in ``pg_stat_activity``, which a neighbour would disturb.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = "postgres" if "postgres_server" in item.fixturenames else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
