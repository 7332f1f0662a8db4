"""Imports point down only: the layer table of src/brownout, held by reading the source.

Every module is parsed with `ast` (nothing is imported). A module belongs to the layer of the
longest table entry that is its dotted name or a package above it, so splitting a module into
a package (``_edge`` into ``_edge/``) keeps its layer. Checked:

- a module imports only from its own layer or lower, and the primitives not from each other;
- no import cycle between modules at module level (imports under ``if TYPE_CHECKING:`` and
  inside functions are listed apart and allowed only where `DEFERRED` says why);
- the core imports only the standard library;
- no module imports an underscore-prefixed name from another module;
- no module imports the front door or a public facade (the apps, which are written as a
  user of the library would write them, excepted).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "brownout"

# (layer, module prefixes, why they sit here), lowest first. "__init__" is the front door.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "base",
        (
            "_checks",
            "_clock",
            "_settings",
            "_errors",
            "_priority",
            "_snapshot",
            "_extras",
            "_histogram",
            "_version",
            "_help",
            "events",
            "_tally_buffer",
            "_deadline",
            "_redis_keys",
        ),
        "vocabulary with no request in it: time, errors, priorities, events, deadlines, settings",
    ),
    (
        "context",
        ("_context", "_propagation"),
        "the current request (a contextvar) and how it crosses the wire",
    ),
    (
        "primitives",
        ("_admission", "_retry", "_degrade", "_quota", "_fleet", "_overload", "_stats"),
        "one mechanism each, composed by nothing below the composition layer",
    ),
    (
        "composition",
        ("_dependency", "_edge", "_durable", "_idempotency", "_database", "_testkit", "_sim"),
        "one outbound (Dependency), one inbound (EdgePolicy), one queued (durable) and one"
        " database (DatabasePolicy) path built from primitives; the idempotency layer on the"
        " edge's problem bodies; the testing kit that drives them; the simulator that runs"
        " them on virtual time",
    ),
    (
        "facades",
        (
            "__init__",
            "durable",
            "idempotency",
            "limits",
            "queues",
            "signals",
            "sim",
            "testing",
            "wire",
        ),
        "the public names; re-exports only, so nothing inside imports them",
    ),
    (
        "adapters",
        ("integrations", "export"),
        "framework and exporter glue: translate, never decide; each needs an optional extra",
    ),
    (
        "apps",
        ("_lab", "_cli", "_queue_cli", "_sim_cli", "_sim_report", "__main__"),
        "the overload lab and the command line: users of the library",
    ),
]

CORE_EXCLUDED = ("integrations", "export", "_lab", "_cli", "_queue_cli", "_sim_cli", "_sim_report")
"""Everything else is the core: standard library imports only."""

INDEPENDENT = ("_admission", "_retry", "_degrade", "_quota", "_fleet", "_overload", "_stats")
"""The primitives import none of each other: admission does not depend on observability, nor
retries on quotas; composing them is the composition layer's job."""

FACADES = (
    "__init__",
    "durable",
    "idempotency",
    "limits",
    "queues",
    "signals",
    "sim",
    "testing",
    "wire",
)

