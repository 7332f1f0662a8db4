"""``brownout.__version__`` is written once, in pyproject.toml, and read from the metadata."""

from __future__ import annotations

import importlib.metadata

import brownout


def test_version_is_the_installed_distributions() -> None:
    assert brownout.__version__ == importlib.metadata.version("brownout")
    assert brownout.__version__ != "0+unknown"  # the fallback is for a tree never installed
