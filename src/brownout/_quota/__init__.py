"""Per-caller quotas: GCRA in one process or across a fleet on Redis (S2, S5, F1).

See `docs/quotas.md`. `RedisQuotaStore` imports ``redis`` only when built.
"""

from .gcra import GcraOutcome, GcraPolicy, decide
from .memory import InMemoryQuotaStore
from .quota import EdgeQuota, FailurePolicy, Quota, QuotaDecision, policy_window
from .redis import GCRA_SCRIPT, RedisQuotaStore
from .store import QuotaKeyUnusable, QuotaStore, QuotaStoreUnavailable

__all__ = [
    "GCRA_SCRIPT",
    "EdgeQuota",
    "FailurePolicy",
    "GcraOutcome",
    "GcraPolicy",
    "InMemoryQuotaStore",
    "Quota",
    "QuotaDecision",
    "QuotaKeyUnusable",
    "QuotaStore",
    "QuotaStoreUnavailable",
    "RedisQuotaStore",
    "decide",
    "policy_window",
]
