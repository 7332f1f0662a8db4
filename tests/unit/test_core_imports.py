"""The core imports nothing outside the standard library (DESIGN: layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "brownout"
# Layers allowed to import third-party packages (each is an optional extra).
OPTIONAL_LAYERS = {"integrations", "export", "lab", "cli.py"}


def core_files() -> list[Path]:
    out = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        if rel[0] not in OPTIONAL_LAYERS:
            out.append(path)
    return out


def top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.If):  # TYPE_CHECKING blocks are fine
            continue
    return names


def test_core_modules_import_only_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names) | {"brownout"}
    offenders = {
        str(p.relative_to(SRC)): sorted(top_level_imports(p) - stdlib) for p in core_files()
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"third-party imports at module level in the core: {offenders}"


def test_importing_brownout_loads_no_framework() -> None:
    code = (
        "import sys, brownout\n"
        "bad = {'starlette','fastapi','aiohttp','grpc','httpx','prometheus_client','redis',"
        "'opentelemetry','uvicorn','rich','matplotlib'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
