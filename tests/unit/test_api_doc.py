"""docs/api.md lists the whole public surface, and nothing else.

Every name in `brownout.__all__` and in each public module's ``__all__`` appears on the page,
written in full (``brownout.limits.FixedLimit``); and every ``brownout.…`` reference in
backquotes on the page resolves to a public object (no ``_`` module or name on the way).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

CORE_MODULES = (
    "brownout",
    "brownout.limits",
    "brownout.queues",
    "brownout.signals",
    "brownout.events",
    "brownout.testing",
    "brownout.sim",
    "brownout.wire",
    "brownout.durable",
    "brownout.idempotency",
)
ADAPTER_MODULES = (
    "brownout.integrations.pytest_plugin",
    "brownout.integrations.asgi",
    "brownout.integrations.aiohttp_server",
    "brownout.integrations.wsgi",
    "brownout.integrations.flask",
    "brownout.integrations.django",
    "brownout.integrations.grpc_server",
    "brownout.integrations.asgi_idempotency",
    "brownout.integrations.aiohttp_idempotency",
    "brownout.integrations.grpc_idempotency",
    "brownout.integrations.httpx",
    "brownout.integrations.requests",
    "brownout.integrations.urllib3",
    "brownout.integrations.aiohttp_client",
    "brownout.integrations.grpc_client",
    "brownout.integrations.lifespan",
    "brownout.integrations.redis_streams",
    "brownout.integrations.asyncpg",
    "brownout.integrations.aio_pika",
    "brownout.integrations.faststream",
    "brownout.integrations.celery",
    "brownout.integrations.gunicorn",
    "brownout.integrations.psycopg",
    "brownout.integrations.sqlalchemy",
    "brownout.export.prometheus",
    "brownout.export.otel",
    "brownout.export.logging",
)
PUBLIC_MODULES = CORE_MODULES + ADAPTER_MODULES
PACKAGES = ("brownout.integrations", "brownout.export")

# A backquoted span that starts with a dotted brownout path: `brownout.limits.FixedLimit`,
# `brownout.Quota.for_edge()`, `brownout.integrations.*`.
REFERENCE = re.compile(r"`(brownout(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def load(name: str) -> ModuleType:
    """Import a public module; adapters whose framework is not installed are skipped."""
    try:
        return importlib.import_module(name)
    except ImportError as e:  # brownout's missing-extra error is an ImportError
        if name in CORE_MODULES:
            raise
        pytest.skip(f"{name}: {e}")


def page() -> str:
    return API_DOC.read_text()


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_listed(module: str) -> None:
    mod = load(module)
    listed = set(REFERENCE.findall(page()))
    missing = [n for n in mod.__all__ if f"{module}.{n}" not in listed]
    assert not missing, f"docs/api.md does not list {module}: {missing}"


def resolve(reference: str) -> object:
    """The object a reference names, by the longest importable public module prefix."""
    parts = reference.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in PUBLIC_MODULES or module in PACKAGES:
            obj: object = load(module)
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
    raise LookupError(f"{reference}: not under a public module")


def references() -> list[str]:
    return sorted(set(REFERENCE.findall(page())))


@pytest.mark.parametrize("reference", references())
def test_every_reference_exists_and_is_public(reference: str) -> None:
    parts = reference.split(".")
    private = [p for p in parts if p.startswith("_") and not p.endswith("__")]  # dunders are fine
    assert not private, f"docs/api.md names a private path: {reference}"
    try:
        resolve(reference)
    except (AttributeError, LookupError) as e:
        pytest.fail(f"docs/api.md names {reference}, which does not exist: {e}")
