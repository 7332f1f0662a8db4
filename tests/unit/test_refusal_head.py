"""The ASGI refusal's head and the refusal object, built from cached parts, are byte for byte
what building them afresh gives (S2: problem body, Retry-After, do-not-retry, degraded,
RateLimit headers)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest

from brownout import EdgePolicy, Reason
from brownout._edge import Refusal, problem_body, ratelimit_headers, retry_after_window
from brownout.integrations._asgi_exchange import refusal_head
from brownout.wire import DO_NOT_RETRY_VALUE, RETRY_HEADER


def fresh_head(refusal: Refusal) -> list[tuple[bytes, bytes]]:
    """The refusal head as the middleware built it per refusal before it cached its parts."""
    body = refusal.body
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    ra = refusal.retry_after
    if ra is not None:
        whole = refusal.retry_after_whole  # the policy's draw (issue 24), else the old rule
        if whole is None:
            floor = math.ceil(refusal.estimate) if refusal.estimate is not None else 1
            whole = max(1, floor, round(ra))
        headers.append((b"retry-after", str(whole).encode()))
    if refusal.do_not_retry:
        headers.append((RETRY_HEADER.encode(), DO_NOT_RETRY_VALUE.encode()))
    if refusal.degraded:
        headers.append((b"brownout-degraded", ", ".join(refusal.degraded).encode()))
    if refusal.quota is not None:
        headers.extend(
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in ratelimit_headers(refusal.quota).items()
        )
    return headers


@dataclass
class Decision:
    allowed: bool = False
    retry_after: float | None = 3.0
    limit: int | None = 10
    remaining: int | None = 0
    reset: float | None = 2.5


class Modes:
    def __init__(self, *names: str) -> None:
        self.names = names

    def active_names(self) -> tuple[str, ...]:
        return self.names


RETRY_AFTERS = [None, 0.0, 0.2, 0.5, 1.49, 1.5, 2.5, 7.0, 119.6, 120.4, 121.0, 3600.2]


@pytest.mark.parametrize("reason", list(Reason))
@pytest.mark.parametrize("degraded", [(), ("recommendations",), ("a", "b")])
def test_refusal_head_equals_the_freshly_built_one(
    reason: Reason, degraded: tuple[str, ...]
) -> None:
    policy = EdgePolicy(degraded=Modes(*degraded) if degraded else None)
    for ra in RETRY_AFTERS:
        for quota in (None, Decision()):
            refusal = policy.refusal(reason, ra, quota=quota)
            head = refusal_head(refusal)
            assert head == fresh_head(refusal)
            assert head is not refusal_head(refusal)  # a list of its own to each response
            seconds = refusal.retry_after_seconds()
            assert refusal.retry_after_header() == (None if seconds is None else str(seconds))


@pytest.mark.parametrize("estimate", [None, 0.0, 0.3, 1.0, 2.2, 130.0])
def test_retry_after_seconds_is_max_of_one_the_estimate_rounded_up_and_the_value(
    estimate: float | None,
) -> None:
    for ra in RETRY_AFTERS:
        r = Refusal(503, Reason.QUEUE_FULL, b"{}", ra, False, (), None, estimate)
        floor = math.ceil(estimate) if estimate is not None else 1
        expected = None if ra is None else max(1, floor, round(ra))
        assert r.retry_after_seconds() == expected


def test_refusal_with_an_estimate_is_the_base_with_those_fields_replaced() -> None:
    policy = EdgePolicy(degraded=Modes("recommendations"), rng=random.Random(7))
    twin = EdgePolicy(degraded=Modes("recommendations"), rng=random.Random(7))
    for reason in Reason:
        quota: Any = Decision()
        got = policy.refusal(reason, 2.0, quota=quota)
        base = twin._refusals[reason]
        estimate = None if base.do_not_retry else 2.0
        u = None if estimate is None else twin.rng.random()
        jittered = (
            None
            if estimate is None or u is None
            else estimate * (1.0 + twin.retry_after_jitter * u)
        )
        whole = (
            None
            if estimate is None or u is None
            else retry_after_window(estimate, twin.retry_after_jitter, u)
        )
        body = problem_body(
            reason, base.status, degraded=("recommendations",), do_not_retry=base.do_not_retry
        )
        assert got == base._replace(
            body=body,
            retry_after=jittered,
            degraded=("recommendations",),
            quota=quota,
            estimate=estimate,
            retry_after_whole=whole,
        )
        assert type(got) is Refusal