# Imports under `if TYPE_CHECKING:` or inside a function, by (importer prefix, target prefix):
# allowed only here, each with its reason. They may point anywhere the layers allow, and
# are left out of the cycle check (they do not run at import time).
DEFERRED: dict[tuple[str, str], str] = {
    ("_admission.permit", "_admission.bulkhead"): "type of the friend it settles (TYPE_CHECKING)",
    ("_tally_buffer", "_clock"): "a type only (TYPE_CHECKING)",
    ("_edge.express", "_edge.policy"): "the policy that builds the express plan (TYPE_CHECKING)",
    ("_dependency", "_context"): "event fields read only when a sink listens (branch edge)",
    ("_cli", "_lab"): "the lab's modules load only for the subcommand that runs them",
    ("_cli", "export._top"): "`brownout top` loads its exporter only when asked",
    ("_cli", "_queue_cli"): "`brownout queue` loads its broker adapters only when asked",
    ("_cli", "_sim_cli"): "`brownout sim` loads the simulator only when asked",
    ("_queue_cli", "integrations.redis_streams"): "the Redis client only for --redis",
    ("_queue_cli", "integrations.aio_pika"): "the RabbitMQ client only for --amqp",
    ("_lab.demo", "_lab"): "the demo process loads its own pieces after the fork",
    ("_lab.demo", "_admission.loop_lag"): "the demo process starts its probe after the fork",
    ("_lab.demo", "__init__"): "the demo process loads brownout after the fork",
    ("_lab.demo", "testing"): "the demo process loads brownout after the fork",
    ("_lab.demo", "wire"): "the demo process loads brownout after the fork",
    ("_lab.protect", "integrations.aiohttp_client"): "aiohttp only for the outbound demo",
    ("_lab.protect", "integrations.flask"): "Flask only in the sync front's process",
    ("_lab.protect", "export.prometheus"): "prometheus_client only for --server-view",
    ("_lab.backlog", "integrations.redis_streams"): "redis-py only when the backlog scenario runs",
    ("_lab.payments", "__init__"): "the payments scenario's client loads only when it runs",
    ("_lab.payments", "wire"): "the payments scenario's client loads only when it runs",
    ("_lab.payments", "integrations.httpx"): "httpx only when the payments scenario runs",
    ("_lab.payments", "_lab.payments_service"): "a constant of the service, when it runs",
    ("_lab.payments_service", "__init__"): "the service process loads brownout after the fork",
    ("_lab.database", "wire"): "the database scenario's client loads only when it runs",
    ("_lab.database_service", "__init__"): "the front process loads brownout after the fork",
    ("_lab.database_service", "integrations"): "starlette, asyncpg only in the front process",
    ("_lab.payments_service", "idempotency"): "the service process loads brownout after the fork",
    ("_lab.payments_service", "integrations"): "starlette, httpx, asyncpg only in the process",
    ("integrations.gunicorn", "export.prometheus"): "prometheus_client only in multiprocess mode",
    ("integrations.sqlalchemy", "integrations._asyncpg_budget"): "asyncpg only for its dialect",
    ("integrations.sqlalchemy", "integrations.psycopg"): "psycopg only for its dialect",
}

# Third-party imports in the core inside functions, by (importer, package).
CORE_DEFERRED_THIRD_PARTY: dict[tuple[str, str], str] = {
    ("_quota.redis", "redis"): "exception types of the client the user passed in",
    ("_idempotency.redis", "redis"): "exception types of the client the user passed in",
    ("_fleet.redis", "redis"): "exception types of the client the user passed in",
}

# Underscore-prefixed names imported across modules, by (importer prefix, name): none.
LEGACY_PRIVATE_NAMES: dict[tuple[str, str], str] = {}

# Apps may use the public API as a user would (the demo service is written that way).
FACADE_USERS = ("_lab", "_cli")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted, relative to brownout ("__init__" for the front door)
    target: str  # the module imported from, same form; or a third-party top-level name
    names: tuple[str, ...]
    kind: str  # "module", "type_checking" or "function"
    internal: bool
    line: int


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = [] if importer == "__init__" else importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(["brownout", *base, *([node.module] if node.module else [])])


def imports_of(path: Path, src: Path = SRC) -> Iterator[Import]:
    importer = module_name(path, src)
    is_package = path.name == "__init__.py"

    def one(dotted: str, names: tuple[str, ...], kind: str, line: int) -> Import:
        if dotted == "brownout" or dotted.startswith("brownout."):
            rel = dotted.removeprefix("brownout").removeprefix(".") or "__init__"
            return Import(importer, rel, names, kind, True, line)
        return Import(importer, dotted.split(".")[0], names, kind, False, line)

    def walk(body: list[ast.stmt], kind: str) -> Iterator[Import]:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield one(alias.name, (), kind, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(importer, is_package, node)
                names = tuple(a.name for a in node.names)
                yield one(target, names, kind, node.lineno)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "type_checking")
                yield from walk(node.orelse, kind)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, "function" if kind == "module" else kind)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        yield from walk(sub, kind)

    tree = ast.parse(path.read_text(), str(path))
    yield from walk(tree.body, "module")


