"""What a request's answer counts: its pieces timed on the way through (`metered`), then its usage
(sources, degradations, escalations, agreement, costs) once it ends, or a pass-through's call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from gateway.decoding.cost_ceiling import cost_ratio
from gateway.observability.registry import Metrics
from gateway.observability.requests import RequestRecord, current_record, error_reason
from gateway.wire.errors import GatewayError

if TYPE_CHECKING:  # for annotations only: the metrics need not load the admission and decoding code
    from gateway.admission.chat import Admitted
    from gateway.decoding.decoder import Piece
    from gateway.decoding.passing import Passing
    from gateway.decoding.values import RoutingUsage


def _total(usages: list[RoutingUsage], name: str) -> list[float]:
    """The field's total over the request's choices (nothing when it is 0)."""
    total = sum(getattr(usage, name) for usage in usages)
    return [total] if total else []


def _any(usages: list[RoutingUsage], name: str) -> list[float]:
    """One request, if any choice's field is set."""
    return [1] if any(getattr(usage, name) for usage in usages) else []


def _rated(usages: list[RoutingUsage], name: str) -> list[float]:
    """The field of each choice the agreement check rated (0 included: the series shows it was rated)."""
    return [getattr(usage, name) for usage in usages if usage.agreement is not None]


# usage.routing fields -> how a request's choices count into the metric of the same name (Metrics):
# each amount is added to a counter, observed by a histogram
USAGE_METRICS: dict[str, Callable[[list[RoutingUsage], str], list[float]]] = {
    "escalated": _any,
    "afresh": _total,
    "price_vetoes": _total,
    "draft_hand_offs": _total,
    "agreement": _rated,
    "sample_tokens": _rated,
    "majority": _rated,
}
# a pass-through's usage.routing fields -> the counters they add to (its one call and answer tokens aside)
PASSTHROUGH_USAGE = {
    "upstream_prompt_tokens": "upstream_prompt_tokens",
    "upstream_completion_tokens": "upstream_completion_tokens",
    "upstream_cached_tokens": "upstream_cached_tokens",
    "upstream_cost_usd": "upstream_cost",
}


async def metered(admitted: Admitted) -> AsyncIterator[tuple[int, Piece]]:
    """The admitted request's (choice index, piece) pairs, timed and counted on the way through."""
    record = current_record()
    if record is None:
        async for item in admitted.pieces():
            yield item
        return
    record.alias, record.tenant = admitted.alias.name, admitted.tenant.id
    metrics, alias = record.metrics, admitted.alias.name
    last = time.perf_counter()
    try:
        async for index, piece in admitted.pieces():
            now = time.perf_counter()
            if piece.tokens:
                if record.ttft_s is None:
                    record.ttft_s = now - record.started
                    metrics.ttft.labels(alias).observe(record.ttft_s)
                else:
                    _observe_tokens(metrics, alias, piece.source, len(piece.tokens), now - last)
                if piece.source == "cache":
                    metrics.cache_hits.labels(alias).inc()
            yield index, piece
            last = time.perf_counter()  # the consumer's time (sending the chunk) is not decode time
    except GatewayError as exc:
        record.error = error_reason(exc)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        record.error = "client_disconnected"
        raise
    except Exception:
        record.error = "internal_error"
        raise
    finally:
        _count_answer(record, admitted)


def _observe_tokens(metrics: Metrics, alias: str, source: str, count: int, seconds: float) -> None:
    histogram = metrics.token_latency.labels(alias, source)
    for _ in range(count):
        histogram.observe(seconds / count)


def _count_answer(record: RequestRecord, admitted: Admitted) -> None:
    metrics, alias, decodings = record.metrics, admitted.alias.name, admitted.decodings
    counts = _count_sources(metrics, alias, decodings)
    degraded = _count_usage(metrics, alias, decodings)
    _count_costs(metrics, alias, decodings)
    record.summary = {"finish_reason": decodings[0].finish_reason, "tokens": counts,
                      "upstream_calls": sum(d.usage.upstream_calls for d in decodings), "degraded": degraded}


def _count_sources(metrics: Metrics, alias: str, decodings: list) -> dict[str, int]:
    """Answer tokens by source, after re-tokenization (the authoritative split)."""
    counts: dict[str, int] = {}
    for decoding in decodings:
        for source, count in decoding.source_counts().items():
            counts[source] = counts.get(source, 0) + count
    for source, count in counts.items():
        if count:
            metrics.tokens.labels(alias, source).inc(count)
    return counts


def _count_usage(metrics: Metrics, alias: str, decodings: list) -> list[str]:
    """What the routing did: the degradations, and each usage field of USAGE_METRICS; returns the
    degradation reasons."""
    usages = [decoding.usage for decoding in decodings]
    degraded: list[str] = []
    for usage in usages:
        degraded += [reason for reason in usage.degraded if reason not in degraded]
    for reason in degraded:
        metrics.degraded.labels(alias, reason).inc()
    for name, amounts in USAGE_METRICS.items():
        for amount in amounts(usages, name):
            metric = getattr(metrics, name).labels(alias)
            if hasattr(metric, "observe"):  # a histogram
                metric.observe(amount)
            else:
                metric.inc(amount)
    return degraded


def _count_costs(metrics: Metrics, alias: str, decodings: list) -> None:
    """Cost against asking the upstream directly, and billed against predicted."""
    ratio = cost_ratio(decodings)
    if ratio is not None:
        metrics.cost_ratio.labels(alias).observe(ratio)
    predicted = sum(d.usage.predicted_cost_usd for d in decodings)
    if predicted > 0:
        metrics.cost_prediction.labels(alias).observe(sum(d.usage.upstream_cost_usd for d in decodings) / predicted)


def count_passthrough(passing: Passing) -> None:
    """Count a request passed through whole, once its upstream call is settled."""
    record = current_record()
    if record is None:
        return
    metrics, alias, routing = record.metrics, passing.body.model, passing.routing
    record.alias, record.tenant = alias, passing.tenant_id
    metrics.passthrough.labels(alias, passing.blocker.reason).inc()
    if routing:
        metrics.upstream_calls.labels(alias).inc()
        metrics.tokens.labels(alias, "upstream").inc(routing["upstream_completion_tokens"])
        for name, counter in PASSTHROUGH_USAGE.items():
            getattr(metrics, counter).labels(alias).inc(routing[name])
    record.summary = {"mode": "passthrough", "passthrough_reason": passing.blocker.param,
                      "tokens": {"upstream": routing.get("upstream_completion_tokens", 0)}}
