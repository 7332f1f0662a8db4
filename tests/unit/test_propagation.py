"""Propagation codecs and the inbound policy (D2, D3): exact to spec, never raising into apps."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import brownout
import brownout.events
from brownout import (
    BudgetSigner,
    Deadline,
    HeaderError,
    InboundDeadlinePolicy,
    Priority,
    Stats,
    Trust,
)
from brownout.events import DeadlineHeaderIgnored, EventHub
from brownout.testing import ManualClock
from brownout.wire import (
    BUDGET_HEADER,
    ENVOY_TIMEOUT_HEADER,
    SIGNED_BUDGET_HEADER,
    decode_budget_ms,
    decode_grpc_timeout,
    encode_budget_ms,
    encode_grpc_timeout,
    outbound_headers,
)

# -- grpc-timeout ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1H", 3600),
        ("2M", 120),
        ("3S", 3),
        ("250m", 0.25),
        ("7u", 7e-6),
        ("99999999n", 0.099999999),
    ],
)
def test_grpc_timeout_decodes_every_unit(value: str, seconds: float) -> None:
    assert decode_grpc_timeout(value) == pytest.approx(seconds)
    assert decode_grpc_timeout(value.encode()) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "bad",
    ["", "1", "S", "123456789S", "-1S", "1.5S", "1s", "1 S", " 1S", "1S\n", "١S", "1h", "0x1S"],
)
def test_grpc_timeout_rejects_off_spec_values(bad: str) -> None:
    with pytest.raises(HeaderError):
        decode_grpc_timeout(bad)


def test_grpc_timeout_encode_picks_the_finest_unit_that_fits() -> None:
    assert encode_grpc_timeout(0.05) == "50000000n"
    assert encode_grpc_timeout(1.2) == "1200000u"
    assert encode_grpc_timeout(150.0) == "150000m"
    assert encode_grpc_timeout(1e6) == "1000000S"
    assert encode_grpc_timeout(0) == "0n"
    assert encode_grpc_timeout(-3) == "0n"
    assert encode_grpc_timeout(float("inf")) == "99999999H"


@settings(max_examples=2000, deadline=None)
@given(st.floats(min_value=1e-9, max_value=3.6e11, allow_nan=False))
def test_grpc_timeout_round_trip_never_extends(seconds: float) -> None:
    encoded = encode_grpc_timeout(seconds)
    assert 2 <= len(encoded) <= 9
    decoded = decode_grpc_timeout(encoded)
    assert decoded <= seconds * (1 + 1e-12)
    # The finest unit that fits keeps at least 10^5 steps (units are 1000x apart at most).
    assert decoded >= seconds * (1 - 1e-5) - 1e-9


# -- integer milliseconds ---------------------------------------------------------------------


def test_budget_ms_codec() -> None:
    assert encode_budget_ms(1.2345) == "1234"
    assert encode_budget_ms(-1) == "0"
    assert decode_budget_ms("1234") == pytest.approx(1.234)
    assert decode_budget_ms(b" 50 ") == pytest.approx(0.05)
    for bad in ["", "-5", "1.5", "1e3", "abc", "9" * 13, "١٢"]:
        with pytest.raises(HeaderError):
            decode_budget_ms(bad)


@settings(max_examples=2000, deadline=None)
@given(st.integers(min_value=0, max_value=10**12 - 1))
def test_budget_ms_round_trip(ms: int) -> None:
    assert encode_budget_ms(decode_budget_ms(str(ms))) == str(ms)


# -- signed budgets ---------------------------------------------------------------------------

KEY = b"s3cret-key-of-at-least-16-bytes"


def signer(now: list[float], **keys: bytes) -> BudgetSigner:
    return BudgetSigner(keys or {"k1": KEY}, skew_tolerance=5.0, wall_clock=lambda: now[0])


def test_signed_budget_round_trip_and_rotation() -> None:
    now = [1_800_000_000.0]
    old = signer(now, k1=KEY)
    value = old.sign(1.5)
    assert old.verify(value) == 1.5
    rotated = signer(now, k2=b"another-secret-key-123", k1=KEY)  # new key first, old still verifies
    assert rotated.verify(value) == 1.5
    assert rotated.verify(rotated.sign(0.25)) == 0.25
    retired = signer(now, k2=b"another-secret-key-123")
    with pytest.raises(HeaderError, match="unknown signing key"):
        retired.verify(value)


def test_signed_budget_rejects_tampering_and_replay() -> None:
    now = [1_800_000_000.0]
    s = signer(now)
    value = s.sign(1.5)
    parts = value.split(".")
    tampered = ".".join([*parts[:2], "60000", *parts[3:]])
    with pytest.raises(HeaderError, match="bad signature"):
        s.verify(tampered)
    now[0] += 6.0  # beyond the skew tolerance: a replayed header is refused
    with pytest.raises(HeaderError, match="replay"):
        s.verify(value)


_B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _signed_with(chars: str) -> tuple[BudgetSigner, str]:
    """A signer and a value of it whose MAC contains one of ``chars``."""
    now = [1_800_000_000.0]
    s = signer(now)
    for ms in range(1, 10_000):
        value = s.sign(ms / 1000)
        if any(c in value.rsplit(".", 1)[1] for c in chars):
            return s, value
    raise AssertionError("unreachable")  # pragma: no cover


def test_a_mac_with_junk_appended_is_refused() -> None:
    s, value = _signed_with(_B64URL)
    for junk in ["!", "*", " ", "~", "!!!!", "=", "==", "\t", "%"]:
        with pytest.raises(HeaderError):
            s.verify(value + junk)
        with pytest.raises(HeaderError):
            s.verify(value[:-3] + junk + value[-3:])
    for junk in [b"\xff", b"\x80\x80", b"\x00"]:
        with pytest.raises(HeaderError):
            s.verify(value.encode() + junk)


def test_a_mac_in_standard_base64_is_refused() -> None:
    s, value = _signed_with("-_")
    head, mac = value.rsplit(".", 1)
    std = mac.replace("-", "+").replace("_", "/")
    assert std != mac
    with pytest.raises(HeaderError):
        s.verify(f"{head}.{std}")


def test_a_mac_with_other_trailing_bits_is_refused() -> None:
    """32 bytes are 43 characters; the last carries 4 bits and 2 zero bits. A character with
    the same 4 bits and other zero bits decodes to the same MAC: it must not verify."""
    s, value = _signed_with(_B64URL)
    head, mac = value.rsplit(".", 1)
    last = _B64URL.index(mac[-1])
    for low in (1, 2, 3):
        twin = mac[:-1] + _B64URL[last ^ low]
        with pytest.raises(HeaderError):
            s.verify(f"{head}.{twin}")


_VALID = _signed_with(_B64URL)
_VALID_V2 = (
    BudgetSigner({"k1": KEY}, audience="svc-a", wall_clock=lambda: 1_800_000_000.0),
    BudgetSigner({"k1": KEY}, wall_clock=lambda: 1_800_000_000.0).for_audience("svc-a").sign(1.5),
)


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "replace", "delete", "append"]),
            st.integers(min_value=0, max_value=200),
            st.binary(min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_any_mutation_of_a_signed_budget_fails_verification(
    edits: list[tuple[str, int, bytes]], v2: bool
) -> None:
    s, value = _VALID_V2 if v2 else _VALID
    raw = bytearray(value.encode())
    for op, at, data in edits:
        at %= len(raw) + 1
        if op == "insert":
            raw[at:at] = data
        elif op == "replace":
            raw[at : at + len(data)] = data
        elif op == "delete" and len(raw) > 1:
            del raw[at : at + len(data)]
        else:
            raw += data
    if bytes(raw) == value.encode():
        return
    with pytest.raises(HeaderError):
        s.verify(bytes(raw))


# -- signed budgets bind their audience (v2) ---------------------------------------------------

OTHER_KEY = b"another-secret-key-123"


def bound(now: list[float], audience: str | None, **keys: bytes) -> BudgetSigner:
    return BudgetSigner(
        keys or {"k1": KEY}, audience=audience, skew_tolerance=5.0, wall_clock=lambda: now[0]
    )


def test_a_budget_signed_for_one_service_is_refused_at_another_sharing_the_key() -> None:
    now = [1_800_000_000.0]
    at_a, at_b = bound(now, "svc-a"), bound(now, "svc-b")
    sender = bound(now, None).for_audience("svc-a")  # the caller signs for its callee
    value = sender.sign(1.5)
    assert value.startswith("v2.k1.svc-a.1500.")
    assert at_a.verify(value) == 1.5
    with pytest.raises(HeaderError, match="audience") as refused:
        at_b.verify(value)
    assert refused.value.problem == "wrong audience"
    assert at_b.verify(at_b.sign(0.5)) == 0.5  # signing with a receiver's signer: for itself


def test_an_unbound_v1_budget_is_refused_where_an_audience_is_configured() -> None:
    now = [1_800_000_000.0]
    v1 = bound(now, None).sign(1.5)
    assert v1.startswith("v1.k1.1500.")
    with pytest.raises(HeaderError) as refused:
        bound(now, "svc-a").verify(v1)
    assert refused.value.problem == "no audience"
    # A receiver without an audience binds nothing (the rollout step): v1 and any v2 pass.
    unbound = bound(now, None)
    assert unbound.verify(v1) == 1.5
    assert unbound.verify(bound(now, "svc-a").sign(2.0)) == 2.0


def test_the_audience_is_covered_by_the_signature() -> None:
    now = [1_800_000_000.0]
    value = bound(now, "svc-a").sign(1.5)
    forged = value.replace(".svc-a.", ".svc-b.")
    with pytest.raises(HeaderError, match="bad signature"):
        bound(now, "svc-b").verify(forged)


def test_a_dotted_audience_binds_exactly() -> None:
    now = [1_800_000_000.0]
    value = bound(now, "billing.prod.svc").sign(1.5)
    assert bound(now, "billing.prod.svc").verify(value) == 1.5
    for other in ["billing", "billing.prod", "prod.svc", "billing.prod.svc.x"]:
        with pytest.raises(HeaderError):
            bound(now, other).verify(value)


def test_rotation_keeps_working_with_an_audience() -> None:
    now = [1_800_000_000.0]
    old = bound(now, "svc-a", k1=KEY)
    value = old.sign(1.5)
    rotated = bound(now, "svc-a", k2=OTHER_KEY, k1=KEY)  # new key first, old still verifies
    assert rotated.verify(value) == 1.5
    new_value = rotated.sign(0.25)
    assert new_value.startswith("v2.k2.svc-a.")
    assert rotated.verify(new_value) == 0.25
    assert rotated.for_audience("svc-b").sign(1.0).startswith("v2.k2.svc-b.")
    with pytest.raises(HeaderError, match="audience"):
        bound(now, "svc-b", k2=OTHER_KEY, k1=KEY).verify(new_value)
    with pytest.raises(HeaderError, match="unknown signing key"):
        bound(now, "svc-a", k2=OTHER_KEY).verify(value)


def test_the_policy_ignores_and_reports_a_budget_signed_for_another_service() -> None:
    now = [1_800_000_000.0]
    hub = EventHub()
    stats = hub.subscribe(Stats())
    policy = InboundDeadlinePolicy(default=1.0, events=hub, signer=bound(now, "svc-b"))
    for_a = {SIGNED_BUDGET_HEADER: bound(now, "svc-a").sign(7.0)}.get
    assert policy.resolve(for_a, Trust.SIGNED) == (1.0, "default", False)
    for_b = {SIGNED_BUDGET_HEADER: bound(now, "svc-b").sign(7.0)}.get
    assert policy.resolve(for_b, Trust.SIGNED) == (7.0, "signed", False)
    assert stats.headers_ignored == {(SIGNED_BUDGET_HEADER, "wrong audience"): 1}


def test_outbound_headers_sign_for_the_signers_audience() -> None:
    now = [1_800_000_000.0]
    ctx = brownout.RequestContext(deadline=Deadline.after(2.0, clock=ManualClock(0.0)))
    headers = outbound_headers(ctx=ctx, signer=bound(now, None).for_audience("svc-a"))
    assert bound(now, "svc-a").verify(headers[SIGNED_BUDGET_HEADER]) == 2.0
    with pytest.raises(HeaderError):
        bound(now, "svc-b").verify(headers[SIGNED_BUDGET_HEADER])


@pytest.mark.parametrize("audience", ["", "a b", "a,b", "caf\u00e9", "a\nb", "x" * 256, '"a"'])
def test_signer_refuses_an_audience_that_cannot_travel_in_a_header(audience: str) -> None:
    with pytest.raises(ValueError, match="audience"):
        BudgetSigner({"k1": KEY}, audience=audience)
    with pytest.raises(ValueError, match="audience"):
        BudgetSigner({"k1": KEY}).for_audience(audience)


def test_signer_refuses_weak_configuration() -> None:
    with pytest.raises(ValueError):
        BudgetSigner({})
    with pytest.raises(ValueError):
        BudgetSigner({"k": b"short"})
    with pytest.raises(ValueError):
        BudgetSigner({"a.b": KEY})


# -- parsers raise only HeaderError on arbitrary input -----------------------------------------

_SIGNER = BudgetSigner({"k1": KEY})
PARSERS = [decode_grpc_timeout, decode_budget_ms, _SIGNER.verify]


@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.text(max_size=64)))
def test_parsers_raise_only_header_error(value: bytes | str) -> None:
    for parse in PARSERS:
        try:
            parse(value)
        except HeaderError:
            pass


def _mutations(rng: random.Random, seeds: list[bytes], n: int) -> list[bytes]:
    """Near-valid inputs: flip, insert, delete and splice bytes of valid values."""
    out: list[bytes] = []
    for _ in range(n):
        b = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(4)
            pos = rng.randrange(len(b) + 1)
            if op == 0 and b:
                b[min(pos, len(b) - 1)] = rng.randrange(256)
            elif op == 1:
                b.insert(pos, rng.choice(b"0123456789HMSmun.-=_ \t\x00\xff"))
            elif op == 2 and b:
                del b[min(pos, len(b) - 1)]
            else:
                b += rng.choice(seeds)[: rng.randrange(8)]
        out.append(bytes(b))
    return out


def test_parsers_on_100k_generated_inputs() -> None:
    """10^5 generated inputs (random bytes and near-valid mutations) through every parser."""
    rng = random.Random(20261130)
    seeds = [b"250m", b"1H", b"99999999n", b"1500", _SIGNER.sign(1.5).encode()]
    inputs = _mutations(rng, seeds, 70_000)
    inputs += [rng.randbytes(rng.randrange(24)) for _ in range(30_000)]
    accepted = 0
    for value in inputs:
        for parse in PARSERS:
            try:
                parse(value)
                accepted += 1
            except HeaderError:
                pass
    assert len(inputs) >= 100_000
    assert accepted > 0  # the mutator keeps some inputs valid, so both paths are exercised


# -- inbound policy ---------------------------------------------------------------------------


def test_untrusted_sixty_seconds_is_clamped_to_the_route_maximum() -> None:
    policy = InboundDeadlinePolicy(default=2.0, maximum=5.0)
    budget = policy.resolve({BUDGET_HEADER: "60000"}.get, Trust.UNTRUSTED)
    assert budget.seconds == 5.0
    assert budget.clamped


def test_untrusted_may_shorten_but_can_be_ignored_entirely() -> None:
    headers = {BUDGET_HEADER: "300"}.get
    assert InboundDeadlinePolicy().resolve(headers, Trust.UNTRUSTED).seconds == 0.3
    strict = InboundDeadlinePolicy(default=2.0, honour_untrusted=False)
    assert strict.resolve(headers, Trust.UNTRUSTED).seconds == 2.0
    assert strict.resolve(headers, Trust.TRUSTED).seconds == 0.3


def test_no_header_means_route_default() -> None:
    budget = InboundDeadlinePolicy(default=1.5).resolve({}.get, Trust.TRUSTED)
    assert budget == (1.5, "default", False)


def test_envoy_header_when_configured_and_the_shorter_wins() -> None:
    headers = {BUDGET_HEADER: "900", ENVOY_TIMEOUT_HEADER: "400"}.get
    assert InboundDeadlinePolicy().resolve(headers, Trust.TRUSTED).seconds == 0.9
    budget = InboundDeadlinePolicy(read_envoy=True).resolve(headers, Trust.TRUSTED)
    assert budget.seconds == 0.4 and budget.origin == "envoy"


def test_signed_source_needs_a_valid_signature() -> None:
    s = BudgetSigner({"k1": KEY})
    policy = InboundDeadlinePolicy(default=1.0, maximum=30.0, signer=s)
    good = {SIGNED_BUDGET_HEADER: s.sign(7.0)}.get
    assert policy.resolve(good, Trust.SIGNED) == (7.0, "signed", False)
    plain = {BUDGET_HEADER: "7000"}.get  # an unsigned header from a signed-only source
    assert policy.resolve(plain, Trust.SIGNED).seconds == 1.0


def test_malformed_headers_are_ignored_and_reported_never_raised() -> None:
    hub = EventHub()
    seen: list[DeadlineHeaderIgnored] = []

    class Collect:
        def emit(self, event: brownout.events.Event) -> None:
            assert isinstance(event, DeadlineHeaderIgnored)
            seen.append(event)

    hub.subscribe(Collect())
    policy = InboundDeadlinePolicy(default=1.0, events=hub, signer=BudgetSigner({"k1": KEY}))
    assert policy.resolve({BUDGET_HEADER: "soon"}.get, Trust.TRUSTED).seconds == 1.0
    assert policy.resolve({SIGNED_BUDGET_HEADER: "v1.k1.x"}.get, Trust.SIGNED).seconds == 1.0
    assert [e.header for e in seen] == [BUDGET_HEADER, SIGNED_BUDGET_HEADER]


def test_policy_validates_its_bounds() -> None:
    with pytest.raises(ValueError):
        InboundDeadlinePolicy(default=10, maximum=5)
    with pytest.raises(ValueError):
        InboundDeadlinePolicy(default=0)


# -- outbound ---------------------------------------------------------------------------------


def test_outbound_headers_send_remaining_minus_reserve() -> None:
    with brownout.request(
        deadline=1.0, priority=Priority.SHEDDABLE, idempotency_key="k-1", attempt=2
    ):
        headers = outbound_headers(reserve=0.2)
    assert 780 <= int(headers[BUDGET_HEADER]) <= 800
    assert headers["brownout-priority"] == "sheddable"
    assert headers["brownout-attempt"] == "2"
    assert headers["idempotency-key"] == "k-1"
    assert outbound_headers() == {}


def test_stats_sink_counts_ignored_headers_without_crashing() -> None:
    # Stats counts ignored headers by (header, problem), one row per pair.
    stats = Stats()
    stats.emit(DeadlineHeaderIgnored(0.0, "inbound", BUDGET_HEADER, "bad"))
    stats.emit(DeadlineHeaderIgnored(1.0, "inbound", BUDGET_HEADER, "bad"))
    stats.emit(DeadlineHeaderIgnored(2.0, "inbound", BUDGET_HEADER, "untrusted source"))
    stats.emit(DeadlineHeaderIgnored(3.0, "inbound", SIGNED_BUDGET_HEADER, "bad"))
    assert stats.headers_ignored == {
        (BUDGET_HEADER, "bad"): 2,
        (BUDGET_HEADER, "untrusted source"): 1,
        (SIGNED_BUDGET_HEADER, "bad"): 1,
    }


def test_a_protocol_budget_is_clamped_to_the_route_maximum() -> None:
    """D3 for protocols that carry their own deadline (gRPC): capped, or the default."""
    policy = InboundDeadlinePolicy(default=2.0, maximum=5.0)
    assert policy.clamp(None) == 2.0
    assert policy.clamp(3.0) == 3.0
    assert policy.clamp(60.0) == 5.0
    assert policy.clamp(0.0) == 0.0  # spent: the edge answers before the work starts


# -- encoders: huge and infinite durations are capped, never OverflowError --------------------


@pytest.mark.parametrize("seconds", [math.inf, 1e308, 1e300, 1e12])
def test_encoders_cap_huge_durations(seconds: float) -> None:
    assert encode_budget_ms(seconds) == "999999999999"
    assert encode_grpc_timeout(seconds) == "99999999H"
    signer = BudgetSigner({"k1": b"0123456789abcdef"})
    assert signer.verify(signer.sign(seconds)) == 999_999_999.999


def test_outbound_headers_under_an_infinite_deadline() -> None:
    with brownout.deadline(math.inf):
        assert outbound_headers()[BUDGET_HEADER] == "999999999999"


@given(st.floats(allow_nan=False))
def test_encoders_never_raise_and_never_extend(seconds: float) -> None:
    ms = encode_budget_ms(seconds)
    grpc = encode_grpc_timeout(seconds)
    assert decode_budget_ms(ms) <= max(seconds, 0.0) + 1e-6
    assert decode_grpc_timeout(grpc) <= max(seconds, 0.0) * (1 + 1e-9) + 1e-9


# -- encoders round down exactly: what is sent never decodes to more than what is left ----------

_LEFT = st.floats(min_value=0.0, allow_nan=False)  # (with +inf)


@settings(max_examples=5000, deadline=None)
@given(_LEFT)
@example(0.0019999996)  # budget ms: round(1.9999996, 3) == 2.0 sent 2 ms for 1.9999996 ms
@example(785.2179999999998)
@example(6144.999999999999)
@example(0.00043599999999999997)  # grpc: 436000n for 435999.99999999997 ns
@example(5168.8279999999995)  # grpc: 5168828m
@example(0.31527499999999997)
@example(math.nextafter(0.1, 0.0))
@example(math.nextafter(99_999_999e-9, math.inf))
@example(999_999_999.999)
@example(math.nextafter(999_999_999.999, 0.0))
def test_encoded_budgets_never_decode_to_more_than_what_is_left(seconds: float) -> None:
    ms = decode_budget_ms(encode_budget_ms(seconds))
    assert ms <= seconds
    if seconds < 999_999_999.999:
        assert ms > seconds - 0.001 - 1e-12 * seconds  # the floor, not a step lower
    grpc = decode_grpc_timeout(encode_grpc_timeout(seconds))
    assert grpc <= seconds
    if seconds < 99_999_999 * 3600:
        assert grpc >= seconds * (1 - 1e-5) - 1e-9  # the finest unit that fits


@settings(max_examples=3000, deadline=None)
@given(_LEFT, _LEFT)
@example(0.0019999996, 0.002)
def test_encoded_budget_ms_never_grows_as_time_runs_out(a: float, b: float) -> None:
    less, more = sorted((a, b))
    assert int(encode_budget_ms(less)) <= int(encode_budget_ms(more))


# -- reserve: kept back, never added -----------------------------------------------------------


@pytest.mark.parametrize("reserve", [-5.0, math.nan])
def test_outbound_budget_never_exceeds_what_is_left(reserve: float) -> None:
    ctx = brownout.RequestContext(deadline=Deadline.after(1.0, clock=ManualClock(0.0)))
    assert outbound_headers(ctx=ctx, reserve=reserve)[BUDGET_HEADER] == "1000"


# -- signed budgets: a NaN skew tolerance must not disable the replay bound -------------------


@pytest.mark.parametrize("skew", [math.nan, -1.0])
def test_signer_refuses_a_meaningless_skew_tolerance(skew: float) -> None:
    with pytest.raises(ValueError, match="skew_tolerance"):
        BudgetSigner({"k1": b"0123456789abcdef"}, skew_tolerance=skew)


def test_signed_budget_replayed_late_is_refused() -> None:
    wall = [1000.0]
    signer = BudgetSigner({"k1": b"0123456789abcdef"}, wall_clock=lambda: wall[0])
    value = signer.sign(7.5)
    wall[0] += 3600.0
    with pytest.raises(HeaderError):
        signer.verify(value)
    policy = brownout.InboundDeadlinePolicy(default=2.0, maximum=30.0, signer=signer)
    got = policy.resolve({SIGNED_BUDGET_HEADER: value}.get, brownout.Trust.SIGNED)
    assert got.seconds == 2.0 and got.origin == "default"


# -- bounded labels: forged headers cannot fill the metric label sets -----------------------------


def test_bounded_forged_headers_name_a_few_problems_and_leave_the_reasons_cap_alone() -> None:
    """100,000 forged budget headers, each different, as an attacker would send them: the
    ``problem`` of each `DeadlineHeaderIgnored` is one of a few fixed words, never the forged
    value, so it neither puts attacker bytes in a metric label nor fills `Stats.reasons`, the
    cap that exception type names share (a failure seen afterwards keeps its own label)."""
    hub = EventHub()
    stats = hub.subscribe(Stats())
    wall = [1_000.0]
    signer = BudgetSigner({"k1": b"0123456789abcdef"}, wall_clock=lambda: wall[0])
    policy = InboundDeadlinePolicy(default=1.0, events=hub, signer=signer)
    for i in range(25_000):
        policy.resolve({BUDGET_HEADER: f"soon-{i}"}.get, Trust.TRUSTED)
        policy.resolve({BUDGET_HEADER: f"{i}\u00e9"}.get, Trust.TRUSTED)
        policy.resolve({SIGNED_BUDGET_HEADER: f"v1.kid{i}.10.1.sig"}.get, Trust.SIGNED)
        replayed = signer.sign(5.0)
        wall[0] += 10 + i / 10  # replayed, it was issued a different time ago each round
        policy.resolve({SIGNED_BUDGET_HEADER: replayed}.get, Trust.SIGNED)
    problems = {problem for _header, problem in stats.headers_ignored}
    assert len(problems) <= 8
    assert sum(stats.headers_ignored.values()) == 100_000
    assert all("soon" not in p and "kid" not in p for p in problems)
    stats.emit(
        brownout.events.RequestFailed(0.0, "api", "/q", Priority.CRITICAL, "c", 0.1, "KeyError")
    )
    assert stats.count("failed", reason="KeyError") == 1


def test_of_repeated_budgets_the_shortest_valid_one_wins() -> None:
    """Issue 24: with 3000 and 1000 the request got 3 s (the first value)."""
    from brownout._edge import Repeated, header_getter, metadata_getter, one_value
    from brownout.events import EventHub

    seen: list[DeadlineHeaderIgnored] = []
    events = EventHub()
    events.subscribe(type("S", (), {"emit": lambda self, e: seen.append(e)})())
    signer = BudgetSigner({"k": b"0123456789abcdef"})
    policy = InboundDeadlinePolicy(
        default=2.0, maximum=30.0, read_envoy=True, signer=signer, events=events
    )
    pairs = [(b"brownout-budget-ms", b"3000"), (b"brownout-budget-ms", b"1000")]
    assert policy.resolve(header_getter(pairs), Trust.TRUSTED).seconds == 1.0
    assert policy.resolve(header_getter(pairs[::-1]), Trust.UNTRUSTED).seconds == 1.0
    meta = [("brownout-budget-ms", "3000"), ("x", "y"), ("brownout-budget-ms", "1000")]
    assert policy.resolve(metadata_getter(meta), Trust.TRUSTED).seconds == 1.0
    folded = {"brownout-budget-ms": "3000, 1000"}
    assert policy.resolve(folded.get, Trust.TRUSTED).seconds == 1.0
    both = {"brownout-budget-ms": "3000", "x-envoy-expected-rq-timeout-ms": Repeated(("900", "5"))}
    assert policy.resolve(both.get, Trust.TRUSTED) == (0.005, "envoy", False)
    # A malformed value among valid ones is reported and ignored; the others still count.
    seen.clear()
    odd = {"brownout-budget-ms": Repeated(("soon", "1500"))}
    assert policy.resolve(odd.get, Trust.TRUSTED).seconds == 1.5
    assert [e.header for e in seen] == ["brownout-budget-ms"]
    # Signed: each is verified on its own; the shortest valid one wins.
    signed = {"brownout-signed-budget": Repeated((signer.sign(3.0), "forged", signer.sign(1.0)))}
    assert policy.resolve(signed.get, Trust.SIGNED) == (1.0, "signed", False)
    # Equal repeated values are one value; none is None.
    assert one_value(["7", "7"]) == "7" and one_value([]) is None
    assert one_value(["7", "8", "7"]) == Repeated(("7", "8"))


def test_a_repeated_priority_claim_with_differing_values_is_ignored() -> None:
    from brownout import EdgePolicy, Priority
    from brownout._edge import header_getter
    from brownout.events import EventHub

    seen: list[DeadlineHeaderIgnored] = []
    events = EventHub()
    events.subscribe(type("S", (), {"emit": lambda self, e: seen.append(e)})())
    policy = EdgePolicy(
        trust=Trust.TRUSTED, default_priority=Priority.SHEDDABLE_PLUS, events=events
    )
    route = policy.route("/x")
    claims = [(b"brownout-priority", b"critical"), (b"brownout-priority", b"sheddable")]
    cls = policy.classify(None, route, "/x", Trust.TRUSTED, header_getter(claims))
    assert cls.priority is Priority.SHEDDABLE_PLUS  # the route's, not the first claim
    assert [(e.header, e.problem) for e in seen] == [("brownout-priority", "repeated")]
    same = [(b"brownout-priority", b"sheddable")] * 2
    cls = policy.classify(None, route, "/x", Trust.TRUSTED, header_getter(same))
    assert cls.priority is Priority.SHEDDABLE


# -- idempotency key and attempt (I1) ---------------------------------------------------------

_PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1)


def _sf_string(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@given(_PRINTABLE.filter(lambda k: len(k) <= 255))
def test_an_sf_string_key_decodes_to_itself(key: str) -> None:
    from brownout.wire import decode_idempotency_key

    assert decode_idempotency_key(_sf_string(key)) == key
    assert decode_idempotency_key(_sf_string(key).encode()) == key


@given(_PRINTABLE)
def test_a_key_decodes_or_raises_only_header_error(value: str) -> None:
    from brownout.wire import decode_idempotency_key

    try:
        key = decode_idempotency_key(value)
    except brownout.HeaderError:
        return
    assert 1 <= len(key) <= 255 and key.isprintable()


def test_idempotency_key_forms_and_bounds() -> None:
    from brownout.wire import decode_attempt, decode_idempotency_key

    assert decode_idempotency_key("3f2a-99_x=") == "3f2a-99_x="  # the plain token form
    assert decode_idempotency_key(' "a b" ') == "a b"
    assert decode_idempotency_key("k" * 255) == "k" * 255
    for bad, problem in [
        ("", "malformed"),
        ('""', "malformed"),
        ("a b", "malformed"),
        ("a,b", "malformed"),  # two values folded into one
        ('"open', "malformed"),
        ('"bad \\x escape"', "malformed"),
        ("k" * 256, "too long"),
        ('"' + "k" * 256 + '"', "too long"),
        ("x" * 10_000, "too long"),
        ("clé", "not ascii"),
        ("a\x00b", "malformed"),
    ]:
        with pytest.raises(brownout.HeaderError) as info:
            decode_idempotency_key(bad)
        assert info.value.problem == problem, bad
    assert decode_attempt("1") == 1 and decode_attempt(b" 42 ") == 42
    assert decode_attempt("1000") == 1000
    for bad in ("0", "1001", "-1", "2.0", "", "99999", "٣"):
        with pytest.raises(brownout.HeaderError):
            decode_attempt(bad)


def test_a_bound_key_is_per_caller_and_stable() -> None:
    from brownout.wire import bind_idempotency_key, decode_idempotency_key

    alice = bind_idempotency_key("alice", "order-7")
    assert alice == bind_idempotency_key("alice", "order-7")
    assert alice != bind_idempotency_key("bob", "order-7")
    assert alice != bind_idempotency_key("alice", "order-8")
    # no ambiguity where the caller ends and the key begins
    assert bind_idempotency_key("a", "bc") != bind_idempotency_key("ab", "c")
    assert len(alice) == 43 and decode_idempotency_key(alice) == alice  # forwardable as is


@given(_PRINTABLE.filter(lambda k: len(k) <= 255))
def test_a_key_sent_from_the_context_reads_back_as_itself(key: str) -> None:
    from brownout.wire import IDEMPOTENCY_HEADER, context_headers, decode_idempotency_key

    sent = context_headers(brownout.RequestContext(idempotency_key=key))[IDEMPOTENCY_HEADER]
    assert decode_idempotency_key(sent) == key
    if key.isalnum():
        assert sent == key  # a plain token goes as it is
