"""The README's quick start is real: the same code as examples/quickstart.py, and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quickstart_lines() -> str:
    source = (ROOT / "examples" / "quickstart.py").read_text()
    start = source.index("# --- the ten lines the README shows")
    body = source[source.index("\n", start) + 1 : source.index("# -----", start + 10)]
    return body.strip()


def test_readme_shows_the_quickstart_verbatim() -> None:
    assert quickstart_lines() in (ROOT / "README.md").read_text()


def test_quickstart_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "payments saw:" in result.stdout


def test_the_readme_block_runs_as_pasted() -> None:
    """Pasted alone into a file, the README's block builds the app and its client."""
    result = subprocess.run(
        [sys.executable, "-c", quickstart_lines()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
