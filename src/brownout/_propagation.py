"""Carrying the remaining time (and request metadata) between services (D2, D3).

Budgets travel as *durations*, never as wall-clock instants, so clock skew between machines
does not matter. Four codecs live here:

- gRPC ``grpc-timeout``, exactly as the gRPC-over-HTTP/2 spec says (1 to 8 ASCII digits and a
  unit H, M, S, m, u or n);
- ``brownout-budget-ms``: the remaining budget in integer milliseconds, for HTTP inside the
  platform (trusted); Envoy's ``x-envoy-expected-rq-timeout-ms`` can be read inbound too;
- ``brownout-signed-budget``: the budget signed with HMAC-SHA256 for crossing a trust boundary,
  bound to the service it is for;
- the outbound header set: budget minus reserve, priority, idempotency key and attempt.

Every parser raises only `HeaderError`. `InboundDeadlinePolicy` turns what arrived into the
deadline a request gets: clamped to the route maximum, malformed values ignored and reported as
events, never raised into the application.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import hmac
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from ._clock import now
from ._context import RequestContext, current
from ._errors import HeaderError
from ._priority import Priority
from .events import DeadlineHeaderIgnored, EventHub, hub

__all__ = [
    "ATTEMPT_HEADER",
    "BUDGET_HEADER",
    "DO_NOT_RETRY_VALUE",
    "ENVOY_TIMEOUT_HEADER",
    "GRPC_PUSHBACK_KEY",
    "GRPC_TIMEOUT_HEADER",
    "IDEMPOTENCY_HEADER",
    "PRIORITY_HEADER",
    "REFUSAL_REASON_KEY",
    "RETRY_HEADER",
    "SIGNED_BUDGET_HEADER",
    "BudgetSigner",
    "InboundBudget",
    "InboundDeadlinePolicy",
    "OutboundHook",
    "Repeated",
    "Trust",
    "add_outbound_hook",
    "bind_idempotency_key",
    "context_headers",
    "decode_attempt",
    "decode_budget_ms",
    "decode_grpc_timeout",
    "decode_idempotency_key",
    "encode_budget_ms",
    "encode_grpc_timeout",
    "header_values",
    "note_outbound",
    "outbound_headers",
    "remove_outbound_hook",
]

BUDGET_HEADER = "brownout-budget-ms"
"""Remaining budget in integer milliseconds; trusted only inside the platform."""
SIGNED_BUDGET_HEADER = "brownout-signed-budget"
"""``v2.<key id>.<audience>.<budget ms>.<issued unix ms>.<base64url HMAC-SHA256>``, or without
an audience ``v1.<key id>.<budget ms>.<issued unix ms>.<base64url HMAC-SHA256>``."""
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
GRPC_TIMEOUT_HEADER = "grpc-timeout"
PRIORITY_HEADER = "brownout-priority"
ATTEMPT_HEADER = "brownout-attempt"
IDEMPOTENCY_HEADER = "idempotency-key"
RETRY_HEADER = "brownout-retry"
"""Set to `DO_NOT_RETRY_VALUE` on a response that callers must not retry (R1)."""
DO_NOT_RETRY_VALUE = "never"
GRPC_PUSHBACK_KEY = "grpc-retry-pushback-ms"
"""gRPC trailing metadata: milliseconds to wait before retrying; negative means do not retry."""
REFUSAL_REASON_KEY = "brownout-reason"
"""gRPC trailing metadata naming an edge refusal's reason; clients read it as "refused, not
run"."""

# -- grpc-timeout ----------------------------------------------------------------------------

_GRPC_UNITS: tuple[tuple[str, int], ...] = (
    ("n", 1),
    ("u", 1_000),
    ("m", 1_000_000),
    ("S", 1_000_000_000),
    ("M", 60_000_000_000),
    ("H", 3_600_000_000_000),
)
_GRPC_NS = dict(_GRPC_UNITS)
_GRPC_MAX_VALUE = 99_999_999
_GRPC_MAX_SECONDS = _GRPC_MAX_VALUE * 3600
_GRPC_RE = re.compile(rb"[0-9]{1,8}[HMSmun]")


def _floor_scaled(seconds: float, scale: int) -> int:
    """``floor(seconds * scale)`` computed exactly (``seconds`` finite and >= 0): a float
    product can round up to the next integer, e.g. ``0.000436 * 1e9 == 436000.0`` although
    the float ``0.000436`` is 435999.99999999997 ns."""
    num, den = seconds.as_integer_ratio()
    return num * scale // den


