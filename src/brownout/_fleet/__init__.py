"""A concurrency limit shared by a fleet, on leases with expiry and fencing tokens (B3).

See `docs/fleet-limit.md`. `RedisLeaseStore` imports ``redis`` only when built.
"""

from .limit import DEADLINE_SHARE, FleetLease, FleetLimit, StoreFailurePolicy
from .memory import InMemoryLeaseStore
from .redis import ACQUIRE_SCRIPT, RENEW_SCRIPT, RedisLeaseStore
from .store import LeaseExpired, LeaseGrant, LeaseStore, LeaseStoreUnavailable

__all__ = [
    "ACQUIRE_SCRIPT",
    "DEADLINE_SHARE",
    "RENEW_SCRIPT",
    "FleetLease",
    "FleetLimit",
    "InMemoryLeaseStore",
    "LeaseExpired",
    "LeaseGrant",
    "LeaseStore",
    "LeaseStoreUnavailable",
    "RedisLeaseStore",
    "StoreFailurePolicy",
]
