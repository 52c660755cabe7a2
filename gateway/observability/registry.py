"""The gateway's Prometheus metrics: one registry per app (several apps can live in one process,
as in tests, without clashing), the series the request path counts into, and the collectors read
at scrape time (queue depth, engine counters, shadow answers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.shadow.metrics import ShadowCollector

if TYPE_CHECKING:
    from gateway.runtime import Runtime

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The gateway's Prometheus metrics on a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.api_requests = Counter("gateway_requests", "API requests by endpoint (route template), method, alias "
                                    "and HTTP status class.", ["endpoint", "method", "alias", "status"], registry=r)
        self.api_errors = Counter("gateway_request_errors", "API requests refused or failed (also mid-stream), by "
                                  "endpoint, method, alias and error code.", ["endpoint", "method", "alias", "reason"],
                                  registry=r)
        # The chat-only series that dashboards read before gateway_requests counted every endpoint.
        self.requests = Counter("gateway_chat_requests", "Chat completion requests by alias and HTTP status class.",
                                ["alias", "status"], registry=r)
        self.errors = Counter("gateway_chat_errors", "Chat completions refused or failed (also mid-stream), by error code.",
                              ["alias", "reason"], registry=r)
        self.ttft = Histogram("gateway_time_to_first_token_seconds",
                              "From the request's arrival to its first answer token.", ["alias"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("gateway_token_latency_seconds",
                                       "Decode time per answer token after the first, by where it came from.",
                                       ["alias", "source"], buckets=STEP_BUCKETS, registry=r)
        self.tokens = Counter("gateway_completion_tokens", "Answer tokens by source (local, upstream, cache).",
                              ["alias", "source"], registry=r)
        self.cache_hits = Counter("gateway_cache_hits", "Hand-offs answered from the continuation cache.",
                                  ["alias"], registry=r)
        self.degraded = Counter("gateway_degraded_requests",
                                "Requests that fell back to local decoding, by usage.routing.degraded reason.",
                                ["alias", "reason"], registry=r)
        self.passthrough = Counter("gateway_passthrough_requests",
                                   "Requests passed whole to the upstream, by the field that sent them there.",
                                   ["alias", "reason"], registry=r)
        self._upstream_metrics(r)
        r.register(_QueueDepth(self))
        r.register(_EngineCounters(self))
        r.register(ShadowCollector(lambda: self.runtime.shadow if self.runtime is not None else None))
        self.runtime: Runtime | None = None  # set by `instrument`; read by the scrape-time collectors

    def _upstream_metrics(self, r: CollectorRegistry) -> None:
        self.upstream_calls = Counter("gateway_upstream_calls", "Calls made to an upstream model.", ["alias"], registry=r)
        self.upstream_errors = Counter("gateway_upstream_errors", "Upstream calls that failed or were not made.",
                                       ["alias", "reason"], registry=r)
        self.upstream_latency = Histogram("gateway_upstream_latency_seconds", "Wall time of successful upstream calls.",
                                          ["alias"], buckets=STEP_BUCKETS, registry=r)
        self.upstream_prompt_tokens = Counter("gateway_upstream_prompt_tokens", "Prompt tokens billed by upstreams.",
                                              ["alias"], registry=r)
        self.upstream_completion_tokens = Counter("gateway_upstream_completion_tokens",
                                                  "Completion tokens billed by upstreams.", ["alias"], registry=r)
        self.upstream_cached_tokens = Counter(
            "gateway_upstream_cached_tokens", "Prompt tokens upstreams read from their cache (billed at the cached "
            "price).", ["alias"], registry=r)
        self.upstream_compute = Counter("gateway_upstream_compute_seconds",
                                        "Upstreams' own prompt + generation time, where they report it.",
                                        ["alias"], registry=r)
        self.upstream_cost = Counter("gateway_upstream_cost_usd", "Upstream cost in USD.", ["alias"], registry=r)
        self.cost_ratio = Histogram("gateway_cost_ratio",
                                    "Token-level answers' upstream cost over asking the upstream directly "
                                    "(usage.routing.cost_ratio), where the upstream is priced.", ["alias"], registry=r,
                                    buckets=(0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, float("inf")))
        self.cost_prediction = Histogram("gateway_handoff_cost_prediction",
                                         "Per answer: what its hand-offs billed over what the decoder predicted before "
                                         "each call (price sheet, provider cache minimum, prefix reuse); 1 is exact.",
                                         ["alias"], registry=r,
                                         buckets=(0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 2.0, float("inf")))
        self.agreement = Histogram("gateway_answer_agreement",
                                   "With the agreement check: each answer's share of sampled answers that agree "
                                   "with it (usage.routing.agreement).", ["alias"], registry=r,
                                   buckets=(0.0, 0.25, 0.34, 0.5, 0.67, 0.75, 0.99, 1.0))
        self.sample_tokens = Counter("gateway_agreement_sample_tokens",
                                     "Local tokens the agreement check's sampled answers took.", ["alias"], registry=r)
        self.majority = Counter("gateway_agreement_majority_answers", "Answers where the agreement check "
                                "(answer: majority) kept a sampled answer, the majority's, over the greedy one.",
                                ["alias"], registry=r)
        self.escalated = Counter("gateway_escalated_requests",
                                 "Answers whose rest the upstream wrote in one call (at the cost ceiling, or "
                                 "escalated early by price-aware routing).", ["alias"], registry=r)
        self.afresh = Counter("gateway_afresh_answers", "Answers thrown away and asked of the upstream afresh (the "
                              "answer check rated them below escalate_below, or they escalated under escalation: "
                              "afresh or draft).", ["alias"], registry=r)
        self.price_vetoes = Counter("gateway_price_vetoed_steps",
                                    "Steps the policy wanted upstream that price-aware routing kept local (not worth "
                                    "their predicted price).", ["alias"], registry=r)
        self.draft_hand_offs = Counter("gateway_draft_hand_offs",
                                       "Hand-offs the policy wanted in a draft (escalation: draft), counted toward "
                                       "escalating it and not made.", ["alias"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _QueueDepth:
    """`gateway_queue_depth{alias}`, read at scrape time (aliases sharing a model report the same queue)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self):
        return [GaugeMetricFamily("gateway_queue_depth", "Requests waiting for or holding the alias's local model.",
                                  labels=["alias"])]

    def collect(self):
        family = self.describe()[0]
        runtime = self._metrics.runtime
        for name, alias in (runtime.aliases.items() if runtime is not None else ()):
            family.add_metric([name], alias.local.queue_depth)
        yield family


class _EngineCounters:
    """Each local model's engine counters, read at scrape time: decode steps, and the look-ahead's
    guesses by outcome (`taken`: a request's next forward was the guessed token; `dropped`: it was
    not, the step was wasted)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self):
        return [CounterMetricFamily("gateway_engine_steps", "llama_decode calls of the local model's engine.",
                                    labels=["model"]),
                CounterMetricFamily("gateway_engine_look_ahead_guesses",
                                    "Greedy tokens the engine evaluated ahead of their request, by outcome.",
                                    labels=["model", "outcome"])]

    def collect(self):
        steps, guesses = self.describe()
        runtime = self._metrics.runtime
        for name, local in (runtime.local_models.items() if runtime is not None else ()):
            steps.add_metric([name], local.engine.steps)
            guesses.add_metric([name, "taken"], local.engine.guesses_taken)
            guesses.add_metric([name, "dropped"], local.engine.guesses_dropped)
        yield steps
        yield guesses
