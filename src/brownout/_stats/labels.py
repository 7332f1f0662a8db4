"""Bounded label sets: every label value beyond a cap counts as ``"other"``.

`LabelCap` is first come, first served (for values declared in code: operations, sources);
`TopKLabels` keeps a slot for each of the most active values (for callers), so 100,000
distinct callers cannot grow memory or the metric series count without bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

__all__ = ["OTHER", "LabelCap", "TopKLabels", "label_value"]

OTHER = "other"
"""The label value that stands for every value beyond a cap."""


def label_value(value: str) -> str:
    """``value`` as a capped label shows it: unchanged, except that ``"other"`` and the values
    ``"_other"``, ``"__other"``, ... gain one leading underscore.

    So a real caller (or operation, source) named ``"other"`` shows as ``"_other"`` and is
    never merged with the overflow row `OTHER`; the shift keeps every value distinct.
    """
    if value.endswith(OTHER) and value.lstrip("_") == OTHER:
        return "_" + value
    return value


class LabelCap:
    """Maps label values to themselves until ``max_values`` are known, then to ``"other"``.

    First come, first served: cheap, and right for labels whose values are declared in code
    (operations, sources). For callers prefer `TopKLabels`. A value that would read as the
    overflow label is shown shifted (`label_value`).
    """

    __slots__ = ("_known", "max_values")

    def __init__(self, max_values: int = 100) -> None:
        if not 1 <= max_values < math.inf:  # (NaN too: label sets stay bounded)
            raise ValueError("max_values must be >= 1")
        self.max_values = max_values
        self._known: set[str] = set()

    def __call__(self, value: str, weight: int = 1) -> str:
        value = label_value(value)
        known = self._known
        if value in known:
            return value
        if len(known) < self.max_values:
            known.add(value)
            return value
        return OTHER

    def __len__(self) -> int:
        return len(self._known)

    def values(self) -> frozenset[str]:
        return frozenset(self._known)


class TopKLabels:
    """Keeps a slot for each of the ``max_values`` most active label values; the rest are
    ``"other"``.

    A first-come cap lets whoever showed up first after a restart hold the slots forever, so a
    new heavy caller stays invisible as ``"other"``. Here values beyond the cap are counted in
    a Misra-Gries sketch (bounded, amortized O(1)); every ``epoch`` lookups, candidates that
    clearly out-hit the weakest slot holders (by ``promote_ratio``) take their slots. The
    evicted values are passed to ``on_evict`` so their history can be folded into ``"other"``
    (sums over callers stay monotonic). Activity decays by half each epoch.
    """

    __slots__ = (
        "_candidates",
        "_hits",
        "_max_candidates",
        "_seen",
        "epoch",
        "evictions",
        "max_values",
        "on_evict",
        "promote_ratio",
    )

    def __init__(
        self,
        max_values: int = 100,
        *,
        epoch: int | None = None,
        promote_ratio: float = 2.0,
        on_evict: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        if not 1 <= max_values < math.inf:  # (NaN too: label sets stay bounded)
            raise ValueError("max_values must be >= 1")
        self.max_values = max_values
        self.epoch = epoch if epoch is not None else max(10_000, 100 * max_values)
        self.promote_ratio = promote_ratio
        self.on_evict = on_evict
        self.evictions = 0
        self._hits: dict[str, int] = {}
        self._candidates: dict[str, int] = {}
        self._max_candidates = 4 * max_values
        self._seen = 0

    def __call__(self, value: str, weight: int = 1) -> str:
        """The label for ``value`` (shifted as `label_value` says); ``weight``: how many hits
        this lookup stands for (a tally of several requests is looked up once)."""
        value = label_value(value)
        self._seen += weight
        if self._seen >= self.epoch:
            self._rebalance()
        hits = self._hits
        n = hits.get(value)
        if n is not None:
            hits[value] = n + weight
            return value
        if len(hits) < self.max_values:
            hits[value] = weight
            return value
        cand = self._candidates
        c = cand.get(value)
        if c is not None:
            cand[value] = c + weight
        elif len(cand) < self._max_candidates:
            cand[value] = weight
        else:
            # Misra-Gries: decrement everyone; one-shot values vanish, heavy ones survive.
            self._candidates = {k: v - 1 for k, v in cand.items() if v > 1}
        return OTHER

    def _rebalance(self, activity: Mapping[str, int] | None = None) -> None:
        self._seen = 0
        hits = self._hits
        if activity is not None:  # the owner counted slot holders' activity itself
            for k in hits:
                hits[k] = activity.get(k, 0)
        if self._candidates and len(hits) >= self.max_values:
            challengers = sorted(self._candidates.items(), key=lambda kv: kv[1], reverse=True)
            holders = sorted(hits.items(), key=lambda kv: kv[1])
            budget = max(1, self.max_values // 10)  # bounded churn per epoch
            evicted: set[str] = set()
            for (value, count), (weak, weak_hits) in zip(challengers[:budget], holders):
                if count <= self.promote_ratio * max(weak_hits, 1):
                    break
                del hits[weak]
                hits[value] = count
                evicted.add(weak)
            if evicted:
                self.evictions += len(evicted)
                if self.on_evict is not None:
                    self.on_evict(frozenset(evicted))
        for k in hits:
            hits[k] //= 2
        self._candidates = {}

    def __len__(self) -> int:
        return len(self._hits)

    def values(self) -> frozenset[str]:
        return frozenset(self._hits)
