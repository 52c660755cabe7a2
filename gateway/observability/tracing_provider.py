"""The process's OpenTelemetry tracer provider: spans stamped with their request id, sampled at
`tracing.sample_ratio` (a client's `traceparent` decides only with `tracing.follow_client_sampling`)
and exported over OTLP/HTTP.
Only the entry point (and tests) import this module: it loads the SDK, which a gateway without
tracing never needs."""

from __future__ import annotations

import random
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased

from adapters.trace_context import propagate_to_upstreams
from gateway.logs import request_id_var
from gateway.settings.tracing import TracingSettings
from gateway.traced import REQUEST_ID


class RequestIds(SpanProcessor):
    """Stamps every span with the id of the request it was started under (`x-request-id`)."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        request_id = request_id_var.get()
        if request_id:
            span.set_attribute(REQUEST_ID, request_id)


def tracer_provider(settings: TracingSettings, processor: SpanProcessor | None = None) -> TracerProvider:
    """A provider whose spans carry the request id and go to `processor` (default: batched to the
    settings' OTLP endpoint)."""
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              sampler=sampler(settings))
    provider.add_span_processor(RequestIds())
    provider.add_span_processor(processor or _otlp(settings))
    return provider


def sampler(settings: TracingSettings) -> Sampler:
    """Which traces are kept: `sample_ratio` of them by trace id, a client's continued trace too
    (its sampled flag is a request, which any client could set) unless `follow_client_sampling`;
    a span within the gateway follows its parent's decision."""
    ratio = TraceIdRatioBased(settings.sample_ratio)
    if settings.follow_client_sampling:
        return ParentBased(ratio)
    drawn = DrawnRatio(settings.sample_ratio)  # a client chooses its trace id: by id it could pick to be kept
    return ParentBased(ratio, remote_parent_sampled=drawn, remote_parent_not_sampled=drawn)


class DrawnRatio(Sampler):
    """Keeps `ratio` of traces by a random draw, whatever their trace id."""

    def __init__(self, ratio: float) -> None:
        self._ratio = ratio

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
        kept = random.random() < self._ratio
        parent = trace.get_current_span(parent_context).get_span_context()
        return SamplingResult(Decision.RECORD_AND_SAMPLE if kept else Decision.DROP, attributes if kept else None,
                              parent.trace_state)

    def get_description(self) -> str:
        return f"DrawnRatio{{{self._ratio}}}"


def start_tracing(settings: TracingSettings) -> TracerProvider | None:
    """Send the process's spans to the configured collector; None (and no provider set) when tracing
    is off. Whether upstream calls carry `traceparent` is set either way (a client's trace reaches
    them even with tracing off). OpenTelemetry's provider is process-wide and set once: the entry
    point calls this, and shuts the provider down (flushing what is batched) as it exits."""
    propagate_to_upstreams(settings.propagate_to_upstreams)
    if not settings.enabled:
        return None
    provider = tracer_provider(settings)
    trace.set_tracer_provider(provider)
    return provider


def _otlp(settings: TracingSettings) -> SpanProcessor:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # protobuf: only if used

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint, headers=settings.headers,
                                               timeout=settings.timeout_s))
