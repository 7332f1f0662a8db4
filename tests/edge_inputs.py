"""Generated inbound requests for the edge, and what the edge must make of them, shared by
the ASGI (in-process) and aiohttp (loopback) input tests (D3, S2, S4; bad input).

A request is a path and a list of headers: budget, signed-budget, priority, Envoy, attempt
and idempotency headers with valid, near-valid and random values, repeated or not, in any
letter case, beside other headers. `judge` states what the edge may answer, from the
reference parsers (`InboundDeadlinePolicy.resolve`, `parse_priority`) rather than from the
edge's own fast paths, so the tests are differential.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route as StarletteRoute

import brownout
from brownout import (
    BudgetSigner,
    Bulkhead,
    EdgePolicy,
    InboundDeadlinePolicy,
    Priority,
    Route,
    Stats,
    Trust,
)
from brownout._edge import Repeated
from brownout.events import EventHub
from brownout.integrations.aiohttp_server import brownout_middleware
from brownout.integrations.asgi import BrownoutMiddleware
from brownout.limits import FixedLimit
from brownout.wire import (
    ATTEMPT_HEADER,
    BUDGET_HEADER,
    ENVOY_TIMEOUT_HEADER,
    IDEMPOTENCY_HEADER,
    PRIORITY_HEADER,
    SIGNED_BUDGET_HEADER,
    parse_priority,
)

SIGNER = BudgetSigner({"k1": b"0123456789abcdef0123456789abcdef"})
TEMPLATE = "/items/{id}"
DEFAULT, MAXIMUM = 1.5, 5.0
ROUTE_PRIORITY = Priority.SHEDDABLE_PLUS
MAX_CLAIMED = Priority.CRITICAL
SLACK = 2.0
"""How much of its budget a request may have spent before the handler reads it (the machine
is shared: generous)."""

NAMES = [
    BUDGET_HEADER,
    SIGNED_BUDGET_HEADER,
    PRIORITY_HEADER,
    ENVOY_TIMEOUT_HEADER,
    ATTEMPT_HEADER,
    IDEMPOTENCY_HEADER,
    "grpc-timeout",
]
NEAR_VALID = [
    b"0", b"1", b"150", b"4999", b"5000", b"5001", b"60000", b"-1", b"+150", b"1e3", b"1.5",
    b"nan", b"inf", b" 150 ", b"150\x00", b"99999999999999999999999999", b"", b"critical",
    b"CRITICAL_PLUS", b"critical-plus", b"sheddable", b" Sheddable-Plus ", b"\xff\xfe",
    b"v1.k1.150.0.AAAA", b"v1.nokey.150.0.AAAA",
]  # fmt: skip

Headers = list[tuple[bytes, bytes]]


def examples(n: int) -> settings:
    """Hypothesis settings for ``n`` examples of requests: no per-example deadline (a shared
    machine), and no complaint about slow or large examples (each is real I/O)."""
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@dataclass
class Edge:
    """An app behind the edge, its policy and bulkhead, and what its handler saw."""

    app: Any
    policy: EdgePolicy
    bulkhead: Any
    seen: list[tuple[float | None, Priority]] = field(default_factory=list)


CONFIGS = [(t, b, lis) for t in Trust for b in (True, False) for lis in (True, False)]
"""Every edge configuration under test: (trust, with a bulkhead, with a listener)."""


def edge_policy(
    trust: Trust, with_bulkhead: bool, listening: bool, template: str = TEMPLATE
) -> EdgePolicy:
    """The policy under test: one route (``template``) with its own default, maximum and
    priority; a signer for signed budgets; a bulkhead with room to spare, or none."""
    hub = EventHub()
    if listening:
        hub.subscribe(Stats())
    return EdgePolicy(
        bulkhead=Bulkhead("api", FixedLimit(4), events=hub) if with_bulkhead else None,
        deadline=InboundDeadlinePolicy(signer=SIGNER, events=hub),
        trust=trust,
        routes={template: Route(default=DEFAULT, maximum=MAXIMUM, priority=ROUTE_PRIORITY)},
        max_claimed_priority=MAX_CLAIMED,
        events=hub,
    )


def starlette_edge(policy: EdgePolicy, path_cache_size: int = 1024) -> Edge:
    """A Starlette app with one route behind `BrownoutMiddleware`."""
    edge = Edge(None, policy, policy.bulkhead)

    async def item(request: Request) -> PlainTextResponse:
        ctx = brownout.current()
        edge.seen.append((ctx.remaining(), ctx.priority))
        return PlainTextResponse("ok")

    app = Starlette(routes=[StarletteRoute(TEMPLATE, item)])
    app.add_middleware(BrownoutMiddleware, policy=policy, path_cache_size=path_cache_size)
    edge.app = app
    return edge


def aiohttp_edge(policy: EdgePolicy) -> Edge:
    """An aiohttp application with one route behind `brownout_middleware`."""
    edge = Edge(None, policy, policy.bulkhead)

    async def item(request: web.Request) -> web.Response:
        ctx = brownout.current()
        edge.seen.append((ctx.remaining(), ctx.priority))
        return web.Response(text="ok")

    app = web.Application(middlewares=[brownout_middleware(policy)])
    app.router.add_get(TEMPLATE, item)
    edge.app = app
    return edge


def asgi_scope(path: str, headers: Headers) -> dict[str, Any]:
    """An HTTP/1.1 GET scope as an ASGI server makes it (a ``host`` header first)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "surrogateescape"),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"edge"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def signed() -> st.SearchStrategy[bytes]:
    # Signed at draw time, so fresh: the verifier's replay window is 5 s.
    return st.floats(min_value=0.0, max_value=100.0).map(lambda s: SIGNER.sign(s).encode())


