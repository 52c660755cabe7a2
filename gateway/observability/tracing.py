"""OpenTelemetry traces of requests, through the OpenTelemetry API only (exporting is
tracing_provider.py's, set up by the entry point when `tracing.otlp_endpoint` is set).

FastAPI opens each request's span itself (SERVER, named for its route, a child of the client's W3C
`traceparent` when it sends one) once a tracer provider is set. Within it the middleware's
`gateway.request` carries what the request's log line says, with the spans its record timed:
`gateway.admission` (from the route naming the model to the answer's start) and `gateway.decoding`
(from there to the answer's end, a `first_token` event on it). Opened as they happen:
`gateway.queue_wait` (adapters/engine.py: waiting for a local sequence), `gateway.handoff`
(decoding/handoffs.py) with its `gateway.upstream_call` (CLIENT; upstream_calls.py: mode, tokens,
cached tokens, cost, breaker, each failed attempt as an event), `gateway.escalation`
(decoding/escalation.py: the whole answer asked afresh), `gateway.passthrough` (decoding/passing.py)
and, after the request ended, `gateway.shadow_call` (shadow/service.py). Every span below FastAPI's
made while the request runs carries the request id (`gateway.request_id`, the `x-request-id` the
answer and its log line carry).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from gateway.traced import TRACER

if TYPE_CHECKING:
    from gateway.observability.requests import RequestRecord

REQUEST_SPAN = "gateway.request"


def request_span() -> AbstractContextManager[Span]:
    """The current span while the middleware serves one request: `gateway.request`, a child of
    FastAPI's span for it (which continues the client's `traceparent`)."""
    return TRACER.start_as_current_span(REQUEST_SPAN, record_exception=False, set_status_on_exception=False)


def finish_request(span: Span, record: RequestRecord, fields: Mapping[str, Any], now_ns: int) -> None:
    """Give the request's span what its log line says, and add the admission and decoding spans its
    record timed; nothing while tracing is off."""
    if not span.is_recording():
        return
    span.set_attributes(_flat(fields))
    if record.error is not None and not 400 <= fields["status"] < 500:  # a refusal is the client's, not a fault
        span.set_status(Status(StatusCode.ERROR, record.error))
    _phases(span, record, now_ns)


def _phases(parent: Span, record: RequestRecord, now_ns: int) -> None:
    """`gateway.admission` and `gateway.decoding`, from the times the record noted (none for a
    request passed through whole: it decodes nothing)."""
    if record.admission_ns is None or record.admitted_ns is None or record.summary.get("mode") == "passthrough":
        return
    context = trace.set_span_in_context(parent)
    TRACER.start_span("gateway.admission", context, start_time=record.admission_ns).end(record.admitted_ns)
    decoding = TRACER.start_span("gateway.decoding", context, start_time=record.admitted_ns)
    if record.ttft_s is not None:
        decoding.add_event("first_token", timestamp=record.started_ns + int(record.ttft_s * 1e9))
    decoding.end(now_ns)


def _flat(fields: Mapping[str, Any], prefix: str = "gateway.") -> dict[str, Any]:
    """Log fields as span attributes: nested dicts flattened (`gateway.tokens.local`), None dropped."""
    flat: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, (list, tuple)):
            flat[prefix + key] = [str(item) for item in value]
        elif value is not None:
            flat[prefix + key] = value
    return flat
