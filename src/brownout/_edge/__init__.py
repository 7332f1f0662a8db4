"""The edge: where a request enters a service (D2, D3, D5, S2, S3, S4, S6, S7, O3, O4).

`EdgePolicy` is the framework-free half of the inbound path; the adapters in
`brownout.integrations` (ASGI, grpc.aio, aiohttp) translate a framework's request into it and
its decisions back into the framework's responses. For one request the edge:

1. starts the stopwatch when it first sees the request, and resolves the budget with the route's
   `InboundDeadlinePolicy` (trusted / signed / untrusted sources, route default and maximum);
2. classifies the request (priority, caller, operation). A priority header is honoured only from
   a trusted source (S4); a user-chosen classifier, which runs after authentication, has the
   last word. The operation is the route template, never the raw path (bounded labels);
3. checks the optional quota hook (429 for ``Reason.QUOTA``; or, with
   ``on_quota_exceeded="demote"``, lets the caller use *idle* capacity at ``SHEDDABLE``, S5);
4. admits through the route's bulkhead (503 with the bulkhead's reason when refused);
5. runs the handler inside ``brownout.request(...)`` so the deadline, priority, caller and
   operation follow the work; at expiry the handler is cancelled (504 if no response started).

Refusals are cheap: the RFC 9457 problem bodies are rendered once per reason, ``Retry-After``
is sent only when there is an estimate and is jittered upwards so callers do not return
together. `SlowedRejections` optionally holds refusals until about the median success latency
(S6) with one loop timer for all of them.

Events: a `Bulkhead` reports the whole lifecycle of the work it admits (offered, queued,
admitted, shed, completed, failed, abandoned, expired), so on a route with a bulkhead the edge
adds only what the bulkhead cannot see: refusals that never reached it (quota) and that a 5xx
response was a failure (through the permit). On a route without a bulkhead the edge reports
the lifecycle itself, with latency from its own stopwatch. Health and readiness paths bypass
admission and produce no events.

The package, one idea per module: `protocols` (who is asking, and the hooks the edge calls),
`routes` (per-route policy), `refusals` (problem bodies, headers, trailers, the HTTP and gRPC
status tables), `slowed` (S6), `flight` (one request in flight, and the sweep), `express`
(the fast path's plan and scope) and `policy` (`EdgePolicy` and its general path, `serve`).
"""

from .._propagation import Repeated
from .connections import serve_connection
from .express import BUDGET_BYTES, EXPRESS_HEADERS, Express, ExpressScope
from .flight import ABANDONED, ANSWERED, Abandoned, Answered, Flight, Sweeper, expire
from .policy import EdgePolicy, header_getter, header_value, metadata_getter, one_value
from .protocols import (
    ActiveModes,
    Classification,
    QuotaAnswer,
    QuotaCheck,
    RequestClassifier,
    TrustSource,
)
from .refusals import (
    DEFAULT_DO_NOT_RETRY,
    DETAILS,
    GRPC_CODE_FOR_STATUS,
    PROBLEM_CONTENT_TYPE,
    STATUS_FOR_GRPC_CODE,
    Refusal,
    announced_modes,
    grpc_code_for_status,
    problem_body,
    ratelimit_headers,
    refusal_headers,
    refusal_trailers,
    retry_after_window,
)
from .routes import UNMATCHED, ResolvedRoute, Route, compile_template
from .slowed import SlowedRejections

__all__ = [
    "ABANDONED",
    "ANSWERED",
    "BUDGET_BYTES",
    "DEFAULT_DO_NOT_RETRY",
    "DETAILS",
    "EXPRESS_HEADERS",
    "GRPC_CODE_FOR_STATUS",
    "PROBLEM_CONTENT_TYPE",
    "STATUS_FOR_GRPC_CODE",
    "UNMATCHED",
    "Abandoned",
    "ActiveModes",
    "Answered",
    "Classification",
    "EdgePolicy",
    "Express",
    "ExpressScope",
    "Flight",
    "QuotaAnswer",
    "QuotaCheck",
    "Refusal",
    "Repeated",
    "RequestClassifier",
    "ResolvedRoute",
    "Route",
    "SlowedRejections",
    "Sweeper",
    "TrustSource",
    "announced_modes",
    "compile_template",
    "expire",
    "grpc_code_for_status",
    "header_getter",
    "header_value",
    "metadata_getter",
    "one_value",
    "problem_body",
    "ratelimit_headers",
    "refusal_headers",
    "refusal_trailers",
    "retry_after_window",
    "serve_connection",
]
