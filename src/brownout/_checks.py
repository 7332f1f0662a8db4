"""Argument checks shared by constructors: a clear `TypeError` for a value of the wrong type.

Without them a misplaced argument (``CircuitBreaker("inventory")`` when the name was not the
first parameter, or a string where a rate belongs) failed later with a comparison error that
named neither the class nor the parameter.
"""

from __future__ import annotations

import numbers

__all__ = ["name_arg", "number_arg"]


def name_arg(owner: str, name: object) -> str:
    """``name`` if it is a string; else a `TypeError` saying the name comes first."""
    if not isinstance(name, str):
        raise TypeError(
            f"{owner}'s first argument is its name (a str), got {name!r}; "
            "pass the settings by keyword"
        )
    return name


def number_arg(owner: str, field: str, value: object) -> float:
    """``value`` if it is a real number (not a bool); else a `TypeError` naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {field} must be a number, got {value!r}")
    return float(value)
