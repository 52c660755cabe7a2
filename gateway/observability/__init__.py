"""Metrics and request logs: a Prometheus registry per app, one log line per request (gateway/logs.py
formats them).

Every app gets its own `Metrics` (its own CollectorRegistry), so several apps can live in one
process (tests) without clashing. Labels are deliberately few and bounded: `endpoint` (an API
route's template, `/v1/responses/{response_id}`, never the path a client sent) and `method` (one
that route serves), `alias` (a configured alias name, or "unknown"), `status` (the HTTP status
class), `source` (local/upstream/cache) and `reason` (an error code, a `usage.routing.degraded`
reason, or the kind of field that sent a request through: `tool_result`, never
`messages[41].role`). Tenant ids, keys and prompt text never become labels (one exception: the
shadow answers' series, gateway/shadow/metrics.py, carry `tenant` while the gateway has at most
`shadow.tenant_labels` tenants), and neither keys nor
prompts are logged: log lines carry ids, counts and timings only, and a last-resort filter masks
anything that looks like a bearer key.

The decoder stays free of metrics code: `metered(admitted)` wraps its piece stream, and
`MeteredUpstream` gives each alias's decoder continuations that time and count real calls (the
runtime builds them with `metered_calls(metrics)`), each in a span (tracing.py: the request's span,
and its admission and decoding).

One concept a module: registry.py (the metrics and scrape-time collectors), requests.py (the
middleware, one log line and the counts per request, /metrics), answers.py (what an answer or a
pass-through counts), upstream_calls.py (hand-offs counted under their alias), tracing.py (spans),
tracing_provider.py (exporting them: imported by the entry point only).
"""

from gateway.observability.answers import count_passthrough, metered
from gateway.observability.registry import Metrics
from gateway.observability.requests import error_reason, install, note_model
from gateway.observability.upstream_calls import MeteredUpstream, metered_calls

__all__ = ["Metrics", "MeteredUpstream", "count_passthrough", "error_reason", "install", "metered", "metered_calls",
           "note_model"]
