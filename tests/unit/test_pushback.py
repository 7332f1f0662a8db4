"""`parse_pushback` is total: any header value gives a typed answer, never an exception (R1, S2).

gRFC A6: ``grpc-retry-pushback-ms`` is a non-negative decimal integer; a negative or
unparseable one asks the client not to retry at all. A value too large for the 32-bit integer
gRPC reads it into is unparseable, so it means "do not retry" too (not an ``OverflowError``).
RFC 9110/9111: ``Retry-After`` is delta-seconds or an HTTP-date; a delta-seconds too large to
represent is read as 2^31 seconds, and an invalid value is ignored.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from brownout.wire import GRPC_PUSHBACK_KEY, RETRY_HEADER, parse_pushback

RETRY_AFTER_CAP = 2.0**31
PUSHBACK_MAX_MS = 2**31 - 1


@pytest.mark.parametrize("digits", [309, 400, 4300, 5000, 100_000])
def test_a_pushback_with_hundreds_of_digits_means_do_not_retry(digits: int) -> None:
    assert parse_pushback({GRPC_PUSHBACK_KEY: "9" * digits}) == (None, True)
    assert parse_pushback({GRPC_PUSHBACK_KEY: "-" + "9" * digits}) == (None, True)


def test_a_pushback_beyond_32_bits_means_do_not_retry() -> None:
    assert parse_pushback({GRPC_PUSHBACK_KEY: str(PUSHBACK_MAX_MS)}) == (
        PUSHBACK_MAX_MS / 1000,
        False,
    )
    assert parse_pushback({GRPC_PUSHBACK_KEY: str(PUSHBACK_MAX_MS + 1)}) == (None, True)
    # Leading zeros do not make a small value large.
    assert parse_pushback({GRPC_PUSHBACK_KEY: "0" * 500 + "250"}) == (0.25, False)


@pytest.mark.parametrize(
    "value",
    ["1_000", "+5", "\u0663", "0x10", "1e3", "1.5", "5 0", "", " ", "\u00b2", "\uff15"],
)
def test_a_pushback_that_is_not_a_decimal_integer_means_do_not_retry(value: str) -> None:
    # Python's int() accepts underscores, a plus sign and non-ASCII digits; the wire does not.
    assert parse_pushback({GRPC_PUSHBACK_KEY: value}) == (None, True)


def test_a_pushback_may_be_bytes_and_may_carry_surrounding_whitespace() -> None:
    assert parse_pushback({GRPC_PUSHBACK_KEY: b"250"}) == (0.25, False)  # type: ignore[dict-item]
    assert parse_pushback({GRPC_PUSHBACK_KEY: " 250\t"}) == (0.25, False)
    assert parse_pushback({GRPC_PUSHBACK_KEY: b"\xff250"}) == (None, True)  # type: ignore[dict-item]


@pytest.mark.parametrize("digits", [11, 309, 400, 5000])
def test_a_huge_retry_after_is_capped_at_two_to_the_31_seconds(digits: int) -> None:
    assert parse_pushback({"retry-after": "9" * digits}) == (RETRY_AFTER_CAP, False)
    assert parse_pushback({"retry-after": "2147483647"}) == (2147483647.0, False)


@pytest.mark.parametrize(
    "value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1", "+3", "3.5", "1_0", "0x5"]
)
def test_a_retry_after_that_is_neither_seconds_nor_a_date_is_ignored(value: str) -> None:
    assert parse_pushback({"retry-after": value}) == (None, False)


def test_a_retry_after_date_far_in_the_future_is_capped() -> None:
    retry_after, never = parse_pushback({"retry-after": "Fri, 31 Dec 9999 23:59:59 GMT"})
    assert retry_after == RETRY_AFTER_CAP and never is False


@pytest.fixture
def tokyo() -> Iterator[None]:
    """A machine whose local time is UTC+9."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        yield
    finally:
        mp.undo()
        time.tzset()


@pytest.mark.usefixtures("tokyo")
def test_a_retry_after_date_in_utc_without_a_zone_is_read_as_utc() -> None:
    """RFC 5322's ``-0000`` is UTC; ``parsedate_to_datetime`` makes it a naive datetime, which
    ``.timestamp()`` would read as local time (9 hours off here)."""
    when = email.utils.formatdate(time.time() + 100)  # "... -0000"
    assert when.endswith("-0000")
    retry_after, _ = parse_pushback({"retry-after": when})
    assert retry_after is not None and 90 <= retry_after <= 100
    retry_after, _ = parse_pushback({"retry-after": "Mon, 01 Jan 0001 00:00:00 -0000"})
    assert retry_after == 0.0


# -- the property: any value, text or bytes, gives a typed answer --------------------------------

