"""GET /admin/quality's body: per alias and tenant, the pooled shadow figures, the knob, a timeline
of agreement per time bucket, the figures of requests whose routing was overridden (apart), and the
operator's shadow spending."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from gateway.shadow.figures import (
    CURRENCY,
    OVERRIDDEN,
    check_version_prefix,
    figures_of,
    tenant_prefix,
    tenants_in,
    timeline,
)
from gateway.shadow.lanes import Lane
from gateway.shadow.service import Shadow

MAX_MINUTES = 7 * 24 * 60


async def quality_report(shadow: Shadow, now: float, alias: str | None = None, minutes: int = 60) -> dict[str, Any]:
    """The figures of `alias` (None: every shadowed alias), with the last `minutes` of the timeline
    (at most what the store keeps). Raises StoreUnavailable."""
    settings = shadow.settings
    count = min(math.ceil(minutes * 60 / settings.bucket_s), settings.history_s // settings.bucket_s)
    last = int(now // settings.bucket_s)
    buckets = list(range(last - count + 1, last + 1))
    lanes = [shadow.lanes[alias]] if alias is not None else list(shadow.lanes.values())
    entries = [await _alias_entry(shadow, lane, buckets) for lane in lanes]
    windows = await shadow.ledger.store.usage(settings.operator, now)
    budgets = {"day": settings.daily, "month": settings.monthly}
    return {
        "object": "quality", "currency": CURRENCY, "bucket_s": settings.bucket_s, "aliases": entries,
        "operator": {"tenant": settings.operator,
                     "windows": [{**asdict(w), "limits": budgets[w.period].model_dump()} for w in windows],
                     "tenant_share": settings.tenant_share if shadow.tenant_limits is not None else None,
                     "max_tokens": settings.max_tokens},
        "process": {"queued": shadow.queue.qsize(), "in_flight": shadow.in_flight,
                    "store_writes": shadow.store_calls["write"], "store_reads": shadow.store_calls["read"]},
    }


async def _alias_entry(shadow: Shadow, lane: Lane, buckets: list[int]) -> dict[str, Any]:
    totals, rows = await shadow.ledger.store.quality_read(lane.name, buckets)
    shadow.store_calls["read"] += 1
    routing = lane.routing
    knob = None
    if lane.controller is not None:
        knob = {**routing.knob.model_dump(), "value": getattr(lane.steered, routing.knob.field),
                "configured": getattr(routing, routing.knob.field)}
    return {
        "alias": lane.name, "rate": routing.shadow.rate, "format": routing.shadow.format,
        "quality_target": routing.quality_target, "knob": knob, "figures": figures_of(totals).body(),
        "tenants": _tenants(totals),
        "overridden": {"figures": figures_of(totals, OVERRIDDEN).body(), "tenants": _tenants(totals, OVERRIDDEN)},
        "timeline": timeline((bucket * shadow.settings.bucket_s, row) for bucket, row in zip(buckets, rows)),
        "learning": _learning(lane, totals),
    }


def _learning(lane: Lane, totals: dict[str, float]) -> dict[str, Any] | None:
    """A learning alias's state: its learner's, with the agreement and cost measured while the
    version routing now (or the cold start) did, beside what the held-out examples predicted."""
    learner = lane.learner
    if learner is None:
        return None
    measured = figures_of(totals, check_version_prefix(learner.version))
    bar = learner.state.bar if learner.version is not None else None
    return {**learner.report(), "predicted_agreement": bar.agreement if bar else None,
            "predicted_escalated_share": bar.escalated_share if bar else None,
            "measured": {"samples": measured.samples, "agreement": measured.body()["agreement"],
                         "interval": measured.body()["interval"], "cost_ratio": measured.body()["cost_ratio"]}}


def _tenants(totals: dict[str, float], prefix: str = "") -> dict[str, Any]:
    tenants = {}
    for tenant in tenants_in(totals, prefix):
        body = figures_of(totals, prefix + tenant_prefix(tenant)).body()
        del body["by_format"], body["skipped"]  # kept per alias only
        tenants[tenant] = body
    return tenants
