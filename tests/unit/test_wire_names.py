"""Every wire name is spelled once: modules import it from where it is defined (through
`brownout.wire` or the module behind it), never repeat the literal."""

from __future__ import annotations

import ast
import pathlib

import brownout.wire as wire

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "brownout"

# Where each name is defined (`brownout.wire` re-exports them).
HOMES = {
    "_propagation.py",
    "_degrade/modes.py",  # DEGRADED_HEADER
    "_degrade/stale.py",  # STALE_AGE_HEADER
}


def test_no_module_repeats_a_wire_header_name() -> None:
    names = {
        value: name
        for name in wire.__all__
        if name.endswith(("_HEADER", "_KEY")) and isinstance(value := getattr(wire, name), str)
    }
    repeated = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel in HOMES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                repeated.append(
                    f"{rel}:{node.lineno}: {node.value!r} (brownout.wire.{names[node.value]})"
                )
    assert not repeated, "\n".join(repeated)
