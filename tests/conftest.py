"""Shared test configuration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

PLUGIN = "brownout.integrations.pytest_plugin"

ROOT = Path(__file__).resolve().parent.parent
# The examples and bench folders are importable as plain scripts in tests.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("BROWNOUT_TESTING", "1")


def pytest_configure(config: pytest.Config) -> None:
    # The kit's fixtures come from the ``pytest11`` entry point once brownout is installed
    # with it; a checkout run from source (PYTHONPATH=src) loads the plugin here.
    if not config.pluginmanager.has_plugin("brownout"):
        config.pluginmanager.import_plugin(PLUGIN)