_numbers = st.one_of(
    st.integers(min_value=-5, max_value=100_000),
    st.sampled_from([0, 1, 1499, 1500, 1501, 4999, 5000, 5001, 60_000, 10**9]),
).map(lambda n: str(n).encode())
"""Budgets in milliseconds: any, and those around the route's default and maximum (hypothesis
favours small integers on its own)."""


def _any_case(name: str) -> st.SearchStrategy[bytes]:
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(name, upper)).encode()
    )


_labels = st.sampled_from(
    [p.label for p in Priority]
    + [p.label.replace("_", "-") for p in Priority]
    + [" Critical ", "SHEDDABLE", "critical plus", "urgent", "2"]
).map(str.encode)
"""Priority claims: every label as headers spell it, and near misses."""


def header_lists(*, wire: bool) -> st.SearchStrategy[Headers]:
    """Header lists as an ASGI server hands them over (``wire=False``: lower-case names, any
    bytes as values) or as an HTTP client can send them (``wire=True``: names in any case,
    values of visible ASCII). Each header mostly carries a value of its own kind (a budget,
    a priority label, a signed budget), sometimes junk or another header's value."""
    if wire:
        visible = [
            v for v in NEAR_VALID if v and v.isascii() and v == v.strip() and b"\x00" not in v
        ]
        junk = st.one_of(
            st.sampled_from(visible),
            st.text(
                alphabet=string.ascii_letters + string.digits + "-_.+=/ ", min_size=1, max_size=30
            )
            .map(str.strip)
            .filter(bool)
            .map(str.encode),
        )

        def named(*names: str) -> st.SearchStrategy[bytes]:
            return st.sampled_from(names).flatmap(_any_case)

        other = st.tuples(
            st.text(alphabet=string.ascii_lowercase + "-", min_size=1, max_size=12)
            .filter(lambda n: n.strip("-") == n)
            .map(lambda n: ("x-" + n).encode()),
            st.text(alphabet=string.ascii_letters + string.digits, min_size=1, max_size=20).map(
                str.encode
            ),
        )
    else:
        junk = st.one_of(st.sampled_from(NEAR_VALID), st.binary(max_size=40))

        def named(*names: str) -> st.SearchStrategy[bytes]:
            return st.sampled_from(names).map(str.encode)

        other = st.tuples(
            st.binary(min_size=1, max_size=12).map(bytes.lower), st.binary(max_size=20)
        )
    any_value = st.one_of(junk, _numbers, _labels, signed())
    claimed = st.one_of(
        st.tuples(
            named(BUDGET_HEADER, ENVOY_TIMEOUT_HEADER, "grpc-timeout"),
            st.one_of(_numbers, _numbers, junk),
        ),
        st.tuples(named(PRIORITY_HEADER), st.one_of(_labels, _labels, junk)),
        st.tuples(named(SIGNED_BUDGET_HEADER), st.one_of(signed(), signed(), junk)),
        st.tuples(named(*NAMES), any_value),
    )
    return st.lists(st.one_of(claimed, claimed, other), max_size=6)


