"""brownout._snapshot: copies that a reader thread can take while the loop writes."""

from __future__ import annotations

from typing import Any

from brownout._snapshot import items_of


class ResizedOnce(dict[str, int]):
    """A dict whose first copy is interrupted by a resize, as the loop resizes one when a
    garbage collection during the copy lets it run."""

    copies = 0

    def items(self) -> Any:
        ResizedOnce.copies += 1
        if ResizedOnce.copies == 1:
            self["late"] = 3
            raise RuntimeError("dictionary changed size during iteration")
        return super().items()


def test_a_copy_interrupted_by_a_resize_is_taken_again() -> None:
    # A scrape thread's Stats.snapshot() failed with this RuntimeError (a full-suite run of
    # tests/integration/test_threaded_readers.py) instead of copying again.
    d = ResizedOnce(a=1, b=2)
    assert sorted(items_of(d)) == [("a", 1), ("b", 2), ("late", 3)]
    assert ResizedOnce.copies == 2
