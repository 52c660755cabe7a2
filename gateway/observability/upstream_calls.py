"""Upstream calls counted and timed under the alias that made them, each in a span: each alias's
decoder hands off through a `MeteredUpstream` around the shared upstream, which the runtime builds
with the observer `metered_calls` gives it (gateway.runtime.Runtime.start)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import httpx
from opentelemetry.trace import SpanKind

from adapters.pricing import Prices
from adapters.upstream import Continuation, Handoff, Upstream
from gateway.observability.registry import Metrics
from gateway.traced import TRACER

if TYPE_CHECKING:
    from gateway.runtime import UpstreamObserver

UPSTREAM_CALL = "gateway.upstream_call"


def metered_calls(metrics: Metrics) -> UpstreamObserver:
    """The observer the runtime builds each alias's continuations with (gateway.runtime.UpstreamObserver):
    every real call counted and timed under the alias, in a span of its own."""
    return lambda alias, upstream: MeteredUpstream(upstream, metrics, alias)


class MeteredUpstream:
    """An upstream's continuations (adapters.upstream.Continuations) with each real call counted
    and timed under one alias; everything else is the upstream's own answer."""

    def __init__(self, inner: Upstream, metrics: Metrics, alias: str) -> None:
        self.inner, self._metrics, self._alias = inner, metrics, alias

    @property
    def available(self) -> bool:
        return self.inner.available

    @property
    def warms(self) -> bool:
        return self.inner.warms

    @property
    def worst_case_s(self) -> float:
        return self.inner.worst_case_s

    @property
    def read_ahead(self) -> int:
        return self.inner.read_ahead

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool = False, scope: str = "shared") -> Handoff:
        return self.inner.handoff(messages, continue_final, scope)

    def text_handoff(self, prompt: str, scope: str = "shared") -> Handoff | None:
        return self.inner.text_handoff(prompt, scope)

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        return self.inner.with_answer(handoff, answer)

    def cache_key(self, handoff: Handoff, max_tokens: int, scope: str) -> str:
        return self.inner.cache_key(handoff, max_tokens, scope)

    def estimate_prompt_tokens(self, handoff: Handoff) -> int:
        return self.inner.estimate_prompt_tokens(handoff)

    def estimate_completion_tokens(self, handoff: Handoff, span: int) -> int:
        return self.inner.estimate_completion_tokens(handoff, span)

    @property
    def prices(self) -> Prices:
        return self.inner.prices

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        return self.inner.estimate_cost(prompt_tokens, completion_tokens, cached_tokens)

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict[str, Any] | None = None, ahead: int = 0) -> Continuation:
        m, alias = self._metrics, self._alias
        with TRACER.start_as_current_span(UPSTREAM_CALL, kind=SpanKind.CLIENT) as span:
            span.set_attributes(self._call_attributes(max_tokens))
            call = self.inner.continue_text(handoff, max_tokens, temperature, top_p, seed, extra, ahead)
            if not self.inner.available:
                m.upstream_errors.labels(alias, "circuit_open").inc()
                return await call  # raises UpstreamUnavailable
            m.upstream_calls.labels(alias).inc()
            started = time.perf_counter()
            try:
                continuation = await call
            except Exception as exc:
                m.upstream_errors.labels(alias, _upstream_failure(exc)).inc()
                raise
            m.upstream_latency.labels(alias).observe(time.perf_counter() - started)
            self._count(continuation)
            span.set_attributes(_outcome(continuation))
            return continuation

    def _call_attributes(self, max_tokens: int) -> dict[str, Any]:
        settings = self.inner.settings
        return {"gateway.alias": self._alias, "gateway.upstream": self.inner.name, "gateway.upstream.mode": settings.mode,
                "gateway.upstream.model": settings.model, "gateway.upstream.max_tokens": max_tokens,
                "gateway.upstream.breaker": "closed" if self.inner.available else "open"}

    def _count(self, continuation: Continuation) -> None:
        m, alias = self._metrics, self._alias
        m.upstream_prompt_tokens.labels(alias).inc(continuation.prompt_tokens)
        m.upstream_completion_tokens.labels(alias).inc(continuation.completion_tokens)
        m.upstream_cached_tokens.labels(alias).inc(continuation.cached_tokens)
        m.upstream_compute.labels(alias).inc((continuation.compute_ms or 0.0) / 1000)
        m.upstream_cost.labels(alias).inc(continuation.cost_usd)


def _outcome(continuation: Continuation) -> dict[str, Any]:
    return {"gateway.upstream.prompt_tokens": continuation.prompt_tokens,
            "gateway.upstream.completion_tokens": continuation.completion_tokens,
            "gateway.upstream.cached_tokens": continuation.cached_tokens,
            "gateway.upstream.cost_usd": continuation.cost_usd, "gateway.upstream.finished": continuation.finished}


def _upstream_failure(exc: BaseException) -> str:
    import openai  # only on failures: importing it costs the CLI most of a second

    if getattr(exc, "reason", None) == "upstream_rejected":
        return "rejected"
    cause = exc.__cause__ or exc
    timeouts = (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException, openai.APITimeoutError)
    return "timeout" if isinstance(cause, timeouts) else "error"
