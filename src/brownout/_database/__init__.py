"""One database path: the pool as admission, statements under the request's budget, commits
whose answer was lost reported as unknown outcomes (driver-independent; adapters in
`brownout.integrations` translate a driver's pool to it)."""

from .keys import IdempotencyTable
from .policy import DatabasePolicy

__all__ = ["DatabasePolicy", "IdempotencyTable"]
