"""Copies of containers the event loop writes while another thread reads them (exporters).

``list(d.items())`` runs in C, but not always without interruption: an allocation during the
copy may start a garbage collection, whose weakref callbacks and finalizers are Python code,
and another thread (the loop) may then run and resize the dict: "dictionary changed size
during iteration" in the reader. Such a copy is simply taken again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["items_of"]

K = TypeVar("K")
V = TypeVar("V")


def items_of(d: Mapping[K, V]) -> list[tuple[K, V]]:
    """``list(d.items())``, taken again if ``d`` changed size while it was copied."""
    while True:
        try:
            return list(d.items())
        except RuntimeError:  # resized by the loop mid-copy (see the module docstring)
            continue
