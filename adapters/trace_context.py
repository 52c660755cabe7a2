"""The trace an upstream call belongs to, as the upstream sees it: the W3C `traceparent` header of
the current span, through the OpenTelemetry API (nothing is sent while there is no span, e.g. with
tracing off and no `traceparent` from the client, nor once the entry point turned propagation off:
`tracing.propagate_to_upstreams`)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_TRACEPARENT = TraceContextTextMapPropagator()
_propagating = True  # process-wide, as OpenTelemetry's own propagators are; set by `propagate_to_upstreams`


def propagate_to_upstreams(on: bool) -> None:
    """Whether upstream calls carry `traceparent` from now on (the entry point sets it once, from
    `tracing.propagate_to_upstreams`)."""
    global _propagating
    _propagating = on


def trace_params() -> dict[str, dict[str, str]]:
    """litellm's `extra_headers` that make the upstream's own spans children of the current one
    (W3C traceparent); {} outside a trace or with propagation off. A client's `tracestate` and
    `baggage` are never passed on: they are its own vendors' data, not the upstream's."""
    if not _propagating:
        return {}
    headers: dict[str, str] = {}
    _TRACEPARENT.inject(headers)
    headers.pop("tracestate", None)
    return {"extra_headers": headers} if headers else {}


def note_failed_attempt(failure: str, error: BaseException) -> None:
    """Record on the current span (the upstream call's) that one attempt failed and why: a retry follows
    unless it was the last."""
    trace.get_current_span().add_event("upstream.attempt_failed", {"failure": failure,
                                                                   "error.type": type(error).__name__})