def all_imports(src: Path = SRC) -> list[Import]:
    return [imp for path in sorted(src.rglob("*.py")) for imp in imports_of(path, src)]


def modules(src: Path = SRC) -> list[str]:
    return sorted(module_name(p, src) for p in src.rglob("*.py"))


def matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_name, prefixes, _why) in enumerate(LAYERS):
        for prefix in prefixes:
            if matches(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    if best is None:
        raise AssertionError(f"brownout.{module} is in no layer: add it to LAYERS")
    return best[1]


def target_module(imp: Import, known: set[str]) -> str:
    """The module an internal import loads: ``from pkg import submodule`` loads the submodule
    (for a single name), otherwise the module named."""
    if len(imp.names) == 1 and f"{imp.target}.{imp.names[0]}" in known:
        return f"{imp.target}.{imp.names[0]}"
    if imp.target == "__init__" and len(imp.names) == 1 and imp.names[0] in known:
        return imp.names[0]
    return imp.target


def listed(table: dict[tuple[str, str], str], importer: str, target: str) -> bool:
    return any(matches(importer, a) and matches(target, b) for a, b in table)


# -- the checks ---------------------------------------------------------------------------------


def layer_violations(imports: list[Import], known: set[str]) -> list[str]:
    out = []
    for imp in imports:
        if not imp.internal:
            continue
        target = target_module(imp, known)
        if layer_of(target) > layer_of(imp.importer):
            out.append(
                f"{imp.importer}:{imp.line} ({LAYERS[layer_of(imp.importer)][0]}) imports "
                f"{target} ({LAYERS[layer_of(target)][0]})"
            )
    return out


def entangled_primitives(imports: list[Import], known: set[str]) -> list[str]:
    def home(module: str) -> str | None:
        return next((p for p in INDEPENDENT if matches(module, p)), None)

    return [
        f"{imp.importer}:{imp.line} imports {target_module(imp, known)}"
        for imp in imports
        if imp.internal
        and home(imp.importer) is not None
        and home(target_module(imp, known)) not in (None, home(imp.importer))
    ]


def unlisted_deferred(imports: list[Import], known: set[str]) -> list[str]:
    return [
        f"{imp.importer}:{imp.line} imports {target_module(imp, known)} ({imp.kind})"
        for imp in imports
        if imp.internal
        and imp.kind != "module"
        and not listed(DEFERRED, imp.importer, target_module(imp, known))
    ]


def cycles(imports: list[Import], known: set[str]) -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in known}
    for imp in imports:
        if imp.internal and imp.kind == "module":
            target = target_module(imp, known)
            if target != imp.importer:
                graph[imp.importer].add(target)
    # A package's __init__ importing its own modules is how a package is built, not a cycle.
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if matches(node, nxt) and nxt != node:
                continue  # a module importing its own package's __init__ (load order)
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def third_party_in_core(imports: list[Import]) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return [
        f"{imp.importer}:{imp.line} imports {imp.target} ({imp.kind})"
        for imp in imports
        if not imp.internal
        and imp.target not in stdlib
        and not any(matches(imp.importer, p) for p in CORE_EXCLUDED)
        and not (
            imp.kind == "function"
            and any(
                matches(imp.importer, a) and imp.target == b for a, b in CORE_DEFERRED_THIRD_PARTY
            )
        )
    ]