def _grpc_seconds(value: int, unit_ns: int) -> float:
    return value * unit_ns / 1_000_000_000  # (int / int: correctly rounded)


def encode_grpc_timeout(seconds: float) -> str:
    """Encode a duration as a ``grpc-timeout`` value in the finest unit that fits 8 digits.

    Values are rounded *down* (a deadline is never extended in transit): the value sent is
    the largest in that unit whose decoding is at most ``seconds``. A non-positive duration
    encodes as ``0n``; anything beyond 99,999,999 hours is capped there.
    """
    if math.isnan(seconds):
        raise HeaderError("cannot encode a NaN timeout")
    if seconds <= 0:
        return "0n"
    if seconds >= _GRPC_MAX_SECONDS:  # (also inf and 1e308, whose nanoseconds overflow)
        return f"{_GRPC_MAX_VALUE}H"
    ns = _floor_scaled(seconds, 1_000_000_000)
    for unit, size in _GRPC_UNITS:
        value = ns // size
        if value <= _GRPC_MAX_VALUE:
            # The exact floor can sit one step below a float that decodes to ``seconds``
            # itself (1.2 is 1.19999999999999996 s): take that step when it does not exceed.
            if value < _GRPC_MAX_VALUE and _grpc_seconds(value + 1, size) <= seconds:
                value += 1
            return f"{value}{unit}"
    return f"{_GRPC_MAX_VALUE}H"  # pragma: no cover - below _GRPC_MAX_SECONDS, H fits


def decode_grpc_timeout(value: str | bytes) -> float:
    """Decode a ``grpc-timeout`` value to seconds; `HeaderError` on anything off-spec."""
    raw = _ascii(value, GRPC_TIMEOUT_HEADER)
    if _GRPC_RE.fullmatch(raw) is None:
        raise HeaderError(f"malformed {GRPC_TIMEOUT_HEADER}: {raw[:40]!r}")
    return _grpc_seconds(int(raw[:-1]), _GRPC_NS[chr(raw[-1])])


# -- integer milliseconds ----------------------------------------------------------------------

_MS_RE = re.compile(rb"[0-9]{1,12}")
_ISSUED_RE = re.compile(rb"[0-9]{1,15}")


def encode_budget_ms(seconds: float) -> str:
    """Encode a remaining budget as integer milliseconds, rounded down, never negative.

    The value sent is the largest whose decoding is at most ``seconds``, so a decoded budget
    re-encodes to itself and what is sent never exceeds what is left.
    """
    if math.isnan(seconds):
        raise HeaderError("cannot encode a NaN budget")
    if seconds <= 0:
        return "0"
    if seconds >= 999_999_999.999:  # the 12-digit cap (also inf and 1e308: no int overflow)
        return "999999999999"
    ms = _floor_scaled(seconds, 1000)
    # The exact floor can sit one below a float that decodes to ``seconds`` itself (1.234 is
    # 1.23399999999999998579 s): take that step when it does not exceed ``seconds``.
    if (ms + 1) / 1000 <= seconds:
        ms += 1
    return str(ms)


def decode_budget_ms(value: str | bytes, header: str = BUDGET_HEADER) -> float:
    """Decode integer milliseconds (1 to 12 ASCII digits) to seconds; `HeaderError` otherwise."""
    raw = _ascii(value, header).strip(b" \t")
    if _MS_RE.fullmatch(raw) is None:
        raise HeaderError(f"malformed {header}: {raw[:40]!r}")
    return int(raw) / 1000


def _ascii(value: str | bytes, header: str) -> bytes:
    if isinstance(value, str):
        try:
            return value.encode("ascii")
        except UnicodeEncodeError:
            raise HeaderError(f"{header} is not ASCII", "not ascii") from None
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    raise HeaderError(f"{header} must be str or bytes, not {type(value).__name__}")


# -- idempotency key and attempt ---------------------------------------------------------------

