"""Retry budgets: cap extra attempts as a share of original traffic (R3).

Two rules are offered behind one small protocol, `RetryAllowance`:

* `RetryBudget` (the Finagle / tower "TPS budget"): over a sliding window, every original
  request that was tried (not refused locally) deposits a token and every retry withdraws
  ``1 / ratio`` tokens, on top of a fixed
  reserve of ``min_per_second * window`` retries. So within any window::

      retries <= ratio * originals + min_per_second * window

  Steady state: with ``r`` originals per second of which a fraction ``f`` fail, retries want
  ``f * r * (attempts - 1)`` per second but get at most ``ratio * r + min_per_second``. The
  load on the dependency is therefore bounded by ``(1 + ratio) * r + min_per_second`` however
  bad the failure rate gets (with ratio 0.1: +10%, instead of x3 for 3 naive attempts). The
  minimum keeps low-traffic clients able to retry at all.
* `GrpcRetryThrottle`: gRPC's ``retryThrottling`` (gRFC A6): ``token_count`` starts at
  ``max_tokens``; every failed attempt takes 1, every success adds ``token_ratio`` (clamped to
  ``[0, max_tokens]``); retries are allowed only while ``token_count > max_tokens / 2``. Tokens
  are kept in thousandths, as gRPC does (``token_ratio`` has 3 decimals).

When a budget refuses, the policy gives up and surfaces the original error; it never waits for
tokens.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .._clock import Clock, default_clock
from .._settings import build_in, from_config
from .window import SlidingCounters

__all__ = ["GrpcRetryThrottle", "RetryAllowance", "RetryBudget"]


@runtime_checkable
class RetryAllowance(Protocol):
    """What a retry policy asks before each retry, and tells after each attempt."""

    def record_request(self) -> None:
        """An original (first-attempt) request is being sent."""
        ...

    def record_success(self) -> None:
        """An attempt succeeded (or failed in a way that says the dependency is healthy)."""
        ...

    def record_failure(self) -> None:
        """An attempt failed with a retryable error, or with "do not retry" pushback."""
        ...

    def try_acquire_retry(self) -> bool:
        """May one more retry be sent now? Takes what the retry costs when it says yes."""
        ...


_SCALE = 1000  # tokens are kept in thousandths so any ratio in [0.001, 1000] is exact enough


def _whole(x: float) -> int:
    """``floor(x)``, but a product a rounding short of a whole number is that number
    (``0.29 * 100`` is 28.999999999999996: a reserve of 29 retries, not 28)."""
    n = round(x)
    return n if abs(x - n) <= 1e-9 * max(1.0, x) else math.floor(x)


class RetryBudget:
    """At most ``ratio`` x originals + ``min_per_second`` x ``window`` retries per window.

    Shared by every call to one dependency (one budget per downstream, not per call). The
    window is ``window`` seconds in ``buckets`` slices on an injected clock.
    """

    __slots__ = (
        "_counters",
        "_deposit",
        "_lock",
        "_reserve",
        "_withdraw",
        "min_per_second",
        "ratio",
    )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, section: str = "retry.budget", **code: Any
    ) -> RetryBudget:
        """The budget described by table ``section`` of ``config`` (`brownout.load_config`);
        the clock is a keyword argument. Raises `ConfigError`."""
        return from_config(config, section, lambda sec: build_in(sec, cls, code))

    def __init__(
        self,
        ratio: float = 0.1,
        *,
        min_per_second: float = 10.0,
        window: float = 10.0,
        buckets: int = 10,
        clock: Clock | None = None,
    ) -> None:
        if not (0.0 <= ratio <= 1000.0) or math.isnan(ratio):
            raise ValueError("ratio must be within [0, 1000]")
        if not 0 <= min_per_second < math.inf:  # (NaN too; inf would overflow an int)
            raise ValueError("min_per_second must be finite and >= 0")
        if not 0 < window < math.inf:
            raise ValueError("window must be finite and > 0")
        self.ratio = ratio
        self.min_per_second = min_per_second
        if ratio == 0.0:
            # Only the reserve can pay: originals earn nothing, a retry costs one unit.
            self._deposit = 0
            self._withdraw = 1
        else:
            self._deposit = _SCALE
            self._withdraw = max(1, int(_SCALE / ratio))
        self._reserve = _whole(min_per_second * window) * self._withdraw
        self._counters = SlidingCounters(
            1, window=window, buckets=buckets, clock=clock or default_clock()
        )
        # Threads calling through one blocking Dependency share it: check-and-take is atomic.
        self._lock = threading.Lock()

    @property
    def window(self) -> float:
        return self._counters.window

    def record_request(self) -> None:
        if self._deposit:
            # acquire/release, not ``with``: half the price, on every call's success path.
            lock = self._lock
            lock.acquire()
            try:
                self._counters.add(0, self._deposit)
            finally:
                lock.release()

    def record_success(self) -> None:
        pass

    def record_failure(self) -> None:
        pass

    def try_acquire_retry(self) -> bool:
        with self._lock:
            balance = self._counters.sums()[0] + self._reserve
            if balance >= self._withdraw:
                self._counters.add(0, -self._withdraw)
                return True
            return False

    def available(self) -> int:
        """How many retries the budget would allow right now (for metrics and tests)."""
        with self._lock:
            return max(0, (self._counters.sums()[0] + self._reserve) // self._withdraw)

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self.ratio}, min_per_second={self.min_per_second}, "
            f"window={self.window}, available={self.available()})"
        )


class GrpcRetryThrottle:
    """gRPC ``retryThrottling`` (gRFC A6), for parity with grpc clients' built-in behaviour.

    Unlike `RetryBudget`, every attempt's result counts (not just originals), and a retry costs
    nothing up front: its own failure will take a token like any other.
    """

    __slots__ = ("_lock", "_max", "_ratio", "_tokens")

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if not (0 < max_tokens < math.inf and 0 < token_ratio < math.inf):  # NaN, inf too
            raise ValueError("max_tokens and token_ratio must be finite and > 0")
        self._max = round(max_tokens * _SCALE)
        self._ratio = int(token_ratio * _SCALE + 1e-9)  # gRPC keeps 3 decimals
        self._tokens = self._max
        self._lock = threading.Lock()  # updates from many threads must not be lost

    @property
    def max_tokens(self) -> float:
        return self._max / _SCALE

    @property
    def tokens(self) -> float:
        """The current ``token_count``."""
        return self._tokens / _SCALE

    @property
    def retry_allowed(self) -> bool:
        """``token_count > max_tokens / 2``."""
        return 2 * self._tokens > self._max

    def record_request(self) -> None:
        pass

    def record_success(self) -> None:
        with self._lock:
            self._tokens = min(self._max, self._tokens + self._ratio)

    def record_failure(self) -> None:
        with self._lock:
            self._tokens = max(0, self._tokens - _SCALE)

    def try_acquire_retry(self) -> bool:
        return 2 * self._tokens > self._max

    def __repr__(self) -> str:
        return f"GrpcRetryThrottle(max_tokens={self.max_tokens}, tokens={self.tokens})"
