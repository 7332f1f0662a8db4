"""`ParkedMessage`: a parked copy's fields read back the same way for every broker."""

from __future__ import annotations

from brownout.durable import (
    PARK_DETAIL_FIELD,
    PARK_REASON_FIELD,
    PARKED_AT_FIELD,
    Envelope,
    ParkedMessage,
)

START = 1_800_000_000.0


def test_a_parked_copy_reads_back_with_its_envelope_reason_and_own_headers() -> None:
    env = Envelope(enqueued_at=START, valid_until=START + 5, attempt=2, idempotency_key="k")
    fields = {
        **env.encode(),
        PARK_REASON_FIELD: "expired",
        PARK_DETAIL_FIELD: "1.000 s past its deadline",
        PARKED_AT_FIELD: repr(START + 6),
        "tenant": "acme",
    }
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    parked = ParkedMessage.from_headers("1-0", b"body", raw)
    assert parked.envelope == env
    assert (parked.reason, parked.detail, parked.parked_at) == (
        "expired",
        "1.000 s past its deadline",
        START + 6,
    )
    assert parked.headers == {"tenant": "acme"}
    assert parked.body == b"body" and parked.id == "1-0"


def test_an_unreadable_envelope_or_parking_time_is_none_not_an_error() -> None:
    parked = ParkedMessage.from_headers(
        "x", b"", {"brownout-enqueued-at": "soon", PARKED_AT_FIELD: "inf", "a": b"\xff"}
    )
    assert parked.envelope is None and parked.parked_at is None
    assert parked.reason == "unknown" and parked.detail == ""
    assert parked.headers == {"a": "\ufffd"}
    assert ParkedMessage.from_headers("y", b"", {PARKED_AT_FIELD: "later"}).parked_at is None
