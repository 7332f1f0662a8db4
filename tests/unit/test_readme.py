"""The README's quick start is real: the same code as examples/quickstart.py, and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


EXAMPLES = ("quickstart.py", "quickstart_flask.py")


def quickstart_lines(example: str = "quickstart.py") -> str:
    source = (ROOT / "examples" / example).read_text()
    start = source.index("# --- the ten lines the README shows")
    body = source[source.index("\n", start) + 1 : source.index("# -----", start + 10)]
    return body.strip()


@pytest.mark.parametrize("example", EXAMPLES)
def test_readme_shows_the_quickstart_verbatim(example: str) -> None:
    assert quickstart_lines(example) in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("example", EXAMPLES)
def test_quickstart_runs(example: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "payments saw:" in result.stdout


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_readme_block_runs_as_pasted(example: str) -> None:
    """Pasted alone into a file, the README's block builds the app and its client."""
    result = subprocess.run(
        [sys.executable, "-c", quickstart_lines(example)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
