"""Requests rendered per send: path, headers and body with ``{name}`` placeholders.

A scenario file's endpoint declares a generator per placeholder (`Param`: an integer range,
a choice list, or a fresh UUID); `RequestTemplate.render` draws every placeholder once per
request and encodes the HTTP/1.1 request. Templates are plain frozen data so a `LoadPlan`
carrying them can be pickled to the generator's process.

A JSON body is kept as its parsed structure: a string that is exactly one placeholder
(``"{id}"``) becomes the drawn value with its own type (an integer stays an integer), a
placeholder inside a longer string is substituted as text.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .http1 import encode_request

__all__ = ["PLACEHOLDER", "Param", "RequestTemplate", "placeholders"]

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""``{name}``: only an identifier in braces is a placeholder, so JSON text is left alone."""


def placeholders(text: str) -> list[str]:
    """The placeholder names in ``text``, in order."""
    return PLACEHOLDER.findall(text)


@dataclass(frozen=True)
class Param:
    """How one placeholder is drawn: ``int`` (``low``..``high`` inclusive), ``choice`` or
    ``uuid`` (a fresh UUID4 per send, never repeated by a re-run with the same seed)."""

    kind: str
    low: int = 0
    high: int = 0
    choices: tuple[str | int | float | bool, ...] = ()

    def draw(self, rng: random.Random) -> str | int | float | bool:
        if self.kind == "int":
            return rng.randint(self.low, self.high)
        if self.kind == "choice":
            return self.choices[rng.randrange(len(self.choices))]
        # From the OS, not the seeded rng: a re-measurement must not resend the same keys.
        return str(uuid.uuid4())


def _text(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _fill(text: str, values: dict[str, Any]) -> str:
    return PLACEHOLDER.sub(lambda m: _text(values[m.group(1)]), text)


def _fill_json(node: Any, values: dict[str, Any]) -> Any:
    if isinstance(node, str):
        whole = PLACEHOLDER.fullmatch(node)
        if whole is not None:
            return values[whole.group(1)]
        return _fill(node, values)
    if isinstance(node, dict):
        return {k: _fill_json(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_json(v, values) for v in node]
    return node


@dataclass(frozen=True)
class RequestTemplate:
    """One endpoint's request with its placeholders, rendered afresh for every send."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, Param], ...] = ()
    json_body: Any = None
    """The parsed JSON body (None: no JSON body)."""
    text_body: str | None = None

    def render(self, rng: random.Random, host: str, extra: tuple[tuple[str, str], ...]) -> bytes:
        """The request's bytes with every placeholder drawn from ``rng``."""
        values = {name: p.draw(rng) for name, p in self.params}
        headers = tuple((k, _fill(v, values)) for k, v in self.headers)
        body = b""
        if self.json_body is not None:
            body = json.dumps(_fill_json(self.json_body, values), separators=(",", ":")).encode()
        elif self.text_body is not None:
            body = _fill(self.text_body, values).encode()
        return encode_request(self.method, _fill(self.path, values), host, (*headers, *extra), body)

    @property
    def static(self) -> bool:
        """True when nothing varies between sends (the bytes can be built once)."""
        return not self.params
