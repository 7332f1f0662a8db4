"""`brownout proxy`: a fault-injecting TCP or HTTP/1.1 proxy put between a service and one of
its dependencies, its faults set by hand (`FaultProxy.set_faults`, the control endpoint) or
by a `Timeline`.

Bounded memory: a connection reads at most `CHUNK` bytes at a time and holds at most
`MAX_CHUNKS` of them per direction waiting for their delivery time; a full queue stops the
reading, so a slow reader pushes back on the sender through TCP. Every task the proxy starts
is tracked and cancelled by `FaultProxy.close`, which also closes both sides of every
connection.

A userspace proxy sees a byte stream, not segments: "loss" is the delay a lost segment's
retransmission would cause (docs/proxy.md says when `tc netem` is the better tool).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ipaddress
import json
import math
import random
import socket
import struct
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from .faults import NO_FAULTS, Faults, FaultsError, Timeline

__all__ = ["FaultProxy", "ProxyError", "ProxyStats", "is_loopback", "parse_address"]

CHUNK = 65536
"""Bytes read at a time; also the longest HTTP head (request or status line and headers)."""
MAX_CHUNKS = 16
"""Chunks a tcp-mode connection holds per direction while they wait for their delivery time."""
CONNECT_TIMEOUT = 10.0
"""Seconds to dial the upstream before the connection counts as an upstream failure."""
CONTROL_BODY = 65536
"""The largest JSON body the control endpoint reads."""
ARRIVAL_BIN = 0.1
"""Seconds per arrival bin (``GET /arrivals``): slices of ``time.monotonic()``."""
ARRIVAL_BINS = 6000
"""Arrival bins kept (ten minutes at `ARRIVAL_BIN`): a ring, so memory stays bounded."""

Mode = Literal["tcp", "http"]
FAULT_KINDS = ("latency", "error", "reset", "stall", "loss")


class ProxyError(ValueError):
    """An address or mode the proxy refuses."""


class _Reset(Exception):
    """This connection's fate, drawn mid-stream: reset it."""


class _Stall(Exception):
    """This connection's fate, drawn mid-stream: go silent."""


class _Broken(Exception):
    """A peer broke HTTP/1.1 framing (or hung up mid-message): close both sides."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str, *, default_host: str | None = None) -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT`` or (with ``default_host``) a bare ``PORT``."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        if default_host is None:
            raise ProxyError(f"expected HOST:PORT, not {text!r}")
        host, port_text = default_host, text
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        raise ProxyError(f"expected HOST:PORT, not {text!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ProxyError(f"not a port number in {text!r}") from None
    if not 0 <= port <= 65535:
        raise ProxyError(f"port out of range in {text!r}")
    return host, port


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of what the proxy did (`FaultProxy.stats`); `as_dict` is its JSON."""

    mode: str
    listen: str
    upstream: str
    elapsed: float
    connections: int
    active_connections: int
    requests: int
    upstream_failures: int
    bytes_to_upstream: int
    bytes_to_client: int
    buffered_bytes: int
    max_buffered_bytes: int
    faults_injected: dict[str, int]
    faults: dict[str, Any]
    timeline_step: int

    def as_dict(self) -> dict[str, Any]:
        return {
            name: (dict(value) if isinstance(value, dict) else value)
            for name, value in self.__dict__.items()
        }


class _Arrivals:
    """Arrivals (tcp: new connections; http: requests) per `ARRIVAL_BIN`, the newest
    `ARRIVAL_BINS` bins in a ring."""

    def __init__(self, width: float = ARRIVAL_BIN, size: int = ARRIVAL_BINS) -> None:
        self.width = width
        self.size = size
        self.keys = [-1] * size
        self.counts = [0] * size
        self.newest = -1

    def add(self, now: float) -> None:
        key = math.floor(now / self.width)
        slot = key % self.size
        if self.keys[slot] != key:
            self.keys[slot], self.counts[slot] = key, 0
        self.counts[slot] += 1
        self.newest = max(self.newest, key)

    def as_dict(self, now: float) -> dict[str, Any]:
        """The bins still held (``[bin, count]``, bin = floor(monotonic / width)), oldest
        first; bins not listed between ``oldest_bin`` and ``newest_bin`` saw no arrival."""
        newest = math.floor(now / self.width)
        oldest = newest - self.size + 1
        bins = sorted(
            (k, n) for k, n in zip(self.keys, self.counts, strict=True) if k >= oldest and n
        )
        return {
            "bin_seconds": self.width,
            "clock": "monotonic",
            "oldest_bin": oldest,
            "newest_bin": newest,
            "bins": [list(b) for b in bins],
        }


