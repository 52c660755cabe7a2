"""Spans opened below the observability layer (a hand-off, an escalation): through the OpenTelemetry
API alone, so they cost next to nothing until `python -m gateway serve` configures tracing
(gateway/observability/tracing.py), and the decoding code needs nothing from the layers above it."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext
from opentelemetry.util.types import AttributeValue

TRACER = trace.get_tracer("gateway")
REQUEST_ID = "gateway.request_id"  # the attribute every span of a request carries
R = TypeVar("R")
Outcome = Callable[[Any], Mapping[str, AttributeValue]]


def traced(name: str, outcome: Outcome | None = None) -> Callable[[Callable[..., Awaitable[R]]],
                                                                Callable[..., Awaitable[R]]]:
    """Decorate an async function: each call runs in a span `name`, a child of the current span;
    `outcome(result)` gives attributes read from what the call returned. An exception is recorded
    on the span (its status an error) and raised on."""

    def decorate(func: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        @functools.wraps(func)
        async def call(*args: Any, **kwargs: Any) -> R:
            with TRACER.start_as_current_span(name) as span:
                result = await func(*args, **kwargs)
                if outcome is not None and span.is_recording():
                    span.set_attributes(outcome(result))
                return result

        return call

    return decorate


def wrote(got: Any) -> dict[str, AttributeValue]:
    """The attributes of what a hand-off or an escalation wrote (a decoding `Written`; None: the step
    was decoded locally instead)."""
    if got is None:
        return {"gateway.handoff.source": "local"}
    return {"gateway.handoff.source": got.source, "gateway.handoff.chars": len(got.text),
            "gateway.handoff.finished": got.finished}


def request_trace() -> SpanContext | None:
    """The current request's span, for work it leaves to finish later (None outside a trace)."""
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def later_span(name: str, request: SpanContext | None,
               attributes: Mapping[str, AttributeValue]) -> AbstractContextManager[Span]:
    """A span `name` of work a request left behind (a shadow call), a child of that request's span
    `request` though the request has ended, so the work shows in the request's trace."""
    parent = trace.set_span_in_context(trace.NonRecordingSpan(request)) if request is not None else None
    return TRACER.start_as_current_span(name, parent, attributes=attributes)
