"""Settings from a mapping: a TOML file and environment variables, checked against the
constructors they feed.

`load_config` reads the file (`tomllib`) and merges ``BROWNOUT_A__B__C=value`` variables over
it. Each configurable class reads its own table through a `Section`, whose keys and types come
from the constructor's signature; ranges stay the constructor's to check (its ``ValueError``
is re-raised naming the key). Every problem of one build is collected and raised together as
one `ConfigError`: an unknown key is named in full with the closest known key, a wrong type
with the type expected. Durations are seconds, as everywhere in brownout.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ._priority import Priority

__all__ = [
    "SECTIONS",
    "ConfigError",
    "Section",
    "as_bool",
    "as_float",
    "as_int",
    "as_str",
    "build_in",
    "enum_list",
    "enum_of",
    "enum_table",
    "enum_value",
    "from_config",
    "load_config",
]

T = TypeVar("T")

SECTIONS = ("edge", "retry", "dependencies", "degraded")
"""The top-level tables brownout reads; any other top-level key is a typo."""

_BARE = re.compile(r"[A-Za-z0-9_-]+")


class ConfigError(ValueError):
    """Settings that cannot be used; ``problems`` lists each, naming its full dotted key."""

    def __init__(self, problems: list[str] | tuple[str, ...]) -> None:
        self.problems = tuple(problems)
        n = len(self.problems)
        super().__init__(
            f"{n} problem{'s' if n != 1 else ''} in brownout settings:\n  "
            + "\n  ".join(self.problems)
        )


class _Bad(Exception):
    """A value of the wrong type; the message says what was expected."""


def _dotted(path: str, key: str) -> str:
    part = key if _BARE.fullmatch(key) else json.dumps(key, ensure_ascii=False)  # TOML-quoted
    return f"{path}.{part}" if path else part


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), "a table" if isinstance(value, Mapping) else type(value).__name__
    )


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"expected an integer, got {_kind(value)}")
    return value


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(f"expected a number (seconds for a duration), got {_kind(value)}")
    if value != value:  # NaN passes every range check written with < and >
        raise _Bad("expected a number, got nan")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {_kind(value)}")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected a string, got {_kind(value)}")
    return value


def _str_list(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad(f"expected a list of strings, got {_kind(value)}")
    return list(value)


E = TypeVar("E", bound=enum.Enum)


def enum_value(kind: type[E], value: object) -> E:
    """The member of ``kind`` named by ``value`` (name or value, any case, ``-`` for ``_``);
    `_Bad` naming the choices otherwise."""
    names = {m.name.lower(): m for m in kind}
    if isinstance(value, str):
        text = value.strip().lower().replace("-", "_")
        member = names.get(text)
        if member is None:
            member = next((m for m in kind if str(m.value).lower() == text), None)
        if member is not None:
            return member
        close = difflib.get_close_matches(text, list(names), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _Bad(f"{value!r} is not one of {', '.join(sorted(names))}{hint}")
    raise _Bad(f"expected one of {', '.join(sorted(names))}, got {_kind(value)}")


def enum_of(kind: type[E]) -> Callable[[object], E]:
    """A converter to a member of ``kind`` (see `enum_value`)."""
    return lambda value: enum_value(kind, value)


def enum_list(kind: type[E]) -> Callable[[object], list[E]]:
    """A converter of a list of names to members of ``kind``."""

    def convert(value: object) -> list[E]:
        if not isinstance(value, list):
            raise _Bad(f"expected a list, got {_kind(value)}")
        return [enum_value(kind, v) for v in value]

    return convert


def enum_table(kind: type[E], convert: Callable[[object], T]) -> Callable[[object], dict[E, T]]:
    """A converter of a table keyed by names of ``kind``, each value through ``convert``."""

    def table(value: object) -> dict[E, T]:
        if not isinstance(value, Mapping):
            raise _Bad(f"expected a table, got {_kind(value)}")
        return {enum_value(kind, k): convert(v) for k, v in value.items()}

    return table


as_bool = _bool
as_int = _int
as_str = _str
as_float = _float


# Annotation (as written in the signature, ``| None`` removed) -> converter. Anything else
# is code (a clock, a classifier, an event hub): passed as a keyword argument, never read.
_CONVERTERS: dict[str, Callable[[object], Any]] = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "Priority": enum_of(Priority),
    "Collection[str]": _str_list,
    "Sequence[str]": _str_list,
    "Iterable[str]": _str_list,
    "Mapping[Priority, float]": enum_table(Priority, _float),
}


def _annotation(param: inspect.Parameter) -> str:
    ann = param.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    if len(parts) == 1 and parts[0].startswith("Literal["):
        return "str"
    return " | ".join(parts)


class _Tree:
    """What one build shares: its problems and every section read."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.sections: list[Section] = []