_VALUES = st.one_of(
    st.text(max_size=80),
    st.binary(max_size=80),
    st.from_regex(r"\A-?[0-9]{1,400}\Z"),
    st.from_regex(
        r"\A[A-Za-z]{3}, [0-9]{1,2} [A-Za-z]{3} -?[0-9]{1,6} [0-9:]{1,9}( [-+A-Z0-9]{1,6})?\Z"
    ),
)
_KEYS = st.sampled_from([GRPC_PUSHBACK_KEY, "retry-after", RETRY_HEADER])


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=3))
@example({GRPC_PUSHBACK_KEY: "9" * 400})
@example({"retry-after": "9" * 400})
@example({"retry-after": "Mon, 01 Jan 0001 00:00:00 -0000"})
@example({"retry-after": "Fri, 31 Dec 9999 23:59:59 +2359"})
@example({"retry-after": "Thu, 01 Jan 1970 00:00:00 -2359"})
def test_parse_pushback_is_total(headers: dict[str, str | bytes]) -> None:
    result = parse_pushback(headers)  # type: ignore[arg-type]
    assert isinstance(result, tuple) and len(result) == 2
    retry_after, never = result
    assert isinstance(never, bool)
    if retry_after is not None:
        assert isinstance(retry_after, float)
        assert math.isfinite(retry_after) and 0.0 <= retry_after <= RETRY_AFTER_CAP
        assert not never


# -- the httpx transport: an absurd pushback is an answer, not an OverflowError -----------------


@pytest.mark.parametrize("pushback", ["9" * 400, "-1"])
async def test_the_httpx_transport_classifies_an_absurd_pushback_as_do_not_retry(
    pushback: str,
) -> None:
    """An absurd pushback is read as gRFC A6's "do not retry", exactly like ``-1``: the retry
    layer gives up at once with the answer attached, instead of an ``OverflowError``."""
    httpx = pytest.importorskip("httpx")
    from brownout import Dependency, RetriesExhausted, RetryPolicy, StopReason
    from brownout.integrations.httpx import BrownoutTransport

    sent: list[object] = []

    def answer(request: object) -> object:
        sent.append(request)
        # An unread body, as from the network (MockTransport's content counts as read).
        stream = httpx.ByteStream(b"busy")
        return httpx.Response(503, headers={GRPC_PUSHBACK_KEY: pushback}, stream=stream)

    dependency = Dependency("callee", retry=RetryPolicy(attempts=3))
    transport = BrownoutTransport(httpx.MockTransport(answer), dependency=dependency)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(RetriesExhausted) as gave_up:
            await client.get("http://callee.test/")
    assert gave_up.value.stopped_by is StopReason.DO_NOT_RETRY
    response = gave_up.value.response
    assert isinstance(response, httpx.Response) and response.status_code == 503
    assert len(sent) == 1


# -- repeated headers: never anywhere wins, else the longest wait --------------------------


class _MultiDict(dict[str, list[str]]):
    """aiohttp's shape: ``get`` gives the first value, ``getall`` every one."""

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        values = super().get(key)
        return values[0] if values else default

    def getall(self, key: str, default: object = ()) -> list[str]:
        return super().get(key) or list(default)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["later", "never"], (None, True)),
        (["never", "later"], (None, True)),
        (["later, Never"], (None, True)),
    ],
)
def test_a_never_marker_in_any_value_wins(values: list[str], expected: object) -> None:
    assert parse_pushback({RETRY_HEADER: values}) == expected
    assert parse_pushback(_MultiDict({RETRY_HEADER: values})) == expected


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=5))
def test_the_longest_retry_after_wins(seconds: list[int]) -> None:
    values = [str(s) for s in seconds]
    assert parse_pushback({"retry-after": values}) == (float(max(seconds)), False)
    assert parse_pushback({"retry-after": ", ".join(values)}) == (float(max(seconds)), False)
    assert parse_pushback(_MultiDict({"retry-after": values})) == (float(max(seconds)), False)


@given(st.lists(st.integers(0, PUSHBACK_MAX_MS), min_size=1, max_size=5), st.booleans())
def test_the_longest_grpc_pushback_wins_unless_one_says_never(ms: list[int], bad: bool) -> None:
    values = [str(v) for v in ms] + (["-1"] if bad else [])
    expected = (None, True) if bad else (max(ms) / 1000.0, False)
    assert parse_pushback({GRPC_PUSHBACK_KEY: values}) == expected
    assert parse_pushback({GRPC_PUSHBACK_KEY: ",".join(values)}) == expected


def test_a_joined_http_date_is_still_a_date() -> None:
    date = email.utils.formatdate(time.time() + 5, usegmt=True)  # has a comma of its own
    wait, never = parse_pushback({"retry-after": date})
    assert not never and wait is not None and 3.0 < wait <= 5.0
