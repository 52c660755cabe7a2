"""The shadow service's Prometheus series, read at scrape time (gateway/observability/registry.py registers
the collector). Counters are this process's events (Prometheus sums replicas); the gauges of
agreement, its interval, savings and the share sampled are the figures pooled over every replica
in the Store, as this process last read them. Labels: `alias`, and `tenant` only while the gateway
has at most `shadow.tenant_labels` tenants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.shadow.figures import check_version_prefix, figures_of, tenant_prefix, tenants_in
from gateway.shadow.service import Shadow

COUNTERS = {  # event -> (family, help, label names after alias)
    "eligible": ("gateway_shadow_eligible", "Token-level answers on shadowed aliases that could be sampled (of "
                 "requests that ran the alias's own routing, as the series below but skipped).", []),
    "sampled": ("gateway_shadow_sampled", "Answers drawn for a shadow answer by the rate.", []),
    "samples": ("gateway_shadow_samples", "Shadow answers compared, by outcome (agree, disagree).", ["outcome"]),
    "overridden_samples": ("gateway_shadow_overridden_samples", "Shadow answers compared of requests whose tenant's "
                           "or own routing changed the alias's (kept apart from the other series and never fed to "
                           "a knob), by outcome.", ["outcome"]),
    "tenant_samples": ("gateway_shadow_tenant_samples", "Shadow answers compared, by tenant and outcome (only "
                       "while tenants are few: shadow.tenant_labels).", ["tenant", "outcome"]),
    "skipped": ("gateway_shadow_skipped", "Sampled answers not shadowed or not compared, overridden ones included, "
                "by reason (budget, tenant_share, breaker, queue, store, failed, unsupported, length).", ["reason"]),
    "cost": ("gateway_shadow_cost_usd", "Upstream cost of the compared samples: the routed answers' (routed) and "
             "the shadow calls' (upstream_only).", ["answer"]),
    "moves": ("gateway_shadow_knob_moves", "Moves of a quality target's knob, by direction.", ["direction"]),
    "examples": ("gateway_learning_examples", "Learning examples this process added (routing.learn).", []),
}


class ShadowCollector:
    """Scrape-time series of the runtime's shadow service (`service()`: None when nothing shadows)."""

    def __init__(self, service: Callable[[], Shadow | None]) -> None:
        self._service = service

    def describe(self) -> list[Any]:
        return [*self._counters().values(), *self._gauges().values()]

    def collect(self) -> Iterator[Any]:
        counters, gauges = self._counters(), self._gauges()
        shadow = self._service()
        if shadow is not None:
            for (event, alias, *labels), value in shadow.counts.items():
                counters[event].add_metric([alias, *labels], value)
            self._pooled(shadow, gauges)
            gauges["queue"].add_metric([], shadow.queue.qsize())
        yield from counters.values()
        yield from gauges.values()

    @staticmethod
    def _pooled(shadow: Shadow, gauges: dict[str, GaugeMetricFamily]) -> None:
        for alias, lane in shadow.lanes.items():
            if lane.controller is not None:
                gauges["knob"].add_metric([alias, lane.controller.knob.field],
                                          getattr(lane.steered, lane.controller.knob.field))
            counts = shadow.pooled.get(alias, {})
            figures = figures_of(counts)
            _agreement(gauges["agreement"], [alias], figures)
            if figures.share_sampled is not None:
                gauges["share"].add_metric([alias], figures.share_sampled)
            gauges["savings"].add_metric([alias], figures.savings)
            for tenant in tenants_in(counts) if shadow.tenant_labels else ():
                _agreement(gauges["tenant_agreement"], [alias, tenant], figures_of(counts, tenant_prefix(tenant)))
            if lane.learner is not None:
                _learning(lane.learner, counts, gauges)

    @staticmethod
    def _counters() -> dict[str, CounterMetricFamily]:
        return {event: CounterMetricFamily(name, text, labels=["alias", *labels])
                for event, (name, text, labels) in COUNTERS.items()}

    @staticmethod
    def _gauges() -> dict[str, GaugeMetricFamily]:
        pooled = " (pooled over replicas, as last read from the store)"
        return {
            "agreement": GaugeMetricFamily("gateway_shadow_agreement", "Share of shadow answers that agree with "
                                           "the routed one: estimate and Wilson 95% bounds (bound)" + pooled,
                                           labels=["alias", "bound"]),
            "tenant_agreement": GaugeMetricFamily("gateway_shadow_tenant_agreement", "As gateway_shadow_agreement, "
                                                  "per tenant (only while tenants are few)" + pooled,
                                                  labels=["alias", "tenant", "bound"]),
            "share": GaugeMetricFamily("gateway_shadow_sampled_share", "Share of eligible answers compared" + pooled,
                                       labels=["alias"]),
            "savings": GaugeMetricFamily("gateway_shadow_savings_usd", "Upstream-only cost less routed cost of the "
                                         "compared samples" + pooled, labels=["alias"]),
            "knob": GaugeMetricFamily("gateway_shadow_knob", "A quality target's knob: its current value.",
                                      labels=["alias", "field"]),
            **_learning_gauges(pooled),
            "queue": GaugeMetricFamily("gateway_shadow_queue_depth", "Sampled answers waiting for a shadow call.",
                                       labels=[]),
        }


