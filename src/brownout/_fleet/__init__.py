"""A concurrency limit shared by a fleet, on leases with expiry and fencing tokens (B3).

See `docs/fleet-limit.md`. The Redis stores import ``redis`` only when built.
"""

from .decisions import DEADLINE_SHARE, StoreFailurePolicy
from .limit import FleetLease, FleetLimit
from .memory import BlockingInMemoryLeaseStore, InMemoryLeaseStore
from .redis import ACQUIRE_SCRIPT, RENEW_SCRIPT, BlockingRedisLeaseStore, RedisLeaseStore
from .store import (
    BlockingLeaseStore,
    LeaseExpired,
    LeaseGrant,
    LeaseStore,
    LeaseStoreUnavailable,
    LeaseUnfenced,
)
from .threads import ThreadFleetLease, ThreadFleetLimit

__all__ = [
    "ACQUIRE_SCRIPT",
    "DEADLINE_SHARE",
    "RENEW_SCRIPT",
    "BlockingInMemoryLeaseStore",
    "BlockingLeaseStore",
    "BlockingRedisLeaseStore",
    "FleetLease",
    "FleetLimit",
    "InMemoryLeaseStore",
    "LeaseExpired",
    "LeaseGrant",
    "LeaseStore",
    "LeaseStoreUnavailable",
    "LeaseUnfenced",
    "RedisLeaseStore",
    "StoreFailurePolicy",
    "ThreadFleetLease",
    "ThreadFleetLimit",
]
