"""Every doc example runs: a how-to whose code does not run is a bug.

Each page in docs/ is a script: its ```python blocks are concatenated in order and run in a
fresh interpreter. A block right after a `<!-- no-run -->` line is shown but not run (use it
only for fragments that cannot stand alone, such as a FastAPI app meant for uvicorn's command
line); the marker is an HTML comment so Markdown renderers still see a plain python fence.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^(<!-- no-run -->\n)?```python[^\n]*\n(.*?)^```", re.S | re.M)


def page_script(path: Path) -> str:
    blocks = [body for marker, body in BLOCK.findall(path.read_text()) if not marker]
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


def test_fences_have_one_word_info_strings() -> None:
    """The docs site's Markdown ends a page's code early at a fence like ```python no-run."""
    bad = [
        f"{page.name}:{n}: {line.strip()}"
        for page in sorted(DOCS.glob("*.md"))
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if re.match(r"\s*```\S*\s+\S", line)
    ]
    assert bad == []


YAML_BLOCK = re.compile(r"^```ya?ml[^\n]*\n(.*?)^```", re.S | re.M)


def test_yaml_examples_parse() -> None:
    """```yaml blocks (alert rules, KEDA and HPA manifests) are not run, but must be valid YAML."""
    import yaml

    seen = 0
    bad = []
    for page in sorted(DOCS.glob("*.md")):
        for n, block in enumerate(YAML_BLOCK.findall(page.read_text()), 1):
            seen += 1
            try:
                list(yaml.safe_load_all(block))
            except yaml.YAMLError as error:
                bad.append(f"{page.name}, yaml block {n}: {error}")
    assert seen >= 4, "the observability page's autoscaling examples are gone"
    assert bad == []


def test_a_broken_yaml_example_would_be_caught() -> None:
    import yaml

    (block,) = YAML_BLOCK.findall("```yaml\ntarget: {type: Value, value: 30\n```\n")
    with pytest.raises(yaml.YAMLError):
        list(yaml.safe_load_all(block))
