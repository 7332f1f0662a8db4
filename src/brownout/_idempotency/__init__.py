"""The server half of idempotency keys: replay instead of redo (I2).

`Idempotency` decides; the stores keep keys, leases and answers (`InMemoryIdempotencyStore`,
`RedisIdempotencyStore`, `PostgresIdempotencyStore`); adapters in ``brownout.integrations``
translate for ASGI, aiohttp and grpc.aio.
"""

from .layer import (
    IDEMPOTENCY_KEY_HEADER,
    OFF,
    REPLAYED_HEADER,
    Idempotency,
    IdempotencyRule,
    IdempotentAnswer,
    NoTransaction,
    OutagePolicy,
    Ticket,
    transaction,
)
from .memory import InMemoryIdempotencyStore
from .model import (
    MAX_KEY_LENGTH,
    Claim,
    ClaimState,
    IdempotencyKeyInvalid,
    IdempotencyStore,
    IdempotencyStoreUnavailable,
    StoredResponse,
    fingerprint,
    parse_key,
    store_key,
)
from .postgres import PostgresIdempotencyStore
from .redis import RedisIdempotencyStore

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "MAX_KEY_LENGTH",
    "OFF",
    "REPLAYED_HEADER",
    "Claim",
    "ClaimState",
    "Idempotency",
    "IdempotencyKeyInvalid",
    "IdempotencyRule",
    "IdempotencyStore",
    "IdempotencyStoreUnavailable",
    "IdempotentAnswer",
    "InMemoryIdempotencyStore",
    "NoTransaction",
    "OutagePolicy",
    "PostgresIdempotencyStore",
    "RedisIdempotencyStore",
    "StoredResponse",
    "Ticket",
    "fingerprint",
    "parse_key",
    "store_key",
    "transaction",
]
