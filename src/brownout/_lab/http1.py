"""A minimal, correct, incremental HTTP/1.1 response parser for the load generator.

The generator needs to read tens of thousands of small responses a second on one core, so it
cannot afford a general-purpose client, which manages far fewer. This parser handles exactly
what a client of a keep-alive HTTP/1.1 server meets: the status line, header fields (names
lower-cased, repeats joined with ``", "``), bodies framed by ``Content-Length``, by
``Transfer-Encoding: chunked`` (with trailers) or by connection close, interim ``1xx``
responses (skipped), and bodiless statuses (``204``, ``304``). Anything else is a
`ResponseParseError`: the generator counts it as an error and drops the connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MAX_HEAD", "Response", "ResponseParseError", "ResponseParser", "encode_request"]

MAX_HEAD = 64 * 1024
"""Largest status line plus header block accepted, in bytes."""
_MAX_CHUNK_LINE = 1024


class ResponseParseError(ValueError):
    """The bytes received are not a valid HTTP/1.x response."""


@dataclass(slots=True)
class Response:
    """One complete response."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    keep_alive: bool = True
    """False when the server will close the connection after this response."""


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE = range(7)


class ResponseParser:
    """Turns the bytes of one connection into `Response` objects, in order.

    ``feed(data)`` returns the responses completed by ``data`` (usually zero or one);
    ``feed_eof()`` returns the response whose body was delimited by the connection closing,
    and raises `ResponseParseError` if the connection closed in the middle of a response.
    """

    __slots__ = ("_body", "_buf", "_current", "_remaining", "_state")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = _HEAD
        self._current: Response | None = None
        self._body = bytearray()
        self._remaining = 0

    @property
    def idle(self) -> bool:
        """True between responses (nothing partially received)."""
        return self._state == _HEAD and not self._buf

    def feed(self, data: bytes) -> list[Response]:
        """Consume ``data``; return every response it completed."""
        self._buf += data
        done: list[Response] = []
        while True:
            state = self._state
            if state == _HEAD:
                if not self._parse_head():
                    return done
                if self._state == _HEAD and self._current is not None:
                    done.append(self._finish())
            elif state == _LENGTH:
                if not self._buf:
                    return done
                take = min(self._remaining, len(self._buf))
                self._body += self._buf[:take]
                del self._buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    done.append(self._finish())
            elif state == _CHUNK_SIZE:
                line = self._line(_MAX_CHUNK_LINE)
                if line is None:
                    return done
                size_text = line.split(b";", 1)[0].strip()
                try:
                    if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                        raise ValueError
                    size = int(size_text, 16)
                except ValueError:
                    raise ResponseParseError(f"bad chunk size line {bytes(line)[:40]!r}") from None
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                if not self._buf:
                    return done
                take = min(self._remaining, len(self._buf))
                self._body += self._buf[:take]
                del self._buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if len(self._buf) < 2:
                    return done
                if self._buf[:2] != b"\r\n":
                    raise ResponseParseError("chunk data not followed by CRLF")
                del self._buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILER:
                line = self._line(MAX_HEAD)
                if line is None:
                    return done
                if not line:  # the empty line that ends the trailer section
                    done.append(self._finish())
            else:  # _UNTIL_CLOSE
                self._body += self._buf
                self._buf.clear()
                return done

    def feed_eof(self) -> Response | None:
        """The connection closed: finish a close-delimited body, or complain about a cut one."""
        if self._state == _UNTIL_CLOSE:
            self._body += self._buf
            self._buf.clear()
            return self._finish()
        if self._state == _HEAD and not self._buf:
            return None
        raise ResponseParseError("connection closed in the middle of a response")

    # -- internals ---------------------------------------------------------------------------

    def _line(self, limit: int) -> bytearray | None:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > limit:
                raise ResponseParseError("line too long")
            return None
        line = self._buf[:end]
        del self._buf[: end + 2]
        return line

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                raise ResponseParseError("response head too large")
            return False
        if end > MAX_HEAD:
            raise ResponseParseError("response head too large")
        head = bytes(self._buf[:end])
        del self._buf[: end + 4]
        lines = head.split(b"\r\n")
        status_line = lines[0]
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise ResponseParseError(f"bad status line {status_line[:60]!r}")
        code = parts[1]
        if len(code) != 3 or not code.isdigit():
            raise ResponseParseError(f"bad status code {code[:10]!r}")
        status = int(code)
        if status < 100:
            raise ResponseParseError(f"bad status code {status}")
        headers: dict[str, str] = {}
        for raw in lines[1:]:
            name, sep, value = raw.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name:
                raise ResponseParseError(f"bad header line {raw[:60]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if 100 <= status < 200 and status != 101:
            return True  # interim response: skip it, the real one follows
        http10 = parts[0] == b"HTTP/1.0"
        conn_tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
        keep_alive = ("keep-alive" in conn_tokens) if http10 else ("close" not in conn_tokens)
        response = Response(status, headers, b"", keep_alive)
        self._current = response
        self._body = bytearray()
        te = headers.get("transfer-encoding")
        if status in (101, 204, 304):
            self._state = _HEAD
        elif te is not None:
            codings = [c.strip().lower() for c in te.split(",")]
            if codings[-1] != "chunked":
                response.keep_alive = False
                self._state = _UNTIL_CLOSE
            else:
                self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise ResponseParseError(f"bad content-length {headers['content-length'][:40]!r}")
            self._remaining = int(next(iter(values)))
            self._state = _LENGTH if self._remaining else _HEAD
        else:
            response.keep_alive = False
            self._state = _UNTIL_CLOSE
        return True

    def _finish(self) -> Response:
        response = self._current
        assert response is not None
        response.body = bytes(self._body)
        self._current = None
        self._body = bytearray()
        self._state = _HEAD
        return response


def encode_request(
    method: str,
    path: str,
    host: str,
    headers: tuple[tuple[str, str], ...] = (),
    body: bytes = b"",
) -> bytes:
    """The bytes of one keep-alive HTTP/1.1 request (built once per traffic class)."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body or method not in ("GET", "HEAD"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
