#!/usr/bin/env python3
"""Set up and run brownout from a fresh clone with nothing but Python 3.11+.

    python3 dev.py lab     # the main job: the overload lab on the embedded demo system
    python3 dev.py test    # the whole suite: ruff, mypy --strict, the docs build, pytest

Both create (or refresh, when pyproject.toml changed) a virtual environment in ./.venv and
install brownout with every extra into it, so nothing needs installing by hand.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".brownout-stamp"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"


def _fingerprint() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_venv() -> None:
    """Create ./.venv with brownout[all] and the `dev` dependency group, unless it is current.

    The `dev` group (PEP 735, pyproject.toml's [dependency-groups]) holds the test, lint, type
    and docs tools; it is not a published extra. `pip install --group` needs pip >= 25.1, so pip
    is upgraded first.
    """
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py runs under whatever python3 is
        sys.exit(f"brownout needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    wanted = _fingerprint()
    if PY.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not PY.exists():
        print("dev.py: creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(VENV)
    print("dev.py: installing brownout[all] and the dev group into .venv", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip>=25.1"], check=True)
    subprocess.run([*pip, "-e", ".[all]", "--group", "dev"], check=True, cwd=ROOT)
    STAMP.write_text(wanted)


def run(*args: str) -> int:
    print("$", " ".join(args), flush=True)
    # NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, printed on every build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(list(args), cwd=ROOT, env=env).returncode


def cmd_test(extra: list[str]) -> int:
    ensure_redis()
    # Only folders that exist: a fresh clone has no empty folders.
    paths = [p for p in ("src", "tests", "bench", "examples", "dev.py") if (ROOT / p).exists()]
    # The docs site (mkdocs.yml): strict, so a broken link or anchor fails; a few seconds.
    site = tempfile.mkdtemp(prefix="brownout-site-")
    steps = [
        [str(BIN / "ruff"), "check", *paths],
        [str(BIN / "ruff"), "format", "--check", *paths],
        [str(BIN / "mypy"), "--strict", "src"],
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", site],
        *_pytest_steps(extra),
    ]
    try:
        failed = [" ".join([Path(s[0]).name, *s[1:]]) for s in steps if run(*s) != 0]
    finally:
        shutil.rmtree(site, ignore_errors=True)
    if failed:
        print("dev.py: FAILED:", ", ".join(failed), flush=True)
        return 1
    print("dev.py: all checks passed", flush=True)
    return 0


def _pytest_steps(extra: list[str]) -> list[list[str]]:
    """The whole suite: unit tests on every core (virtual time, no shared servers); the
    integration tests on two workers, a file to a worker (their margins allow a shared
    host), except those marked ``postgres`` (tests/integration/conftest.py), which run one
    at a time after them; then the end-to-end lab runs one at a time (each pins the lab's
    processes to cores). Arguments given run one plain pytest."""
    pytest = [str(PY), "-m", "pytest", "-q"]
    if extra:
        return [[*pytest, *extra]]
    integration = [*pytest, "--durations=10", "tests/integration", "-m"]
    return [
        [*pytest, "-n", "auto", "tests/unit"],
        [*integration, "not postgres", "-n", "2", "--dist", "loadfile"],
        [*integration, "postgres"],
        [*pytest, "--durations=5", "tests/e2e"],
    ]


def ensure_redis() -> None:
    """Start a throwaway Redis on 127.0.0.1:6379 when none answers and redis-server exists.

    The Redis tests need a real one; without it they fail, saying how to start it
    (tests/services.py).
    """
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return
    except OSError:
        pass
    server = shutil.which("redis-server")
    if server is None:
        print("dev.py: no redis-server on PATH; the Redis tests will fail", flush=True)
        return
    subprocess.run(
        [server, "--daemonize", "yes", "--port", "6379", "--save", "", "--appendonly", "no"],
        check=False,
    )


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in {"lab", "test", "setup", "brownout"}:
        print(__doc__)
        return 2
    ensure_venv()
    cmd, extra = sys.argv[1], sys.argv[2:]
    if cmd == "setup":
        return 0
    if cmd == "test":
        return cmd_test(extra)
    if cmd == "lab":
        return run(str(BIN / "brownout"), "lab", *extra)
    return run(str(BIN / "brownout"), *extra)


if __name__ == "__main__":
    sys.exit(main())