def _agreement(family: GaugeMetricFamily, labels: list[str], figures: Any) -> None:
    if figures.agreement is None:
        return
    low, high = figures.interval
    for bound, value in (("estimate", figures.agreement), ("low", low), ("high", high)):
        family.add_metric([*labels, bound], value)


def _learning_gauges(pooled: str) -> dict[str, GaugeMetricFamily]:
    return {
        "learn_examples": GaugeMetricFamily("gateway_learning_examples_pooled", "Learning examples ever added "
                                            "for the alias and its local model" + pooled, labels=["alias"]),
        "learn_version": GaugeMetricFamily("gateway_learning_version", "The learned check's version routing now "
                                           "(0: cold start)" + pooled, labels=["alias"]),
        "learn_auc": GaugeMetricFamily("gateway_learning_auc", "The learned check's ranking (AUC): on held-out "
                                       "examples (held_out) and on those since its promotion (live)" + pooled,
                                       labels=["alias", "set"]),
        "learn_bar": GaugeMetricFamily("gateway_learning_escalate_below", "The bar chosen for the learned check"
                                       + pooled, labels=["alias"]),
        "learn_agreement": GaugeMetricFamily("gateway_learning_agreement", "Agreement with upstream-only: predicted "
                                             "by the held-out examples' Wilson lower bound (predicted_low), point "
                                             "estimate (predicted), and measured while this version routed "
                                             "(measured)" + pooled, labels=["alias", "kind"]),
        "learn_cost": GaugeMetricFamily("gateway_learning_cost_ratio", "Routed cost against upstream-only's of the "
                                        "samples while this version (or the cold start) routed" + pooled,
                                        labels=["alias"]),
    }


def _learning(learner: Any, counts: dict[str, float], gauges: dict[str, GaugeMetricFamily]) -> None:
    alias, state = learner.alias, learner.state
    gauges["learn_examples"].add_metric([alias], learner.examples)
    gauges["learn_version"].add_metric([alias], learner.version or 0)
    for name, value in (("held_out", state.auc), ("live", state.live_auc)):
        if value is not None and learner.version is not None:
            gauges["learn_auc"].add_metric([alias, name], value)
    measured = figures_of(counts, check_version_prefix(learner.version))
    if learner.version is not None and state.bar is not None:
        gauges["learn_bar"].add_metric([alias], state.bar.value)
        gauges["learn_agreement"].add_metric([alias, "predicted"], state.bar.agreement)
        gauges["learn_agreement"].add_metric([alias, "predicted_low"], state.bar.agreement_low)
    if measured.agreement is not None:
        gauges["learn_agreement"].add_metric([alias, "measured"], measured.agreement)
    if measured.cost_ratio is not None:
        gauges["learn_cost"].add_metric([alias], measured.cost_ratio)
