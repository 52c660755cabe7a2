"""Upstream calls counted and timed under the alias that made them: each alias's decoder hands off
through a `MeteredUpstream` around the shared upstream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import httpx

from adapters.pricing import Prices
from adapters.upstream import Continuation, Handoff, Upstream
from gateway.observability.registry import Metrics

if TYPE_CHECKING:
    from gateway.runtime import Runtime


def instrument(runtime: Runtime, metrics: Metrics) -> None:
    """Meter each alias's hand-offs: its decoder's continuations count and time every call under
    that alias (a runtime reused by a second app counts for the new one)."""
    metrics.runtime = runtime
    for name, alias in list(runtime.aliases.items()):
        if alias.upstream is not None:
            runtime.aliases[name] = dataclasses.replace(
                alias, continuations=MeteredUpstream(alias.upstream, metrics, name))


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

    @property
    def prices(self) -> Prices:
        return self.inner.prices

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        return self.inner.estimate_cost(prompt_tokens, completion_tokens, cached_tokens)

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                            seed: int | None, extra: dict[str, Any] | None = None) -> Continuation:
        m, alias = self._metrics, self._alias
        call = self.inner.continue_text(handoff, max_tokens, temperature, top_p, seed, extra)
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
        m.upstream_prompt_tokens.labels(alias).inc(continuation.prompt_tokens)
        m.upstream_completion_tokens.labels(alias).inc(continuation.completion_tokens)
        m.upstream_cached_tokens.labels(alias).inc(continuation.cached_tokens)
        m.upstream_compute.labels(alias).inc((continuation.compute_ms or 0.0) / 1000)
        m.upstream_cost.labels(alias).inc(continuation.cost_usd)
        return continuation


def _upstream_failure(exc: BaseException) -> str:
    import openai  # only on failures: importing it costs the CLI most of a second

    if getattr(exc, "reason", None) == "upstream_rejected":
        return "rejected"
    cause = exc.__cause__ or exc
    timeouts = (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException, openai.APITimeoutError)
    return "timeout" if isinstance(cause, timeouts) else "error"