IDEMPOTENCY_KEY_MAX = 255
"""Longest idempotency key read inbound, in characters (after unquoting)."""
_MAX_ATTEMPT = 1000
_PLAIN_KEY_RE = re.compile(rb"[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]+")
"""The plain token form: visible ASCII without quotes, backslash or comma (a comma is two
values folded into one)."""
_PLAIN_KEY_TEXT = re.compile(_PLAIN_KEY_RE.pattern.decode("ascii"))
_SF_STRING_RE = re.compile(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_SF_ESCAPE_RE = re.compile(rb'\\(["\\])')
_ATTEMPT_RE = re.compile(rb"[0-9]{1,4}")


def decode_idempotency_key(value: str | bytes) -> str:
    """The key of an ``idempotency-key`` value: a structured-field string (``"..."`` of
    printable ASCII, ``\\"`` and ``\\\\`` escaped), as the IETF HTTPAPI draft sends it, or
    the plain token form (visible ASCII without ``"``, ``\\`` or ``,``). At most
    `IDEMPOTENCY_KEY_MAX` characters, not empty; `HeaderError` otherwise."""
    raw = _ascii(value, IDEMPOTENCY_HEADER).strip(b" \t")
    if len(raw) > 2 * IDEMPOTENCY_KEY_MAX + 2:
        raise HeaderError(f"{IDEMPOTENCY_HEADER} longer than {IDEMPOTENCY_KEY_MAX}", "too long")
    if raw[:1] == b'"':
        m = _SF_STRING_RE.fullmatch(raw)
        if m is None:
            raise HeaderError(f"malformed {IDEMPOTENCY_HEADER}: {raw[:40]!r}", "malformed")
        key = _SF_ESCAPE_RE.sub(rb"\1", m.group(1))
    elif _PLAIN_KEY_RE.fullmatch(raw) is not None:
        key = raw
    else:
        raise HeaderError(f"malformed {IDEMPOTENCY_HEADER}: {raw[:40]!r}", "malformed")
    if not key:
        raise HeaderError(f"empty {IDEMPOTENCY_HEADER}", "malformed")
    if len(key) > IDEMPOTENCY_KEY_MAX:
        raise HeaderError(f"{IDEMPOTENCY_HEADER} longer than {IDEMPOTENCY_KEY_MAX}", "too long")
    return key.decode("ascii")


def decode_attempt(value: str | bytes) -> int:
    """A ``brownout-attempt`` value: 1 to 4 ASCII digits, from 1 to 1000; `HeaderError`
    otherwise."""
    raw = _ascii(value, ATTEMPT_HEADER).strip(b" \t")
    if _ATTEMPT_RE.fullmatch(raw) is None or not 1 <= int(raw) <= _MAX_ATTEMPT:
        raise HeaderError(f"malformed {ATTEMPT_HEADER}: {raw[:40]!r}", "malformed")
    return int(raw)


def bind_idempotency_key(caller: str, key: str) -> str:
    """The key ``caller`` sent, bound to that caller (I1): what the edge puts in the request
    context, forwards downstream, and what servers store under. The same caller and key give
    the same bound key on every attempt and every instance; another caller's same key gives
    another, so one caller can neither collide with nor replay another's. 43 characters
    ``[A-Za-z0-9_-]`` (SHA-256, base64url), a valid plain-form key in turn: each hop binds
    what it got to its own caller."""
    who = caller.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(
        b"brownout-idempotency-v1\x00%d\x00%s\x00%s"
        % (len(who), who, key.encode("utf-8", "surrogatepass"))
    ).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


# -- signed budgets ----------------------------------------------------------------------------


def _mac_text(mac: bytes) -> bytes:
    """A MAC as unpadded base64url, the only form a signed budget carries it in."""
    return base64.urlsafe_b64encode(mac).rstrip(b"=")


_AUDIENCE_RE = re.compile(r"[A-Za-z0-9._~:/@+-]{1,255}")


def _check_audience(audience: str) -> bytes:
    if not isinstance(audience, str) or _AUDIENCE_RE.fullmatch(audience) is None:
        raise ValueError(
            f"audience {audience!r} must be 1 to 255 of the characters A-Z a-z 0-9 . _ ~ : / @ + -"
        )
    return audience.encode("ascii")


class BudgetSigner:
    """Signs and verifies budgets that cross a trust boundary (HMAC-SHA256, D3).

    ``keys`` maps key ids to secrets. The first key signs; every key verifies, so keys can be
    rotated by adding the new one, moving it first, then removing the old one. The signature
    covers the budget and the issue time (wall clock, used *only* to bound replay, never to
    measure the budget); a value older or newer than ``skew_tolerance`` seconds is refused.

    ``audience`` names the service the budgets are for, and the signature covers it too
    (format ``v2``), so a budget signed for one service is refused by another that shares the
    key. A receiver sets its own name and then accepts only ``v2`` budgets for that name (an
    unbound ``v1`` is refused); a caller signs for its callee with
    ``signer.for_audience("billing")``. Without an audience, ``sign`` issues ``v1`` and
    ``verify`` checks no audience: it accepts ``v1`` and ``v2`` for any audience (the step
    between upgrading and naming receivers).
    """

    def __init__(
        self,
        keys: Mapping[str, bytes],
        *,
        audience: str | None = None,
        skew_tolerance: float = 5.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not keys:
            raise ValueError("BudgetSigner needs at least one key")
        for kid, secret in keys.items():
            if not kid or "." in kid or not kid.isascii():
                raise ValueError(f"key id {kid!r} must be non-empty ASCII without '.'")
            if len(secret) < 16:
                raise ValueError(f"the secret for key {kid!r} is shorter than 16 bytes")
        self._keys = {kid.encode("ascii"): secret for kid, secret in keys.items()}
        self._signing_kid = next(iter(keys))
        self._audience = None if audience is None else _check_audience(audience)
        if not skew_tolerance >= 0:  # (NaN would accept a value of any age: no replay bound)
            raise ValueError("skew_tolerance must be >= 0")
        self.skew_tolerance = skew_tolerance
        self._wall = wall_clock

    @property
    def audience(self) -> str | None:
        """The service the budgets are for, or ``None`` (unbound, ``v1``)."""
        return None if self._audience is None else self._audience.decode("ascii")

    def for_audience(self, audience: str) -> BudgetSigner:
        """The same keys, skew tolerance and clock, signing and verifying for ``audience``."""
        bound = copy.copy(self)
        bound._audience = _check_audience(audience)
        return bound

    @staticmethod
    def _mac(secret: bytes, message: bytes) -> bytes:
        return hmac.new(secret, message, hashlib.sha256).digest()

    def sign(self, seconds: float) -> str:
        """The header value for a budget of ``seconds``, bound to `audience` if it is set."""
        ms = encode_budget_ms(seconds)
        issued = int(self._wall() * 1000)
        kid = self._signing_kid
        if self._audience is None:
            message = f"v1.{kid}.{ms}.{issued}".encode("ascii")
        else:
            message = b"v2.%s.%s.%s.%d" % (kid.encode("ascii"), self._audience, ms.encode(), issued)
        secret = self._keys[kid.encode("ascii")]
        return f"{message.decode('ascii')}.{_mac_text(self._mac(secret, message)).decode()}"

    def verify(self, value: str | bytes) -> float:
        """The budget in seconds if the value is authentic, fresh and for this signer's
        audience (when it has one); `HeaderError` otherwise."""
        raw = _ascii(value, SIGNED_BUDGET_HEADER)
        parts = raw.split(b".")
        audience: bytes | None
        if parts[0] == b"v1" and len(parts) == 5:
            audience = None
        elif parts[0] == b"v2" and len(parts) >= 6:
            # The audience may hold dots: every other field is dot-free, so it is what lies
            # between the key id and the last three fields.
            audience = b".".join(parts[2:-3])
        else:
            raise HeaderError(f"malformed {SIGNED_BUDGET_HEADER}")
        kid = parts[1]
        ms, issued, sig = parts[-3:]
        secret = self._keys.get(kid)
        if secret is None:
            raise HeaderError(f"unknown signing key id {kid[:20]!r}", "unknown key")
        # Compare the text, not what a decoder makes of it: base64 decoders drop characters
        # outside the alphabet, take "+/" for "-_", padding and other trailing bits, so
        # many texts decode to one MAC. Only the one canonical text verifies (the MAC's
        # length is public, so comparing texts of different lengths leaks nothing).
        expected = _mac_text(self._mac(secret, raw[: len(raw) - len(sig) - 1]))
        if not hmac.compare_digest(expected, sig):
            raise HeaderError("bad signature", "bad signature")
        if self._audience is not None:
            if audience is None:
                raise HeaderError("a v1 signed budget binds no audience", "no audience")
            if audience != self._audience:
                raise HeaderError(f"signed budget for audience {audience[:40]!r}", "wrong audience")
        if _ISSUED_RE.fullmatch(issued) is None or _MS_RE.fullmatch(ms) is None:
            raise HeaderError(f"malformed {SIGNED_BUDGET_HEADER}")
        age = self._wall() - int(issued) / 1000
        if abs(age) > self.skew_tolerance:
            raise HeaderError(
                f"signed budget issued {age:.1f}s away from now (replay or skew)", "stale"
            )
        return int(ms) / 1000


# -- inbound policy ----------------------------------------------------------------------------


class Trust(StrEnum):
    """How far an inbound request's headers are believed."""

    TRUSTED = "trusted"
    """Inside the platform: plain budget headers are honoured (still clamped)."""
    SIGNED = "signed"
    """Across a trust boundary: only a valid signed budget is honoured."""
    UNTRUSTED = "untrusted"
    """A public client: a budget header may only *shorten* the route maximum."""


class InboundBudget(NamedTuple):
    """The budget a request gets: ``seconds``, where it came from, and whether it was clamped."""

    seconds: float
    origin: str
    clamped: bool


class Repeated(tuple[str | bytes, ...]):
    """The distinct values of a header that arrived more than once with different values, in
    the order they came: what the edge's header getters return for it (the one value when a
    header came once, or repeated the same). Each reader decides what several values mean
    (docs/deadlines.md, "Repeated headers"): of budgets, the shortest valid one wins; a
    priority claim with differing values is ignored."""

    __slots__ = ()


HeaderGetter = Callable[[str], "str | bytes | Repeated | None"]


def header_values(raw: str | bytes | Repeated | None) -> tuple[str | bytes, ...]:
    """Every value a header getter returned: none, one, or each of a `Repeated`."""
    if raw is None:
        return ()
    if isinstance(raw, Repeated):
        return tuple(raw)
    return (raw,)


def _budget_values(raw: str | bytes | Repeated) -> list[str | bytes]:
    """The values of a budget header, a comma-separated list (a proxy folding repeated
    fields into one) counted as that many values."""
    out: list[str | bytes] = []
    for value in header_values(raw):
        if isinstance(value, str) and "," in value:
            out.extend(value.split(","))
        elif isinstance(value, bytes | bytearray) and b"," in value:
            out.extend(bytes(value).split(b","))
        else:
            out.append(value)
    return out


@dataclass(frozen=True)
class InboundDeadlinePolicy:
    """Decides an inbound request's budget from its headers and how far they are trusted.

    - no usable header: ``default`` seconds;
    - a header: its value, clamped to ``maximum`` (an untrusted 60 s header never gets more);
      several values (a header repeated, or a comma-separated list): the shortest valid one;
    - a malformed, unsigned-where-signature-needed, or forged value: ignored (the default
      applies) and reported as a `DeadlineHeaderIgnored` event; never an exception.
    ``honour_untrusted=False`` ignores budget headers from untrusted sources entirely.
    """

    default: float = 10.0
    maximum: float = 30.0
    read_envoy: bool = False
    signer: BudgetSigner | None = None
    honour_untrusted: bool = True
    events: EventHub = field(default=hub, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (0 < self.default <= self.maximum) or math.isinf(self.maximum):
            raise ValueError("need 0 < default <= maximum < inf")

    def clamp(self, seconds: float | None) -> float:
        """``seconds`` capped at ``maximum``, or ``default`` for ``None``. Whether a source may
        set its budget at all is `honours_unsigned`'s to say (`resolve` asks it)."""
        if seconds is None:
            return self.default
        return seconds if seconds < self.maximum else self.maximum

    def honours_unsigned(self, trust: Trust) -> bool:
        """Whether an unsigned budget from a source of this ``trust`` is honoured: the one
        rule for ``brownout-budget-ms``, Envoy's header and a protocol's own deadline (gRPC's
        ``grpc-timeout``): from a trusted source; from an untrusted one unless
        ``honour_untrusted=False``; never across a signed boundary, where only a valid
        signed budget counts."""
        if trust is Trust.TRUSTED:
            return True
        return trust is Trust.UNTRUSTED and self.honour_untrusted

    def resolve(
        self,
        get: HeaderGetter,
        trust: Trust = Trust.UNTRUSTED,
        carried: float | None = None,
    ) -> InboundBudget:
        """The budget for a request whose header values are read with ``get(lower_name)``.
        ``carried``: the deadline the protocol itself carries (gRPC's ``grpc-timeout``, in
        seconds), an unsigned budget like the others: honoured where `honours_unsigned`
        says, the shortest of all honoured values winning (origin ``"protocol"``)."""
        best: float | None = None
        origin = "default"
        # Every value counts on its own and the shortest valid one wins: a header repeated
        # (or folded into a comma-separated list) never buys more time than its shortest
        # value, whichever comes first.
        if trust is Trust.SIGNED:
            raw = get(SIGNED_BUDGET_HEADER)
            if raw is not None:
                if self.signer is None:
                    self._ignored(SIGNED_BUDGET_HEADER, "no signer configured")
                else:
                    for signed in header_values(raw):
                        try:
                            value = self.signer.verify(signed)
                        except HeaderError as e:
                            self._ignored(SIGNED_BUDGET_HEADER, e.problem)
                            continue
                        if best is None or value < best:
                            best, origin = value, "signed"
        elif self.honours_unsigned(trust):
            if carried is not None:
                best, origin = (carried if carried > 0.0 else 0.0), "protocol"
            candidates = (
                [BUDGET_HEADER, ENVOY_TIMEOUT_HEADER] if self.read_envoy else [BUDGET_HEADER]
            )
            for name in candidates:
                raw = get(name)
                if raw is None:
                    continue
                for text in _budget_values(raw):
                    try:
                        value = decode_budget_ms(text, name)
                    except HeaderError as e:
                        self._ignored(name, e.problem)
                        continue
                    if best is None or value < best:
                        best, origin = value, "envoy" if name == ENVOY_TIMEOUT_HEADER else "header"
        if best is None:
            return InboundBudget(self.default, "default", False)
        if best > self.maximum:
            return InboundBudget(self.maximum, origin, True)
        return InboundBudget(best, origin, False)

    def _ignored(self, header: str, problem: str) -> None:
        if self.events.enabled:
            self.events.emit(DeadlineHeaderIgnored(now(), "inbound", header, problem))


# -- outbound ----------------------------------------------------------------------------------


def context_headers(ctx: RequestContext) -> dict[str, str]:
    """Priority, attempt and idempotency key of ``ctx`` as headers or gRPC metadata.

    Defaults are left out (priority ``critical``, attempt 1, no key). A key that is not a
    plain token (a space, a quote, a comma) goes as a structured-field string, the form the
    IETF draft specifies and every edge reads. gRPC clients send these and carry the budget
    in ``grpc-timeout``; HTTP clients use `outbound_headers`.
    """
    headers: dict[str, str] = {}
    if ctx.priority is not Priority.CRITICAL:
        headers[PRIORITY_HEADER] = ctx.priority.label
    if ctx.attempt != 1:
        headers[ATTEMPT_HEADER] = str(ctx.attempt)
    key = ctx.idempotency_key
    if key is not None:
        headers[IDEMPOTENCY_HEADER] = key if _PLAIN_KEY_TEXT.fullmatch(key) else _sf_string(key)
    return headers


def _sf_string(key: str) -> str:
    """``key`` as a structured-field string, when it is printable ASCII (else as it is)."""
    if not (key.isascii() and key.isprintable()):
        return key
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


OutboundHook = Callable[[RequestContext, "float | None"], None]
"""Told of each outbound call's budget: the request context and the seconds sent (``None``:
no deadline). Runs on the call path: it must be cheap and must not raise."""

_outbound_hooks: tuple[OutboundHook, ...] = ()


def add_outbound_hook(hook: OutboundHook) -> None:
    """Have ``hook`` told of every outbound call the bundled clients make (idempotent)."""
    global _outbound_hooks
    if hook not in _outbound_hooks:
        _outbound_hooks = (*_outbound_hooks, hook)


def remove_outbound_hook(hook: OutboundHook) -> None:
    global _outbound_hooks
    _outbound_hooks = tuple(h for h in _outbound_hooks if h != hook)


def note_outbound(ctx: RequestContext, budget: float | None) -> None:
    """Tell the outbound hooks (tracing) the budget a call is sent with."""
    for hook in _outbound_hooks:
        with contextlib.suppress(Exception):  # a broken tracer must not break the call
            hook(ctx, budget)


def outbound_headers(
    *,
    reserve: float = 0.0,
    ctx: RequestContext | None = None,
    signer: BudgetSigner | None = None,
) -> dict[str, str]:
    """Headers for an outbound HTTP call from the request context (D2).

    The budget sent is ``remaining - reserve`` (the caller keeps ``reserve`` for its own
    response path). Priority, attempt and idempotency key ride along; a ``signer`` adds a
    signed budget for a callee outside the trust boundary.
    """
    ctx = ctx if ctx is not None else current()
    headers = context_headers(ctx)
    if ctx.deadline is not None:
        budget = ctx.deadline.remaining()
        if reserve > 0.0:  # (a negative reserve would send more time than is left)
            budget -= reserve
        headers[BUDGET_HEADER] = encode_budget_ms(budget)
        if signer is not None:
            headers[SIGNED_BUDGET_HEADER] = signer.sign(max(budget, 0.0))
        if _outbound_hooks:
            note_outbound(ctx, budget if budget > 0.0 else 0.0)
    elif _outbound_hooks:
        note_outbound(ctx, None)
    return headers
