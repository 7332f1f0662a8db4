"""The core imports nothing outside the standard library (DESIGN: layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "brownout"
# Layers allowed to import third-party packages (each is an optional extra).
OPTIONAL_LAYERS = {"integrations", "export", "_lab", "_cli.py"}


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


# -- an extra that is not installed ------------------------------------------------------------

_BLOCK = "import sys\nfor name in {blocked!r}: sys.modules[name] = None  # as if not installed\n"


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("brownout.integrations.aiohttp_client", "aiohttp", "aiohttp"),
        ("brownout.integrations.aiohttp_server", "aiohttp", "aiohttp"),
        ("brownout.integrations.grpc_client", "grpc", "grpc"),
        ("brownout.integrations.grpc_server", "grpc", "grpc"),
        ("brownout.integrations.httpx", "httpx", "httpx"),
        ("brownout.integrations.requests", "requests", "requests"),
        ("brownout.integrations.urllib3", "urllib3", "urllib3"),
        ("brownout.integrations.redis_streams", "redis", "redis"),
        ("brownout.integrations.aio_pika", "aio_pika", "rabbitmq"),
        ("brownout.integrations.faststream", "faststream", "faststream"),
        ("brownout.export.otel", "opentelemetry", "otel"),
        ("brownout.export.prometheus", "prometheus_client", "prometheus"),
        ("brownout.export._top", "rich", "top"),
    ],
)
def test_a_missing_extra_is_named_with_what_to_install(
    module: str, blocked: str, extra: str
) -> None:
    # Without its extra a module failed with "No module named 'grpc'" and no hint.
    code = _BLOCK.format(blocked=[blocked]) + (
        f"try:\n    import {module}\n"
        "except ModuleNotFoundError as e:\n    print(e.name, '|', e)\n"
        "else:\n    print('imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split(" | ")[0].split(".")[0] == blocked, out  # e.name: what failed to import
    assert f"{module} needs the {blocked} package" in out, out
    assert f"pip install 'brownout[{extra}]'" in out, out


def test_the_lab_without_its_extra_says_what_to_install() -> None:
    code = _BLOCK.format(blocked=["rich", "matplotlib"]) + (
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n in ('rich', 'matplotlib') "
        "else real(n, *a)\n"
        "from brownout._cli import main\n"
        "raise SystemExit(main(['lab', '--quick']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, (r.stdout, r.stderr)  # EXIT_MISSING_EXTRA
    assert "Traceback" not in r.stderr, r.stderr
    assert "rich, matplotlib" in r.stderr and "pip install 'brownout[lab]'" in r.stderr, r.stderr