class Section(Mapping[str, Any]):
    """One table of the settings, at a dotted ``path``, read by one constructor.

    Keys read are remembered, so `check` can name any key nobody asked for and suggest the
    closest one that was asked for.
    """

    def __init__(self, data: Mapping[str, Any], path: str = "", tree: _Tree | None = None):
        self.data = data
        self.path = path
        self._tree = tree if tree is not None else _Tree()
        self._tree.sections.append(self)
        self._known: set[str] = set()
        self._code: set[str] = set()
        self._short = False
        self._through = False
        self._default_kind: str | None = None

    # Mapping: a section reads as the table it wraps.
    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    @classmethod
    def enter(
        cls, config: Mapping[str, Any], section: str | tuple[str, ...]
    ) -> tuple[Section, bool]:
        """The section at dotted ``section`` (or keys) of ``config`` (``""``: ``config``
        itself), and whether the caller owns the build (``config`` was a plain mapping)."""
        owner = not isinstance(config, Section)
        sec = cls(config, "") if not isinstance(config, Section) else config
        keys = (section.split(".") if section else ()) if isinstance(section, str) else section
        for key in keys:
            sec._through = True  # its other keys are other builds' business
            sec = sec.table(key)
        return sec, owner

    def key(self, key: str) -> str:
        """The full dotted name of ``key`` in this section."""
        return _dotted(self.path, key)

    def problem(self, key: str | None, message: str) -> None:
        where = self.key(key) if key is not None else (self.path or "(top level)")
        self._tree.problems.append(f"{where}: {message}")

    def has(self, key: str) -> bool:
        self._known.add(key)
        return key in self.data

    def read(self, key: str, convert: Callable[[object], T], default: T) -> T:
        """``key`` converted, or ``default`` when absent or wrong (the problem is recorded)."""
        self._known.add(key)
        if key not in self.data:
            return default
        try:
            return convert(self.data[key])
        except _Bad as e:
            self.problem(key, str(e))
            return default

    def table(self, key: str) -> Section:
        """The sub-table ``key`` (empty when absent; a problem when not a table)."""
        self._known.add(key)
        value = self.data.get(key, {})
        if not isinstance(value, Mapping):
            self.problem(key, f"expected a table, got {_kind(value)}")
            value = {}
        return Section(value, self.key(key), self._tree)

    def tables(self, key: str) -> dict[str, Section]:
        """The sub-tables of table ``key``, by name (``[edge.routes."/search"]``)."""
        outer = self.table(key)
        return {name: outer.table(name) for name in list(outer.data)}

    def variant(self, key: str, default: str | None) -> Section | None:
        """The table at ``key`` that says which ``kind`` of thing to build, where a name alone
        is short for ``{kind = name}``; ``default`` when absent (``None``: nothing to build)."""
        self._known.add(key)
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, str):
            short = Section({"kind": value}, self.key(key), self._tree)
            short._short = True
            return short
        if isinstance(value, Mapping):
            table = self.table(key)
            table._default_kind = default  # ``[..limit] initial = 30`` keeps the default kind
            return table
        self.problem(key, f"expected a name or a table, got {_kind(value)}")
        return None

    def kind(self, choices: Mapping[str, T]) -> T | None:
        """The choice named by this table's ``kind`` (``-`` for ``_``, any case)."""
        short = self._short  # ``key = "name"``: the problem is the key's, not ``kind``'s
        name = self.read("kind", _str, self._default_kind or "")
        value = choices.get(name.lower().replace("-", "_"))
        if value is None and not name:
            self.problem("kind", f"missing: one of {', '.join(choices)}")
        elif value is None:
            close = difflib.get_close_matches(name.lower(), list(choices), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            message = f"{name!r} is not one of {', '.join(choices)}{hint}"
            self.problem(None if short else "kind", message)
        if value is None:
            self._through = True  # its other keys are the unknown kind's, not typos
        return value

    def kwargs(
        self,
        fn: Callable[..., Any],
        *,
        skip: tuple[str, ...] = (),
        converters: Mapping[str, Callable[[object], Any]] | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments for ``fn`` found in this section, by its signature."""
        out: dict[str, Any] = {}
        for name, param in inspect.signature(fn).parameters.items():
            if name in skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            ann = _annotation(param)
            convert = (converters or {}).get(name) or _CONVERTERS.get(ann)
            if convert is None:
                self._code.add(name)
                continue
            self._known.add(name)
            if name in self.data:
                try:
                    out[name] = convert(self.data[name])
                except _Bad as e:
                    self.problem(name, str(e))
        return out

    def build(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; its `ValueError` or `TypeError` recorded against this
        section (``None`` then)."""
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            self.problem(None, str(e))
            return None

    def check(self) -> None:
        """Raise `ConfigError` with every problem of the build, unknown keys included."""
        tree = self._tree
        for sec in tree.sections:
            for key in () if sec._through else sec.data:
                if key in sec._known:
                    continue
                if key in sec._code:
                    sec.problem(key, "set in code (a keyword argument), not in settings")
                    continue
                close = difflib.get_close_matches(key, sorted(sec._known), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                sec.problem(key, f"unknown key{hint}")
        if tree.problems:
            problems = list(dict.fromkeys(tree.problems))
            tree.problems.clear()
            raise ConfigError(problems)


def build_in(
    sec: Section,
    cls: Callable[..., T],
    code: Mapping[str, Any],
    *,
    skip: tuple[str, ...] = (),
    converters: Mapping[str, Callable[[object], Any]] | None = None,
    built: Mapping[str, Any] | None = None,
) -> T | None:
    """``cls`` from the keys of ``sec`` its signature takes, with ``built`` (pieces made from
    sub-tables) and ``code`` (wins over both); ``None`` when it could not be built (the
    problem is recorded)."""
    kwargs = sec.kwargs(cls, skip=skip, converters=converters)
    kwargs.update(built or {})
    kwargs.update(code)
    return sec.build(cls, **kwargs)


def from_config(
    config: Mapping[str, Any],
    section: str | tuple[str, ...],
    build: Callable[[Section], T | None],
) -> T:
    """What ``build`` makes of table ``section`` of ``config``; `ConfigError` listing every
    problem otherwise (the one place a build raises)."""
    sec, _ = Section.enter(config, section)
    obj = build(sec)
    sec.check()
    if obj is None:
        raise ConfigError([f"{sec.path or '(top level)'}: could not be built"])
    return obj


def _scalar(text: str) -> Any:
    """An environment value as a TOML value (``30``, ``0.5``, ``true``, ``["/a"]``), or the
    plain string when it is not one (``trusted``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    prefix: str = "BROWNOUT_",
) -> dict[str, Any]:
    """Settings from a TOML file at ``path`` with environment variables merged over it.

    A variable ``{prefix}EDGE__BULKHEAD__LIMIT__INITIAL=30`` sets ``edge.bulkhead.limit.initial``:
    double underscores nest, names are lower-cased, the value is read as a TOML value (a plain
    string when it is not one). Variables without a double underscore are not settings and
    are left alone. ``env`` defaults to `os.environ`; pass ``{}`` to read the file only.
    Raises `ConfigError` for a file that is not TOML, an unknown top-level table or a variable
    that would replace a value by a table.
    """
    problems: list[str] = []
    config: dict[str, Any] = {}
    if path is not None:
        try:
            with Path(path).open("rb") as f:
                config = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{os.fspath(path)}: not valid TOML: {e}"]) from e
    environ = os.environ if env is None else env
    for name in sorted(environ):
        if not name.startswith(prefix) or "__" not in name[len(prefix) :]:
            continue
        parts = name[len(prefix) :].lower().split("__")
        if not all(parts):
            problems.append(f"{name}: empty name between double underscores")
            continue
        table = config
        for i, part in enumerate(parts[:-1]):
            inner = table.setdefault(part, {})
            if not isinstance(inner, dict):
                problems.append(f"{name}: {'.'.join(parts[: i + 1])} is not a table")
                break
            table = inner
        else:
            table[parts[-1]] = _scalar(environ[name])
    for key in config:
        if key not in SECTIONS:
            close = difflib.get_close_matches(key, SECTIONS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{_dotted('', key)}: unknown table{hint}")
        elif not isinstance(config[key], dict):
            problems.append(f"{key}: expected a table, got {_kind(config[key])}")
    if problems:
        raise ConfigError(problems)
    return config
