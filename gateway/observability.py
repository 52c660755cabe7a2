"""Metrics and request logs: a Prometheus registry per app, one log line per request (gateway/logs.py
formats them).

Every app gets its own `Metrics` (its own CollectorRegistry), so several apps can live in one
process (tests) without clashing. Labels are deliberately few and bounded: `endpoint` (an API
route's template, `/v1/responses/{response_id}`, never the path a client sent) and `method` (one
that route serves), `alias` (a configured alias name, or "unknown"), `status` (the HTTP status
class), `source` (local/upstream/cache) and `reason` (an error code, a `usage.routing.degraded`
reason, or the kind of field that sent a request through: `tool_result`, never
`messages[41].role`). Tenant ids, keys and prompt text never become labels (one exception: the
shadow answers' series, gateway/shadow/metrics.py, carry `tenant` while the gateway has at most
`shadow.tenant_labels` tenants), and neither keys nor
prompts are logged: log lines carry ids, counts and timings only, and a last-resort filter masks
anything that looks like a bearer key.

The decoder stays free of metrics code: `metered(admitted)` wraps its piece stream, and
`MeteredUpstream` gives each alias's decoder continuations that time and count real calls.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapters.pricing import Prices
from adapters.upstream import Continuation, Handoff, Upstream
from gateway.decoding.cost_ceiling import cost_ratio
from gateway.shadow.metrics import ShadowCollector
from gateway.wire.errors import GatewayError, Unauthenticated

if TYPE_CHECKING:  # for annotations only: the metrics need not load the admission and decoding code
    from gateway.admission.chat import Admitted
    from gateway.decoding.decoder import Piece
    from gateway.decoding.passing import Passing
    from gateway.runtime import Runtime

log = logging.getLogger("gateway.requests")
router = APIRouter()

API_PREFIXES = ("/v1/", "/admin/")  # routes counted by endpoint; /metrics, /health/ and the playground are not
CHAT_ENDPOINT = "/v1/chat/completions"
QUIET_PATHS = ("/metrics", "/health/")  # scraped every few seconds: logged at DEBUG only
UNKNOWN = "unknown"
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
        r.register(ShadowCollector(lambda: getattr(self.runtime, "shadow", None)))
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


@router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics: for the admin key only, unless `server.public_metrics`."""
    if not request.app.state.public_metrics:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not request.app.state.runtime.tenants.is_admin(key.strip()):
            raise Unauthenticated("/metrics needs the admin key: send 'Authorization: Bearer <admin key>'.")
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- wiring (called from create_app and its lifespan) --

def install(app: FastAPI, metrics: Metrics, public: bool = False) -> None:
    """Serve /metrics (to the admin key only unless `public`), measure every request, and note the
    error code of each refused one."""
    app.state.metrics, app.state.public_metrics = metrics, public
    app.include_router(router)
    for kind, handler in list(app.exception_handlers.items()):
        app.exception_handlers[kind] = _noting_error(handler)
    app.add_middleware(ObservabilityMiddleware, metrics=metrics)


def instrument(runtime: Runtime, metrics: Metrics) -> None:
    """Meter each alias's hand-offs: its decoder's continuations count and time every call under
    that alias (a runtime reused by a second app counts for the new one)."""
    metrics.runtime = runtime
    for name, alias in list(runtime.aliases.items()):
        if alias.upstream is not None:
            runtime.aliases[name] = dataclasses.replace(
                alias, continuations=MeteredUpstream(alias.upstream, metrics, name))


def _noting_error(handler):
    async def handle(request: Request, exc: Exception):
        record = _record.get()
        if record is not None:
            record.error = error_reason(exc)
        response = handler(request, exc)
        return await response if inspect.isawaitable(response) else response

    return handle


def error_reason(exc: BaseException) -> str:
    """A bounded label for an error: its OpenAI code, else its type, else the HTTP status."""
    if isinstance(exc, GatewayError):
        return exc.code or exc.type
    status = getattr(exc, "status_code", None)
    return f"http_{status}" if isinstance(status, int) else "internal_error"


# -- one request --

@dataclass
class RequestRecord:
    """What the middleware and the route hooks learn about one request."""

    metrics: Metrics
    started: float
    status: int | None = None
    model: str | None = None
    alias: str | None = None
    tenant: str | None = None
    ttft_s: float | None = None
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("gateway_request_record", default=None)


def note_model(model: str) -> None:
    """Hook for the chat route: the requested model name (labelled only if it is an alias)."""
    record = _record.get()
    if record is not None:
        record.model = model


