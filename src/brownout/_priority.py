"""How much a piece of work matters (S3).

Four levels, in the order Google's SRE book and Envoy use: health checks and control traffic
(``CRITICAL_PLUS``) first, then user-facing work (``CRITICAL``), then work that can wait
(``SHEDDABLE_PLUS``: batch with a deadline), then work nobody waits for (``SHEDDABLE``:
analytics, exports, crawlers). A larger value is more important, so ``a > b`` reads naturally.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Priority", "parse_priority"]


class Priority(IntEnum):
    """Importance of a request; lower priorities are shed first."""

    SHEDDABLE = 0
    SHEDDABLE_PLUS = 1
    CRITICAL = 2
    CRITICAL_PLUS = 3

    @property
    def label(self) -> str:
        """Lower-case name used in headers, metrics and logs."""
        return self.name.lower()


_BY_LABEL = {p.label: p for p in Priority} | {p.label.replace("_", "-"): p for p in Priority}


def parse_priority(value: str | bytes | None) -> Priority | None:
    """Parse a priority label (``critical``, ``sheddable-plus``, ...); ``None`` when unknown.

    Never raises: a malformed priority claim is simply not honoured.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return _BY_LABEL.get(value.strip().lower())
