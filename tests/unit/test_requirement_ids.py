"""Every requirement tag used in the repository is defined in docs/requirements.md.

Tags such as D6 or S8 (a letter and a number) cite the project's own requirements. This test
collects them from the source, tests, docs, examples, benchmarks and dashboards and checks
that docs/requirements.md defines each one exactly once, behind an anchor
(``<a id="d6"></a>D6``), so that ``requirements.md#d6`` always resolves. Directories are
walked, never listed file by file, so renaming modules does not touch this test.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docs" / "requirements.md"
SCANNED_DIRS = ("src", "docs", "tests", "bench", "examples", "dashboards")
SCANNED_FILES = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")
TEXT_SUFFIXES = {".py", ".md", ".json", ".yml", ".yaml", ".toml", ".txt", ".sh", ".cfg", ".ini"}

# The letters of the requirement groups; docs/requirements.md must use exactly these.
LETTERS = "ABCDFGILOQRSTW"
TAG = re.compile(rf"\b[{LETTERS}][0-9]{{1,2}}\b")
# "R1-R5", "T1 to T4" (also with an en or em dash): every tag in between is cited too.
RANGE = re.compile(rf"\b([{LETTERS}])([0-9]{{1,2}})\s*(?:-|\u2013|\u2014|to)\s*\1([0-9]{{1,2}})\b")
# Look-alikes that are not ours: gRPC's design proposals ("gRFC A6", "gRPC's A6 backoff")
# and CPU caches ("L2 cache", "the CPU's L2 size").
NOT_TAGS = re.compile(r"\bgRFC\s+A[0-9]+\b|\bgRPC's\s+A[0-9]+\b|\bL[1-3]\s+(?:cache|size)\b")
DEFINITION = re.compile(r'<a id="([^"]*)"></a>\s*([A-Z][0-9]{1,2})\b')
ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$", re.M)
LINK_INTO = re.compile(r"requirements\.md#([\w-]+)")


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            if path.is_file() and path.suffix in TEXT_SUFFIXES:
                files.append(path)
    return files


def tags_in(text: str) -> list[tuple[str, int]]:
    """The requirement tags cited in ``text``, each with its line number."""
    text = NOT_TAGS.sub(lambda m: " " * len(m.group()), text)
    found = [(m.group(), m.start()) for m in TAG.finditer(text)]
    for m in RANGE.finditer(text):
        letter, first, last = m.group(1), int(m.group(2)), int(m.group(3))
        found += [(f"{letter}{n}", m.start()) for n in range(first, last + 1)]
    return [(tag, text.count("\n", 0, at) + 1) for tag, at in found]


def used_tags() -> dict[str, list[str]]:
    """Every tag used in the repository, with where it is used (``path:line``)."""
    used: dict[str, list[str]] = {}
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for tag, line in tags_in(text):
            used.setdefault(tag, []).append(f"{path.relative_to(ROOT)}:{line}")
    return used


def definitions() -> list[tuple[str, str]]:
    """(anchor, tag) for each requirement defined in docs/requirements.md, in order."""
    return DEFINITION.findall(REQUIREMENTS.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """The anchor that GitHub and mkdocs give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_requirements_page_defines_each_id_once() -> None:
    defined = definitions()
    assert defined, "docs/requirements.md defines no requirement"
    twice = sorted(tag for tag, n in Counter(tag for _, tag in defined).items() if n > 1)
    assert not twice, f"defined more than once in docs/requirements.md: {twice}"
    bad = [(anchor, tag) for anchor, tag in defined if anchor != tag.lower()]
    assert not bad, f'each anchor must be its tag in lower case (<a id="d6"></a>D6): {bad}'
    assert {tag[0] for _, tag in defined} == set(LETTERS), "LETTERS and the page's groups differ"


def test_every_tag_used_in_the_repository_is_defined() -> None:
    used = used_tags()
    where = {loc.split("/", 1)[0] for locs in used.values() for loc in locs}
    assert {"src", "docs", "tests"} <= where, f"the scan found tags only in {sorted(where)}"
    defined = {tag for _, tag in definitions()}
    missing = {tag: locs[:3] for tag, locs in sorted(used.items()) if tag not in defined}
    assert not missing, f"requirement tags not defined in docs/requirements.md: {missing}"


def test_links_to_requirements_resolve() -> None:
    page = REQUIREMENTS.read_text(encoding="utf-8")
    targets = set(ANCHOR.findall(page)) | {slug(h) for h in HEADING.findall(page)}
    broken = [
        f"{path.relative_to(ROOT)}: #{fragment}"
        for path in scanned_files()
        for fragment in LINK_INTO.findall(path.read_text(encoding="utf-8", errors="replace"))
        if fragment not in targets
    ]
    assert not broken, f"links to missing anchors of docs/requirements.md: {broken}"