class ObservabilityMiddleware:
    """Times each request, counts API requests by endpoint, alias and status, logs one line per request."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(self.metrics, time.perf_counter())
        token = _record.set(record)

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except BaseException:
            record.status, record.error = record.status or 500, record.error or "internal_error"
            raise
        finally:
            _record.reset(token)
            self._finish(scope, record)

    def _finish(self, scope, record: RequestRecord) -> None:
        path, method, status = scope["path"], scope["method"], record.status or 500
        fields: dict[str, Any] = {"method": method, "path": path, "status": status,
                                  "duration_ms": round((time.perf_counter() - record.started) * 1000, 1)}
        endpoint = api_endpoint(scope)
        if endpoint is not None:
            alias = self._alias_label(scope, record)
            self._count(endpoint, method, alias, f"{status // 100}xx", record.error)
            fields.update(endpoint=endpoint, alias=alias, tenant=record.tenant, error=record.error, **record.summary)
            if record.ttft_s is not None:
                fields["ttft_ms"] = round(record.ttft_s * 1000, 1)
        level = logging.DEBUG if path.startswith(QUIET_PATHS) else logging.INFO
        log.log(level, "%s %s %s", scope["method"], path, status, extra=fields)

    def _count(self, endpoint: str, method: str, alias: str, status: str, error: str | None) -> None:
        m = self.metrics
        m.api_requests.labels(endpoint, method, alias, status).inc()
        if error is not None:
            m.api_errors.labels(endpoint, method, alias, error).inc()
        if endpoint == CHAT_ENDPOINT:
            m.requests.labels(alias, status).inc()
            if error is not None:
                m.errors.labels(alias, error).inc()

    def _alias_label(self, scope, record: RequestRecord) -> str:
        if record.alias is not None:
            return record.alias
        runtime = getattr(scope["app"].state, "runtime", None)
        aliases = runtime.aliases if runtime is not None else {}
        return record.model if record.model in aliases else UNKNOWN


def api_endpoint(scope) -> str | None:
    """The template of the API route a request matched (`/v1/responses/{response_id}`), or None:
    for /metrics, /health/ and the playground, a path no route matched, or a method its route does
    not serve (so no label holds a path or a method name a client made up)."""
    route = scope.get("route")  # set by the router as it matches, on this same scope
    template = getattr(route, "path", "")
    if template.startswith(API_PREFIXES) and scope["method"] in getattr(route, "methods", ()):
        return template
    return None


async def metered(admitted: Admitted) -> AsyncIterator[tuple[int, Piece]]:
    """The admitted request's (choice index, piece) pairs, timed and counted on the way through."""
    record = _record.get()
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
    metrics, alias = record.metrics, admitted.alias.name
    counts: dict[str, int] = {}
    degraded: list[str] = []
    for decoding in admitted.decodings:
        for source, count in decoding.source_counts().items():  # after re-tokenization: the authoritative split
            counts[source] = counts.get(source, 0) + count
        degraded += [reason for reason in decoding.usage.degraded if reason not in degraded]
    for source, count in counts.items():
        if count:
            metrics.tokens.labels(alias, source).inc(count)
    for reason in degraded:
        metrics.degraded.labels(alias, reason).inc()
    if any(decoding.usage.escalated for decoding in admitted.decodings):
        metrics.escalated.labels(alias).inc()
    afresh = sum(decoding.usage.afresh for decoding in admitted.decodings)
    if afresh:
        metrics.afresh.labels(alias).inc(afresh)
    vetoes = sum(decoding.usage.price_vetoes for decoding in admitted.decodings)
    if vetoes:
        metrics.price_vetoes.labels(alias).inc(vetoes)
    drafted = sum(decoding.usage.draft_hand_offs for decoding in admitted.decodings)
    if drafted:
        metrics.draft_hand_offs.labels(alias).inc(drafted)
    for decoding in admitted.decodings:
        if decoding.usage.agreement is not None:
            metrics.agreement.labels(alias).observe(decoding.usage.agreement)
            metrics.sample_tokens.labels(alias).inc(decoding.usage.sample_tokens)
            metrics.majority.labels(alias).inc(decoding.usage.majority)
    ratio = cost_ratio(admitted.decodings)
    if ratio is not None:
        metrics.cost_ratio.labels(alias).observe(ratio)
    predicted = sum(d.usage.predicted_cost_usd for d in admitted.decodings)
    if predicted > 0:
        metrics.cost_prediction.labels(alias).observe(sum(d.usage.upstream_cost_usd for d in admitted.decodings)
                                                       / predicted)
    record.summary = {"finish_reason": admitted.decodings[0].finish_reason, "tokens": counts,
                      "upstream_calls": sum(d.usage.upstream_calls for d in admitted.decodings), "degraded": degraded}


def count_passthrough(passing: Passing) -> None:
    """Count a request passed through whole, once its upstream call is settled."""
    record = _record.get()
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
