"""The examples of docs/databases-drivers.md (shown, not run by test_docs.py: they need the
real PostgreSQL) run here, each in a fresh interpreter, against the real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests import services

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "databases-drivers.md"
BLOCK = re.compile(r"^(?:<!-- no-run -->\n)?```python[^\n]*\n(.*?)^```", re.S | re.M)
BLOCKS = BLOCK.findall(PAGE.read_text())


def test_the_page_has_both_examples() -> None:
    assert len(BLOCKS) == 2
    assert "BrownoutPsycopgPool" in BLOCKS[0] and "bsa.protect" in BLOCKS[1]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["psycopg", "sqlalchemy"])
def test_the_example_runs(index: int, postgres_server: services.Service) -> None:
    source = BLOCKS[index].replace(
        "127.0.0.1:5432", f"{postgres_server.host}:{postgres_server.port}"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    run = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0, run.stderr