@dataclass
class _Counters:
    connections: int = 0
    active_connections: int = 0
    requests: int = 0
    upstream_failures: int = 0
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0
    buffered_bytes: int = 0
    max_buffered_bytes: int = 0
    faults_injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))


@dataclass
class _Fate:
    """A tcp connection's drawn reset/stall, and the setting it was drawn under."""

    generation: int
    verdict: Literal["reset", "stall"] | None


@dataclass
class _Held:
    """Bytes one tcp connection has read and not yet delivered."""

    bytes: int = 0


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST (SO_LINGER 0) rather than a FIN, as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _silence(reader: asyncio.StreamReader) -> None:
    """A stall: say nothing until the client hangs up; what it sends is read and dropped."""
    while await reader.read(CHUNK):
        pass


def _parse_head(head: bytes) -> tuple[list[bytes], dict[bytes, bytes]]:
    """(start line's words, headers by lower-case name; repeated ones joined by commas)."""
    lines = head[:-4].split(b"\r\n")
    start = lines[0].split(b" ", 2)
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name.strip():
            raise _Broken("a header line without a name")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = headers[key] + b", " + value if key in headers else value
    return start, headers


def _framing(headers: dict[bytes, bytes]) -> tuple[str, int]:
    """How a message's body ends: ("chunked", 0), ("length", n) or ("none", 0)."""
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        return "chunked", 0
    if b"content-length" in headers:
        try:
            length = int(headers[b"content-length"].split(b",")[0])
        except ValueError:
            raise _Broken("a bad content-length") from None
        if length < 0:
            raise _Broken("a negative content-length")
        return "length", length
    return "none", 0


def _tokens(value: bytes) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",")}


