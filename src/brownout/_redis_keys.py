"""Redis Cluster hash tags: which part of a key name picks its slot.

Redis Cluster hashes only the *hash tag* of a key when it has one: the text between the first
``{`` and the first ``}`` after it, when that text is not empty. Keys that one script or one
transaction touches must share a slot, so every store that writes several keys per call
builds their names on one `tagged` prefix.
"""

from __future__ import annotations

__all__ = ["hash_tag", "tagged"]


def hash_tag(name: str) -> str | None:
    """The hash tag of key ``name`` as Redis Cluster reads it, or ``None`` when the whole
    name is hashed (no ``{``, no ``}`` after it, or nothing between them)."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:  # no closing brace, or "{}": the whole name is hashed
        return None
    return name[start + 1 : end]


def tagged(name: str) -> str:
    """``name`` when it carries a hash tag, else ``{name}``: a prefix whose every extension
    (``prefix + anything``) lands in one Cluster slot.

    Raises `ValueError` for a name that cannot carry one (empty, or starting with ``}``).
    """
    if not isinstance(name, str):
        raise TypeError(f"a key prefix must be a string, not {type(name).__name__}")
    if hash_tag(name) is not None:
        return name
    wrapped = "{" + name + "}"
    if hash_tag(wrapped) is None:
        raise ValueError(f"a key prefix must be non-empty and not start with '}}': {name!r}")
    return wrapped
