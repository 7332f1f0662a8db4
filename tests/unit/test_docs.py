"""Every doc example runs (DESIGN: "every doc example is executed by a test").

Each page in docs/ is a script: its ```python blocks are concatenated in order and run in a
fresh interpreter. A block fenced as ```python no-run is shown but not run (use it only for
fragments that cannot stand alone, such as a FastAPI app meant for uvicorn's command line).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def page_script(path: Path) -> str:
    blocks = [body for info, body in BLOCK.findall(path.read_text()) if "no-run" not in info]
    return "\n".join(blocks)


PAGES = sorted(p for p in DOCS.glob("*.md") if page_script(p).strip())


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_doc_examples_run(page: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", page_script(page)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=DOCS.parent,
    )
    assert result.returncode == 0, f"{page.name} examples failed:\n{result.stdout}\n{result.stderr}"
