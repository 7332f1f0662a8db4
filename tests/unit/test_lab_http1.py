"""The lab generator's HTTP/1.1 response parser (T4: client-side measurement must be right)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brownout._lab.http1 import (
    MAX_HEAD,
    Response,
    ResponseParseError,
    ResponseParser,
    encode_request,
)

CL = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
CHUNKED = (
    b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n"
    b"content-type: application/problem+json\r\n\r\n"
    b"4;ext=1\r\nwiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\n"
)
CLOSE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno"


def feed_all(data: bytes, split: int | None = None) -> list[Response]:
    p = ResponseParser()
    if split is None:
        return p.feed(data)
    out: list[Response] = []
    for i in range(0, len(data), split):
        out += p.feed(data[i : i + split])
    return out


def test_content_length_body_and_headers() -> None:
    [r] = feed_all(CL)
    assert r.status == 200
    assert r.body == b"hello"
    assert r.headers["x-a"] == "1, 2"  # repeated names joined, lower-cased
    assert r.keep_alive


def test_chunked_body_with_extensions_and_trailers() -> None:
    [r] = feed_all(CHUNKED)
    assert r.status == 503
    assert r.body == b"wikipedia in\r\n\r\nchunks."
    assert r.keep_alive


@pytest.mark.parametrize("split", [1, 2, 3, 7, 64])
def test_any_split_gives_the_same_responses(split: int) -> None:
    whole = feed_all(CL + CHUNKED + CLOSE)
    pieces = feed_all(CL + CHUNKED + CLOSE, split)
    assert [(r.status, r.body, r.keep_alive) for r in pieces] == [
        (r.status, r.body, r.keep_alive) for r in whole
    ]
    assert [r.status for r in whole] == [200, 503, 503]


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_arbitrary_chunking_is_equivalent(sizes: list[int]) -> None:
    data = CL + CHUNKED + CL
    p = ResponseParser()
    got: list[Response] = []
    pos = 0
    for size in sizes:
        got += p.feed(data[pos : pos + size])
        pos += size
    got += p.feed(data[pos:])
    chunked_body = b"wikipedia in\r\n\r\nchunks."
    assert [(r.status, r.body) for r in got] == [
        (200, b"hello"),
        (503, chunked_body),
        (200, b"hello"),
    ]
    assert p.idle


def test_connection_close_and_http10_semantics() -> None:
    [r] = feed_all(CLOSE)
    assert not r.keep_alive
    [r10] = feed_all(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n")
    assert not r10.keep_alive
    [r10ka] = feed_all(b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n")
    assert r10ka.keep_alive


def test_body_delimited_by_close() -> None:
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\n\r\npart one, ") == []
    assert p.feed(b"part two") == []
    r = p.feed_eof()
    assert r is not None
    assert r.body == b"part one, part two"
    assert not r.keep_alive


def test_interim_and_bodiless_statuses() -> None:
    data = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\ncontent-length: 10\r\n\r\n"
        b"HTTP/1.1 304 Not Modified\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    )
    assert [r.status for r in feed_all(data)] == [204, 304, 200]


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 099 Low\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno-colon-here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXX",
    ],
)
def test_malformed_responses_raise_only_parse_errors(data: bytes) -> None:
    with pytest.raises(ResponseParseError):
        ResponseParser().feed(data)


def test_oversized_head_is_refused() -> None:
    p = ResponseParser()
    with pytest.raises(ResponseParseError):
        p.feed(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD + 10))


def test_eof_mid_response_is_an_error_and_eof_between_responses_is_not() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    with pytest.raises(ResponseParseError):
        p.feed_eof()
    assert ResponseParser().feed_eof() is None


@given(st.binary(max_size=300))
def test_garbage_never_raises_anything_else(data: bytes) -> None:
    p = ResponseParser()
    try:
        p.feed(data)
        p.feed_eof()
    except ResponseParseError:
        pass


def test_encode_request() -> None:
    raw = encode_request("GET", "/x", "127.0.0.1:1", (("brownout-budget-ms", "500"),))
    assert raw == b"GET /x HTTP/1.1\r\nhost: 127.0.0.1:1\r\nbrownout-budget-ms: 500\r\n\r\n"
    post = encode_request("POST", "/admin", "h", (), b"{}")
    assert post.endswith(b"content-length: 2\r\n\r\n{}")