def private_names(imports: list[Import]) -> list[str]:
    return [
        f"{imp.importer}:{imp.line} imports {name} from {imp.target}"
        for imp in imports
        if imp.internal
        for name in imp.names
        if name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
        and not any(matches(imp.importer, a) and name == n for (a, n) in LEGACY_PRIVATE_NAMES)
    ]


def facade_imports(imports: list[Import], known: set[str]) -> list[str]:
    out = []
    for imp in imports:
        if not imp.internal or imp.importer in FACADES:  # a facade re-exports: that is its job
            continue
        if any(matches(imp.importer, p) for p in FACADE_USERS):
            continue
        target = target_module(imp, known)
        if target in FACADES:
            out.append(f"{imp.importer}:{imp.line} imports {target}")
    return out


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> tuple[list[Import], set[str]]:
    return all_imports(), set(modules())


def test_every_module_has_a_layer(graph: tuple[list[Import], set[str]]) -> None:
    for module in graph[1]:
        layer_of(module)


def test_imports_point_down_only(graph: tuple[list[Import], set[str]]) -> None:
    assert layer_violations(*graph) == []


def test_the_primitives_are_independent(graph: tuple[list[Import], set[str]]) -> None:
    assert entangled_primitives(*graph) == []


def test_deferred_imports_are_listed(graph: tuple[list[Import], set[str]]) -> None:
    assert unlisted_deferred(*graph) == []


def test_no_import_cycles(graph: tuple[list[Import], set[str]]) -> None:
    assert cycles(*graph) == []


def test_the_core_imports_only_the_standard_library(
    graph: tuple[list[Import], set[str]],
) -> None:
    assert third_party_in_core(graph[0]) == []


def test_no_module_imports_a_private_name_from_another(
    graph: tuple[list[Import], set[str]],
) -> None:
    assert private_names(graph[0]) == []


def test_nothing_inside_imports_the_front_door_or_a_facade(
    graph: tuple[list[Import], set[str]],
) -> None:
    assert facade_imports(*graph) == []


def test_every_module_says_its_idea(graph: tuple[list[Import], set[str]]) -> None:
    missing = [
        m
        for m in graph[1]
        if not ast.get_docstring(
            ast.parse((SRC / (m.replace(".", "/") + ".py")).read_text())
            if (SRC / (m.replace(".", "/") + ".py")).exists()
            else ast.parse((SRC / m.replace(".", "/") / "__init__.py").read_text())
        )
    ]
    missing = [m for m in missing if m != "__init__"]
    assert missing == []


def test_the_checks_catch_a_planted_violation(tmp_path: Path) -> None:
    # The checks above return [] on the real tree; here each finds what was planted.
    (tmp_path / "__init__.py").write_text('"""Front."""\n')
    (tmp_path / "_clock.py").write_text('"""Time."""\nfrom ._context import current\n')
    (tmp_path / "_context.py").write_text(
        '"""Ctx."""\nimport httpx\nfrom ._clock import _now\nfrom . import wire\n'
    )
    (tmp_path / "wire.py").write_text('"""Wire."""\n')
    (tmp_path / "_admission").mkdir()
    (tmp_path / "_admission" / "__init__.py").write_text('"""Admission."""\n')
    (tmp_path / "_admission" / "queues.py").write_text('"""Q."""\nfrom .._stats import Stats\n')
    (tmp_path / "_stats.py").write_text('"""Stats."""\n')
    imports, known = all_imports(tmp_path), set(modules(tmp_path))
    assert [v.split(":")[0] for v in layer_violations(imports, known)] == ["_clock", "_context"]
    assert cycles(imports, known) == [["_clock", "_context", "_clock"]]
    assert third_party_in_core(imports) == ["_context:2 imports httpx (module)"]
    assert private_names(imports) == ["_context:3 imports _now from _clock"]
    assert facade_imports(imports, known) == ["_context:4 imports wire"]
    assert entangled_primitives(imports, known) == ["_admission.queues:2 imports _stats"]