class FaultProxy:
    """A proxy to ``upstream`` (host, port) injecting `Faults`; ``mode`` "tcp" forwards bytes,
    "http" reads HTTP/1.1 requests and responses (one upstream connection per client
    connection). ``listen`` and ``control`` (a tiny HTTP endpoint: GET /faults, PUT /faults
    with a JSON object, GET /stats, GET /arrivals) must be loopback unless ``allow_remote``.
    ``seed`` makes the draws repeatable. Use ``async with`` or `start` / `close`."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        mode: Mode = "tcp",
        faults: Faults = NO_FAULTS,
        timeline: Timeline | None = None,
        control: tuple[str, int] | None = None,
        allow_remote: bool = False,
        seed: int | None = None,
    ) -> None:
        if mode not in ("tcp", "http"):
            raise ProxyError(f"mode must be 'tcp' or 'http', not {mode!r}")
        for what, address in (("listen", listen), ("control", control)):
            if address is not None and not allow_remote and not is_loopback(address[0]):
                raise ProxyError(
                    f"{what} address {address[0]!r} is not loopback: a fault proxy open to "
                    "the network lets anyone reach the upstream (allow_remote / --allow-remote)"
                )
        self.upstream = upstream
        self.mode: Mode = mode
        for setting in [faults, *(s.faults for s in (timeline.steps if timeline else ()))]:
            self._check(setting)
        self._listen = listen
        self._control = control
        self._faults = faults
        self._generation = 0
        self._timeline = timeline
        self._step = -1
        self._rng = random.Random(seed)
        self._counters = _Counters()
        self._arrivals = _Arrivals()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._servers: list[asyncio.Server] = []
        self._started: float | None = None
        self._closed = False
        self.address: tuple[str, int] = listen
        self.control_address: tuple[str, int] | None = None

    # -- the settings -----------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        return self._faults

    def _check(self, faults: Faults) -> None:
        if self.mode == "tcp" and faults.error_rate:
            raise FaultsError("error_rate needs http mode: a tcp proxy cannot answer a request")

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault setting now (a timeline's next step replaces it in turn)."""
        self._check(faults)
        self._faults = faults
        self._generation += 1

    def stats(self) -> ProxyStats:
        loop_time = asyncio.get_running_loop().time() if self._started is not None else 0.0
        c = self._counters
        return ProxyStats(
            mode=self.mode,
            listen=f"{self.address[0]}:{self.address[1]}",
            upstream=f"{self.upstream[0]}:{self.upstream[1]}",
            elapsed=round(loop_time - self._started, 3) if self._started is not None else 0.0,
            connections=c.connections,
            active_connections=c.active_connections,
            requests=c.requests,
            upstream_failures=c.upstream_failures,
            bytes_to_upstream=c.bytes_to_upstream,
            bytes_to_client=c.bytes_to_client,
            buffered_bytes=c.buffered_bytes,
            max_buffered_bytes=c.max_buffered_bytes,
            faults_injected=dict(c.faults_injected),
            faults=self._faults.as_dict(),
            timeline_step=self._step,
        )

    def arrivals(self) -> dict[str, Any]:
        """Arrivals per `ARRIVAL_BIN` (tcp: connections; http: requests), the JSON of
        ``GET /arrivals``: what reached the upstream's side of the proxy, for the lab's
        thundering-herd check."""
        return self._arrivals.as_dict(time.monotonic())

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        server = await asyncio.start_server(self._accept, *self._listen, limit=CHUNK)
        self._servers.append(server)
        self.address = server.sockets[0].getsockname()[:2]
        if self._control is not None:
            control = await asyncio.start_server(self._serve_control, *self._control, limit=CHUNK)
            self._servers.append(control)
            self.control_address = control.sockets[0].getsockname()[:2]
        if self._timeline is not None and self._timeline.steps:
            self._spawn(self._run_timeline(self._timeline, self._started), "timeline")

    async def close(self) -> None:
        """Stop listening, cancel every task, close both sides of every connection."""
        self._closed = True
        for server in self._servers:
            server.close()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"brownout-proxy-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_timeline(self, timeline: Timeline, started: float) -> None:
        loop = asyncio.get_running_loop()
        for index, step in enumerate(timeline.steps):
            wait = started + step.at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.set_faults(step.faults)
            self._step = index

    # -- draws --------------------------------------------------------------------------------

    def _draw(self, rate: float, kind: str) -> bool:
        if rate > 0.0 and self._rng.random() < rate:
            self._counters.faults_injected[kind] += 1
            return True
        return False

    def _latency(self, f: Faults) -> float:
        delay = f.latency + (self._rng.uniform(0.0, f.jitter) if f.jitter else 0.0)
        if delay > 0.0:
            self._counters.faults_injected["latency"] += 1
        return delay

    def _fate(self, f: Faults) -> Literal["reset", "stall"] | None:
        if self._draw(f.reset_rate, "reset"):
            return "reset"
        if self._draw(f.stall_rate, "stall"):
            return "stall"
        return None

    def _hold(self, held: _Held, n: int) -> None:
        """``n`` more bytes (or fewer, negative) waiting in ``held``'s queues."""
        held.bytes += n
        c = self._counters
        c.buffered_bytes += n
        c.max_buffered_bytes = max(c.max_buffered_bytes, c.buffered_bytes)

    # -- connections --------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closed or task is None:
            writer.transport.abort()
            return
        self._tasks.add(task)
        self._writers.add(writer)
        self._counters.connections += 1
        if self.mode == "tcp":
            self._arrivals.add(time.monotonic())
        self._counters.active_connections += 1
        try:
            if self.mode == "tcp":
                await self._tcp(reader, writer)
            else:
                await self._http(reader, writer)
        except (OSError, EOFError, asyncio.LimitOverrunError, _Broken):
            pass  # a peer went away or broke the protocol: both sides are closed below
        except asyncio.CancelledError:
            pass  # close(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            self._counters.active_connections -= 1
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _dial(self, f: Faults) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        if f.connect_latency > 0.0:
            self._counters.faults_injected["latency"] += 1
            await asyncio.sleep(f.connect_latency)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream, limit=CHUNK), CONNECT_TIMEOUT
            )
        except OSError:  # TimeoutError included
            self._counters.upstream_failures += 1
            return None
        self._writers.add(writer)
        return reader, writer

    async def _tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        f = self._faults
        fate = _Fate(self._generation, self._fate(f))
        if fate.verdict == "reset":
            _reset(writer)
            return
        if fate.verdict == "stall":
            await _silence(reader)
            return
        dialled = await self._dial(f)
        if dialled is None:
            _reset(writer)  # as the refused upstream would have
            return
        up_reader, up_writer = dialled
        verdict: str | None = None
        held = _Held()
        try:
            to_upstream: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_CHUNKS)
            to_client: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_CHUNKS)
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pump_in(reader, to_upstream, held, fate))
                    group.create_task(
                        self._pump_out(to_upstream, up_writer, held, "bytes_to_upstream")
                    )
                    group.create_task(self._pump_in(up_reader, to_client, held, None))
                    group.create_task(self._pump_out(to_client, writer, held, "bytes_to_client"))
            except* _Reset:
                verdict = "reset"
            except* _Stall:
                verdict = "stall"
            except* (OSError, EOFError):
                pass  # one side went away: both are closed below
        finally:
            up_writer.transport.abort()
            self._writers.discard(up_writer)
            self._hold(held, -held.bytes)  # what was never delivered is dropped
        if verdict == "reset":
            _reset(writer)
        elif verdict == "stall":
            await _silence(reader)

    async def _pump_in(
        self,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        held: _Held,
        fate: _Fate | None,
    ) -> None:
        """Read one direction into its bounded queue with each chunk's delivery time;
        ``fate`` is given for the client's side (the one that is drawn again)."""
        loop = asyncio.get_running_loop()
        due = 0.0
        while True:
            data = await reader.read(CHUNK)
            if not data:
                await queue.put(None)
                return
            f = self._faults
            delay = 0.0
            if fate is not None:
                if fate.generation != self._generation:
                    fate.generation, fate.verdict = self._generation, self._fate(f)
                if fate.verdict == "reset":
                    raise _Reset
                if fate.verdict == "stall":
                    raise _Stall
                delay += self._latency(f)
            if self._draw(f.loss_rate, "loss"):
                delay += f.loss_delay
            due = max(due, loop.time() + delay)  # delivery keeps the stream's order
            self._hold(held, len(data))
            await queue.put((due, data))

    async def _pump_out(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
        held: _Held,
        counter: Literal["bytes_to_upstream", "bytes_to_client"],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            if item is None:
                if writer.can_write_eof():
                    writer.write_eof()  # the peer's half-close, passed on
                return
            due, data = item
            wait = due - loop.time()
            if wait > 0.0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            self._hold(held, -len(data))
            setattr(self._counters, counter, getattr(self._counters, counter) + len(data))

    # -- http mode ----------------------------------------------------------------------------

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        data: bytes,
        counter: Literal["bytes_to_upstream", "bytes_to_client"],
    ) -> None:
        """Write one piece of a message, held back first when a loss is drawn for it."""
        f = self._faults
        if self._draw(f.loss_rate, "loss"):
            await asyncio.sleep(f.loss_delay)
        writer.write(data)
        await writer.drain()
        setattr(self._counters, counter, getattr(self._counters, counter) + len(data))

    async def _copy_body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        framing: tuple[str, int],
        counter: Literal["bytes_to_upstream", "bytes_to_client"],
        *,
        until_eof: bool = False,
    ) -> None:
        """Copy (or, with no ``writer``, drop) one message body, as its framing says."""

        async def send(data: bytes) -> None:
            if writer is not None:
                await self._send(writer, data, counter)

        kind, length = framing
        if kind == "length":
            while length > 0:
                data = await reader.read(min(CHUNK, length))
                if not data:
                    raise _Broken("the body ended early")
                length -= len(data)
                await send(data)
        elif kind == "chunked":
            while True:
                line = await reader.readuntil(b"\r\n")
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise _Broken("a bad chunk size") from None
                await send(line)
                if size == 0:
                    while True:  # trailers, up to the empty line
                        line = await reader.readuntil(b"\r\n")
                        await send(line)
                        if line == b"\r\n":
                            return
                while size > 0:
                    data = await reader.read(min(CHUNK, size))
                    if not data:
                        raise _Broken("a chunk ended early")
                    size -= len(data)
                    await send(data)
                await send(await reader.readexactly(2))
        elif until_eof:
            while data := await reader.read(CHUNK):
                await send(data)

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes | None:
        """One message head, or None when the peer closed between messages."""
        try:
            return await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise _Broken("the peer hung up mid-head") from None
            return None

    async def _answer_error(
        self, writer: asyncio.StreamWriter, f: Faults, *, close: bool, status: int | None = None
    ) -> None:
        code = status or f.error_status
        body = f.error_body.encode() if status is None else b"upstream unreachable\n"
        try:
            phrase = http.HTTPStatus(code).phrase
        except ValueError:
            phrase = "Fault"
        closing = "connection: close\r\n" if close else ""
        head = (
            f"HTTP/1.1 {code} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\n{closing}\r\n"
        ).encode()
        await self._send(writer, head + body, "bytes_to_client")

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await self._read_head(reader)
                if head is None:
                    return
                start, headers = _parse_head(head)
                if len(start) != 3 or not start[2].startswith(b"HTTP/1."):
                    raise _Broken("not an HTTP/1.x request")
                method, version = start[0], start[2]
                self._counters.requests += 1
                self._arrivals.add(time.monotonic())
                connection = _tokens(headers.get(b"connection", b""))
                client_close = b"close" in connection or (
                    version == b"HTTP/1.0" and b"keep-alive" not in connection
                )
                framing = _framing(headers)
                f = self._faults
                fate = self._fate(f)
                if fate == "reset":
                    _reset(writer)
                    return
                if fate == "stall":
                    await _silence(reader)
                    return
                delay = self._latency(f)
                if delay > 0.0:
                    await asyncio.sleep(delay)
                if self._draw(f.error_rate, "error"):
                    await self._copy_body(reader, None, framing, "bytes_to_upstream")
                    await self._answer_error(writer, f, close=client_close)
                    if client_close:
                        return
                    continue
                if b"100-continue" in headers.get(b"expect", b"").lower():
                    # Answered here: relaying the upstream's 100 would need a second reader.
                    await self._send(writer, b"HTTP/1.1 100 Continue\r\n\r\n", "bytes_to_client")
                    head = b"\r\n".join(
                        line
                        for line in head.split(b"\r\n")
                        if not line.lower().startswith(b"expect:")
                    )
                if upstream is None:
                    upstream = await self._dial(f)
                    if upstream is None:
                        await self._copy_body(reader, None, framing, "bytes_to_upstream")
                        await self._answer_error(writer, f, close=True, status=502)
                        return
                up_reader, up_writer = upstream
                await self._send(up_writer, head, "bytes_to_upstream")
                await self._copy_body(reader, up_writer, framing, "bytes_to_upstream")
                upstream_close = await self._relay_response(
                    reader, up_reader, writer, method, upstream
                )
                if upstream_close:
                    up_writer.transport.abort()
                    self._writers.discard(up_writer)
                    upstream = None
                if client_close or upstream_close == "eof":
                    return
        finally:
            if upstream is not None:
                upstream[1].transport.abort()
                self._writers.discard(upstream[1])

    async def _relay_response(
        self,
        reader: asyncio.StreamReader,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: bytes,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> str | None:
        """Copy the upstream's answer (interim 1xx included); "close" or "eof" when the
        upstream connection cannot be used again ("eof": nor can the client's)."""
        while True:
            head = await self._read_head(up_reader)
            if head is None:
                raise _Broken("the upstream closed without answering")
            start, headers = _parse_head(head)
            try:
                status = int(start[1])
            except (IndexError, ValueError):
                raise _Broken("not an HTTP status line") from None
            await self._send(writer, head, "bytes_to_client")
            if status == 101:  # an upgrade: bytes both ways from here on
                await self._tunnel(reader, writer, upstream)
                return "eof"
            if 100 <= status < 200:
                continue
            if method == b"HEAD" or status in (204, 304):
                framing: tuple[str, int] = ("none", 0)
            else:
                framing = _framing(headers)
            until_eof = framing[0] == "none" and method != b"HEAD" and status not in (204, 304)
            await self._copy_body(
                up_reader, writer, framing, "bytes_to_client", until_eof=until_eof
            )
            if until_eof:
                return "eof"
            if b"close" in _tokens(headers.get(b"connection", b"")):
                return "close"
            return None

    async def _tunnel(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        """After a 101: bytes both ways, unparsed, until both sides are done."""

        async def copy(
            source: asyncio.StreamReader,
            sink: asyncio.StreamWriter,
            counter: Literal["bytes_to_upstream", "bytes_to_client"],
        ) -> None:
            while data := await source.read(CHUNK):
                await self._send(sink, data, counter)
            if sink.can_write_eof():
                sink.write_eof()

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(copy(reader, upstream[1], "bytes_to_upstream"))
                group.create_task(copy(upstream[0], writer, "bytes_to_client"))
        except* (OSError, EOFError):
            pass  # one side went away: both are closed by the caller

    # -- control endpoint ---------------------------------------------------------------------

    async def _serve_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            status, answer = await self._control_request(reader)
            body = (json.dumps(answer, sort_keys=True) + "\n").encode()
            phrase = http.HTTPStatus(status).phrase
            writer.write(
                f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, EOFError, asyncio.LimitOverrunError, _Broken, asyncio.CancelledError):
            pass  # as in _accept
        finally:
            writer.transport.abort()
            if task is not None:
                self._tasks.discard(task)

    async def _control_request(self, reader: asyncio.StreamReader) -> tuple[int, Any]:
        head = await self._read_head(reader)
        if head is None:
            raise _Broken("no request")
        start, headers = _parse_head(head)
        if len(start) != 3:
            raise _Broken("not an HTTP request")
        method, path = start[0].decode(), start[1].decode().split("?")[0]
        kind, length = _framing(headers)
        if kind != "length" and method in ("PUT", "POST"):
            return 411, {"error": "send the JSON body with a content-length"}
        if length > CONTROL_BODY:
            return 413, {"error": f"at most {CONTROL_BODY} bytes"}
        body = await reader.readexactly(length) if kind == "length" else b""
        if path == "/stats" and method == "GET":
            return 200, self.stats().as_dict()
        if path == "/arrivals" and method == "GET":
            return 200, self.arrivals()
        if path == "/faults" and method == "GET":
            return 200, self._faults.as_dict()
        if path == "/faults" and method in ("PUT", "POST"):
            try:
                values = json.loads(body or b"{}")
                if not isinstance(values, dict):
                    raise FaultsError("the body must be a JSON object of fault settings")
                faults = Faults.from_mapping(values)
                self._check(faults)
            except (ValueError, FaultsError) as e:
                return 400, {"error": str(e)}
            self.set_faults(faults)
            return 200, faults.as_dict()
        if path in ("/faults", "/stats", "/arrivals"):
            return 405, {"error": f"{method} {path} is not supported"}
        return 404, {"error": "known: GET /stats, GET /arrivals, GET /faults, PUT /faults"}
