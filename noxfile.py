"""brownout on every supported Python: `nox` (python3 dev.py test is the one-interpreter run).

    nox -s tests               # pytest on 3.11, 3.12 and 3.13 (each one found on PATH)
    nox -s tests-3.13 -- tests/unit -x -q    # one interpreter; after `--`: pytest's arguments
    nox -s lint typecheck docs

nox finds each interpreter as python3.11, python3.12, python3.13 on PATH. With pyenv, whose
shims answer only for the active versions, put the versions' own bin folders first, e.g.
`PATH=$HOME/.pyenv/versions/3.12.1/bin:$HOME/.pyenv/versions/3.13.0/bin:$PATH nox -s tests`.
A session whose interpreter is missing is skipped, and says so.

Each session installs into its own virtualenv under .nox/: brownout (not editable, so the tests
run against what a wheel installs) with every extra, plus the `dev` dependency group of
pyproject.toml, read by nox itself, so any pip will do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.error_on_missing_interpreters = False

ROOT = Path(__file__).resolve().parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
PYTHONS = ["3.11", "3.12", "3.13"]


def group(name: str) -> tuple[str, ...]:
    return nox.project.dependency_groups(PYPROJECT, name)


def only(name: str) -> list[str]:
    """The dev group's requirement for one distribution (the pin dev.py installs)."""
    return [req for req in group("dev") if Requirement(req).name == name]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """pytest (the whole suite by default; `-- ARGS` replaces pytest's arguments)."""
    session.install(".[all]", *group("dev"))
    # The Redis tests need a server; dev.py starts a throwaway one when redis-server exists.
    sys.path.insert(0, str(ROOT))
    from dev import ensure_redis

    ensure_redis()
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over everything dev.py test checks."""
    session.install(*only("ruff"))
    paths = ["src", "tests", "bench", "examples", "dev.py", "noxfile.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict src, with every extra and the dev group, as dev.py test has them."""
    session.install(".[all]", *group("dev"))
    session.run("mypy", "--strict", "src")


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site, strict: a broken link or anchor fails. `-- serve` to browse it instead."""
    session.install(*group("docs"), *only("ruff"))  # mkdocstrings formats signatures with ruff
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's end-of-life banner
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
        return
    site = session.create_tmp()
    session.run("mkdocs", "build", "--strict", "--site-dir", str(Path(site) / "site"))
