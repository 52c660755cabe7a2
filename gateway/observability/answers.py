"""What a request's answer counts: its pieces timed on the way through (`metered`), then its usage
(sources, degradations, escalations, agreement, costs) once it ends, or a pass-through's call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gateway.decoding.cost_ceiling import cost_ratio
from gateway.observability.registry import Metrics
from gateway.observability.requests import RequestRecord, current_record, error_reason
from gateway.wire.errors import GatewayError

if TYPE_CHECKING:  # for annotations only: the metrics need not load the admission and decoding code
    from gateway.admission.chat import Admitted
    from gateway.decoding.decoder import Piece
    from gateway.decoding.passing import Passing

# usage.routing fields summed over a request's choices into the counter of the same name (Metrics)
SUMMED_USAGE = ("afresh", "price_vetoes", "draft_hand_offs")


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
    """What the routing did (degradations, escalations, the summed usage fields, agreement); returns
    the degradation reasons."""
    degraded: list[str] = []
    for decoding in decodings:
        degraded += [reason for reason in decoding.usage.degraded if reason not in degraded]
    for reason in degraded:
        metrics.degraded.labels(alias, reason).inc()
    if any(decoding.usage.escalated for decoding in decodings):
        metrics.escalated.labels(alias).inc()
    for name in SUMMED_USAGE:
        total = sum(getattr(decoding.usage, name) for decoding in decodings)
        if total:
            getattr(metrics, name).labels(alias).inc(total)
    for usage in (decoding.usage for decoding in decodings if decoding.usage.agreement is not None):
        metrics.agreement.labels(alias).observe(usage.agreement)
        metrics.sample_tokens.labels(alias).inc(usage.sample_tokens)
        metrics.majority.labels(alias).inc(usage.majority)
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
        metrics.upstream_prompt_tokens.labels(alias).inc(routing["upstream_prompt_tokens"])
        metrics.upstream_completion_tokens.labels(alias).inc(routing["upstream_completion_tokens"])
        metrics.upstream_cached_tokens.labels(alias).inc(routing["upstream_cached_tokens"])
        metrics.upstream_cost.labels(alias).inc(routing["upstream_cost_usd"])
    record.summary = {"mode": "passthrough", "passthrough_reason": passing.blocker.param,
                      "tokens": {"upstream": routing.get("upstream_completion_tokens", 0)}}