# Path segments without "/" so a generated "/items/<segment>" matches the route.
_segment = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/"),
    min_size=1,
    max_size=12,
)
paths = st.one_of(
    st.just("/items/7"),
    _segment.map(lambda s: "/items/" + s),
    _segment.map(lambda s: "/" + s),
    st.text(max_size=20).map(lambda s: "/" + s),
)
url_paths = st.one_of(
    st.just("/items/7"),
    st.just("/items/7"),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.~", min_size=1, max_size=12)
    .filter(lambda s: s not in {".", ".."})
    .map(lambda s: "/items/" + s),
    st.text(alphabet=string.ascii_letters + string.digits + "-_~/", max_size=16).map(
        lambda s: "/" + s
    ),
)


def values(headers: Headers, name: str) -> list[bytes]:
    """Every value of header ``name`` (case-insensitive), in order."""
    key = name.encode().lower()
    return [v for k, v in headers if k.lower() == key]


def lookup(headers: Headers, name: str) -> bytes | Repeated | None:
    """Header ``name`` as the edge reads it: none, its one value (or several equal ones), or
    the distinct values of a header repeated with different values (issue 24)."""
    found = list(dict.fromkeys(values(headers, name)))
    if not found:
        return None
    return found[0] if len(found) == 1 else Repeated(found)


def single(headers: Headers, name: str) -> bytes | None:
    """The value of header ``name`` when it has one (a priority claim: several differing
    claims are none)."""
    found = lookup(headers, name)
    return None if isinstance(found, Repeated) else found


def matches_the_route(path: str) -> bool:
    rest = path.removeprefix("/items/")
    return rest != path and rest != "" and "/" not in rest


@dataclass
class Answer:
    """What came back for one request, and what the handler saw if it ran."""

    status: int
    content_type: str
    body: bytes
    ran: bool
    remaining: float | None = None
    priority: Priority | None = None


def expected_budget(
    policy: EdgePolicy,
    trust: Trust,
    headers: Headers,
    template: str = TEMPLATE,
    carried: float | None = None,
) -> float:
    """The budget the reference parser gives these headers (and the protocol's own deadline,
    ``carried``) from this source."""
    deadline: InboundDeadlinePolicy = policy.route(template).deadline
    return deadline.resolve(lambda name: lookup(headers, name), trust, carried).seconds


def judge_seen(
    trust: Trust,
    headers: Headers,
    expected: float,
    remaining: float | None,
    priority: Priority | None,
    rounding: float = 0.0,
) -> None:
    """Assert what the handler saw: the expected deadline (less what the trip to the handler
    took; more by at most ``rounding``, what the protocol adds on the wire), never past the
    route maximum; and a priority claim only from a trusted source."""
    assert remaining is not None
    assert 0.0 <= remaining <= min(expected + rounding, MAXIMUM), (remaining, expected)
    assert remaining > expected - SLACK
    claim = parse_priority(single(headers, PRIORITY_HEADER))
    if trust is Trust.TRUSTED and claim is not None:
        assert priority == min(claim, MAX_CLAIMED)
    else:
        assert priority == ROUTE_PRIORITY  # a claim from elsewhere is ignored (S4)


def judge(policy: EdgePolicy, trust: Trust, path: str, headers: Headers, answer: Answer) -> None:
    """Assert what the edge must have made of this HTTP request on an idle service."""
    expected = expected_budget(policy, trust, headers)
    if answer.ran:
        assert answer.status == 200
        assert matches_the_route(path)
        judge_seen(trust, headers, expected, answer.remaining, answer.priority)
    elif answer.status == 404:
        assert not matches_the_route(path)
    else:
        # The only refusals an idle service gives: a deadline that passed before the answer (a
        # budget spent on arrival, or one too short for the trip to the handler), or one the
        # bulkhead's latency estimate says cannot cover the work (D7: on a slow machine the
        # estimate of even this trivial handler can exceed a budget of a few milliseconds).
        assert expected < SLACK, (answer.status, expected)
        assert answer.content_type == "application/problem+json"
        problem = json.loads(answer.body)
        assert problem["status"] == answer.status and problem["reason"]
        assert answer.status == policy.expired_status or (
            answer.status == 503 and problem["reason"] == "deadline_too_short"
        ), (answer.status, problem["reason"], expected)
