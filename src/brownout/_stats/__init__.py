"""Observability's in-memory side: the `Stats` sink, bounded labels, histograms and gauges.

- `sink`: `Stats`, the event sink that counts every decision;
- `labels`: the label caps that keep series bounded (`LabelCap`, `TopKLabels`);
- `gauges`: live state pulled at read time (`Observable`, `Gauge`);
- `LatencyHistogram` lives in `brownout._histogram` (the queues use it too) and is named here.
"""

from .._histogram import LatencyHistogram
from .gauges import BREAKER_STATES, GAUGE_KINDS, Gauge, GaugeFn, Observable
from .labels import OTHER, LabelCap, TopKLabels, label_value
from .sink import COUNTER_KINDS, Key, Row, Stats

__all__ = [
    "BREAKER_STATES",
    "COUNTER_KINDS",
    "GAUGE_KINDS",
    "OTHER",
    "Gauge",
    "GaugeFn",
    "Key",
    "LabelCap",
    "LatencyHistogram",
    "Observable",
    "Row",
    "Stats",
    "TopKLabels",
    "label_value",
]
