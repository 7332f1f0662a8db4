"""Exporters: sinks and collectors that show `brownout.Stats` to operators (O1..O5, S8).

Each exporter is an optional extra and imports its framework only in its own module:

- `brownout.export.prometheus`: a `prometheus_client` collector read at scrape time, and
  helpers that serve ``/metrics`` from an ASGI or aiohttp app (``brownout[prometheus]``).
- `brownout.export.otel`: observable instruments on ``opentelemetry-api`` (``brownout[otel]``).
- `brownout.export.logging`: sampled structured shed logs with interval summaries (stdlib).
- `brownout.export._top`: ``brownout top``, a live terminal view of a service's ``/metrics``.
- `brownout.export._catalog`: the metric names and descriptions the exporters share.
"""
