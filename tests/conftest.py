"""Shared test configuration."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PLUGIN = "brownout.integrations.pytest_plugin"

ROOT = Path(__file__).resolve().parent.parent
# The examples and bench folders are importable as plain scripts in tests.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("BROWNOUT_TESTING", "1")

from tests import services  # noqa: E402  (importable once ROOT is on the path)


def pytest_configure(config: pytest.Config) -> None:
    # The kit's fixtures come from the ``pytest11`` entry point once brownout is installed
    # with it; a checkout run from source (PYTHONPATH=src) loads the plugin here.
    if not config.pluginmanager.has_plugin("brownout"):
        config.pluginmanager.import_plugin(PLUGIN)


# -- real servers: a test that needs one asks for its fixture (see tests/services.py) --------
@pytest.fixture(scope="session")
def redis_server() -> services.Service:
    """The Redis the tests use (``BROWNOUT_TEST_REDIS``); fails the test when it is down."""
    return services.require(services.REDIS)


@pytest.fixture(scope="session")
def postgres_server() -> services.Service:
    """The PostgreSQL the tests use (``BROWNOUT_TEST_POSTGRES``; trust auth, database
    ``test``); fails the test when it is down."""
    return services.require(services.POSTGRES)


@pytest.fixture(scope="session")
def rabbitmq_server() -> services.Service:
    """The RabbitMQ the tests use (``BROWNOUT_TEST_RABBITMQ``); fails the test when down."""
    return services.require(services.RABBITMQ)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, int]]]:
    """A three-node Redis Cluster (no replicas) started for this session on loopback ports:
    its nodes' ``(host, port)``. Fails, never skips, when ``redis-server`` is missing."""
    with services.redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes
