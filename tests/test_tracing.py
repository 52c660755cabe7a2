"""OpenTelemetry spans, read from the SDK's in-memory exporter: the request's span continues the
client's `traceparent`; each hand-off, escalation and upstream call has a span of its own, and an
upstream call's `traceparent` reaches the upstream. tests/test_tracing_otlp.py exports to a real
OTLP receiver."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from adapters import trace_context
from adapters.upstream import UpstreamUnavailable
from gateway.api.app import create_app
from gateway.observability import Metrics, MeteredUpstream, metered_calls
from gateway.observability.tracing_provider import REQUEST_ID, sampler, tracer_provider
from gateway.runtime import Runtime, make_upstream
from gateway.settings import Settings, UpstreamSettings
from gateway.settings.tracing import TracingSettings
from tests.conftest import ADMIN_KEY, DEMO_KEY, SMOL, free_port, gateway_config
from tests.fakes import FakeLocalModel, FakeUpstream, JsonProvider, serve
from gateway.traced import request_trace
from tests.test_decoder import VOCAB, ceiling, make, run
from tests.test_shadow import SHADOWED, case, make_shadow

EXPORTER = InMemorySpanExporter()
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module", autouse=True)
def provider() -> Iterator[None]:
    """The process's provider (OpenTelemetry sets one per process, once), exporting to memory while
    this module runs; one this module set is shut down after it, so later tests' spans go nowhere."""
    ours = not hasattr(trace.get_tracer_provider(), "add_span_processor")
    if ours:
        trace.set_tracer_provider(tracer_provider(TracingSettings(), SimpleSpanProcessor(EXPORTER)))
    else:  # set before this module ran
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(EXPORTER))
    yield
    if ours:
        trace.get_tracer_provider().shutdown()


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def named(name: str) -> list:
    return [span for span in EXPORTER.get_finished_spans() if span.name == name]


# -- the request's span --

def fake_app():
    async def start(_settings):
        async def close():
            pass
        return SimpleNamespace(aliases={}, local_models={}, shadow=None, closed=False, close=close,
                               tenants=SimpleNamespace(authenticate=lambda _key: None, is_admin=lambda _key: False))

    return create_app(Settings.model_validate(gateway_config(None)), start_runtime=start)


def test_a_request_span_continues_the_clients_trace_and_carries_its_request_id():
    with TestClient(fake_app()) as client:
        answer = client.post("/v1/chat/completions", json={}, headers={
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "x-request-id": "req-42"})
    assert answer.status_code == 401
    [server] = named("POST /v1/chat/completions")  # FastAPI's span, which continues the client's trace
    assert server.kind == SpanKind.SERVER and server.attributes["http.response.status_code"] == 401
    assert format(server.context.trace_id, "032x") == CLIENT_TRACE and format(server.parent.span_id, "016x") == CLIENT_SPAN
    [request] = named("gateway.request")  # the gateway's, within it
    assert request.parent.span_id == server.context.span_id
    assert request.attributes[REQUEST_ID] == "req-42" == answer.headers["x-request-id"]
    assert request.attributes["gateway.status"] == 401 and request.attributes["gateway.error"] == "invalid_api_key"


def test_a_request_without_traceparent_starts_a_trace_of_its_own():
    with TestClient(fake_app()) as client:
        client.get("/v1/models")
    [server] = named("GET /v1/models")
    assert server.parent is None and named("gateway.request")[0].attributes[REQUEST_ID]


@pytest.mark.integration
def test_an_answered_request_has_its_admission_queue_wait_and_decoding_in_its_span_tree():
    settings = Settings.model_validate(gateway_config(None))
    metrics = Metrics()
    app = create_app(settings, metrics=metrics, start_runtime=lambda s: Runtime.start(
        s, environ={"TEST_DEMO_KEY": DEMO_KEY, "TEST_ADMIN_KEY": ADMIN_KEY}, observe_calls=metered_calls(metrics)))
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {DEMO_KEY}",
                                                               "x-request-id": "req-200"},
                             json={"model": "local", "messages": [{"role": "user", "content": "Say hi."}],
                                   "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    [server], [request] = named("POST /v1/chat/completions"), named("gateway.request")
    assert server.attributes["http.response.status_code"] == 200 and request.parent.span_id == server.context.span_id
    assert request.attributes["gateway.status"] == 200 and request.attributes["gateway.alias"] == "local"
    assert request.attributes["gateway.tenant"] == "demo"
    assert request.attributes["gateway.tokens.local"] == answer.json()["usage"]["completion_tokens"] > 0
    [admission], [decoding], waits = named("gateway.admission"), named("gateway.decoding"), named("gateway.queue_wait")
    assert admission.parent.span_id == decoding.parent.span_id == request.context.span_id
    assert admission.end_time <= decoding.start_time and [e.name for e in decoding.events] == ["first_token"]
    assert waits and all(wait.context.trace_id == server.context.trace_id for wait in waits)
    spans = [server, request, admission, decoding, *waits]
    assert all(span.attributes[REQUEST_ID] == "req-200" for span in spans[1:])
    assert {span.status.status_code for span in spans} == {StatusCode.UNSET}


# -- which traces are kept --

def remote_parent(sampled: bool) -> object:
    """A context whose parent is a client's span (its `traceparent`), sampled or not."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span = NonRecordingSpan(SpanContext(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), is_remote=True, trace_flags=flags))
    return trace.set_span_in_context(span)


@pytest.mark.parametrize("ratio, client_sampled, follow, kept", [
    (0.0, True, False, False),  # a client's sampled flag does not make the gateway keep its trace
    (1.0, False, False, True),  # nor does its unsampled flag drop one the ratio keeps
    (0.0, True, True, True),  # unless the operator trusts its clients
    (1.0, False, True, False),
])
def test_the_ratio_decides_for_a_clients_trace_unless_told_to_follow_the_client(ratio, client_sampled, follow, kept):
    decide = sampler(TracingSettings(sample_ratio=ratio, follow_client_sampling=follow))
    result = decide.should_sample(remote_parent(client_sampled), int(CLIENT_TRACE, 16), "POST /v1/chat/completions")
    assert result.decision.is_sampled() is kept


def test_a_client_cannot_choose_a_trace_id_the_ratio_keeps():
    decide = sampler(TracingSettings(sample_ratio=0.01))
    kept = sum(decide.should_sample(remote_parent(True), 1, "POST /v1/chat/completions").decision.is_sampled()
               for _ in range(1000))  # trace id 1: what a ratio by trace id keeps every time
    assert kept < 50


# -- hand-offs and escalations (the decoder's hooks) --

async def test_each_hand_off_and_the_escalation_has_a_span():
    upstream = FakeUpstream("Paris is nice.")
    unsure = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)))
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1000.0, escalation="afresh", held=True)
    with trace.get_tracer("test").start_as_current_span("request") as request:
        await run(decoding)
    handoffs, [escalation] = named("gateway.handoff"), named("gateway.escalation")
    assert len(handoffs) == decoding.usage.upstream_calls == 4  # three hand-offs, then the prompt alone afresh
    assert all(span.attributes["gateway.handoff.source"] == "upstream" for span in handoffs)
    assert escalation.parent.span_id == request.get_span_context().span_id
    assert [span.parent.span_id for span in handoffs].count(escalation.context.span_id) == 1  # the fresh one


async def test_a_hand_off_decoded_locally_says_so():
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris"), FakeUpstream("Paris", fail=True), max_tokens=2)
    await run(decoding)
    assert {span.attributes["gateway.handoff.source"] for span in named("gateway.handoff")} == {"local"}


# -- upstream calls over HTTP --

class Provider(JsonProvider):
    """A completions provider that answers "Paris" and keeps each request's `traceparent`."""

    traceparents: list[str | None] = []
    tracestates: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.traceparents.append(self.headers.get("traceparent"))
        self.tracestates.append(self.headers.get("tracestate"))
        usage = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
        if self.path.endswith("/chat/completions"):  # a request passed through whole
            answer = {"id": "chat-1", "object": "chat.completion", "created": 0, "model": "x", "usage": usage,
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                                   "finish_reason": "stop"}]}
        else:
            answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "x", "usage": usage,
                      "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}]}
        self.send_json(answer)


@pytest.fixture(scope="module")
def provider_base() -> Iterator[str]:
    yield from serve(Provider)


def metered(api_base: str, retries: int = 0) -> MeteredUpstream:
    settings = UpstreamSettings(model="text-completion-openai/x", api_base=api_base, mode="completions",
                                template_gguf=SMOL, retries=retries, timeout_s=5, input_usd_per_mtok=1.0,
                                output_usd_per_mtok=2.0)
    return MeteredUpstream(make_upstream("up", settings), Metrics(), "routed")


async def test_an_upstream_call_span_has_its_figures_and_the_upstream_gets_its_traceparent(provider_base):
    upstream = metered(provider_base)
    handoff = upstream.with_answer(upstream.handoff([{"role": "user", "content": "Capital of France?"}]), "It is")
    continuation = await upstream.continue_text(handoff, 2, 0.0, 1.0, None)
    [span] = named("gateway.upstream_call")
    assert span.kind == SpanKind.CLIENT
    figures = {key.removeprefix("gateway.upstream."): value for key, value in span.attributes.items()}
    assert figures["mode"] == "completions" and figures["breaker"] == "closed" and figures["max_tokens"] == 2
    assert (figures["prompt_tokens"], figures["completion_tokens"], figures["cached_tokens"]) == (12, 2, 0)
    assert figures["cost_usd"] == pytest.approx(continuation.cost_usd) and continuation.cost_usd > 0
    assert span.attributes["gateway.alias"] == "routed"
    context = span.context
    assert Provider.traceparents[-1].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")  # W3C


async def test_a_request_passed_through_whole_sends_the_current_traceparent(provider_base):
    settings = UpstreamSettings(model="openai/x", api_base=provider_base, mode="chat_fallback", template_gguf=SMOL)
    with trace.get_tracer("test").start_as_current_span("request") as span:
        answer = await make_upstream("up", settings).whole.chat(
            {"messages": [{"role": "user", "content": "Capital of France?"}]})
    assert answer.choices[0].message.content == "Paris"
    context = span.get_span_context()
    assert Provider.traceparents[-1].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")


async def test_a_clients_tracestate_never_reaches_an_upstream_and_propagation_can_be_turned_off(provider_base):
    settings = UpstreamSettings(model="openai/x", api_base=provider_base, mode="chat_fallback", template_gguf=SMOL)
    client = SpanContext(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("vendor", "secret")]))
    messages = {"messages": [{"role": "user", "content": "Capital of France?"}]}
    with trace.use_span(NonRecordingSpan(client)):  # as with tracing off: the client's context is current
        await make_upstream("up", settings).whole.chat(messages)
        assert Provider.traceparents[-1].startswith(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-")
        assert Provider.tracestates[-1] is None
        trace_context.propagate_to_upstreams(False)
        try:
            await make_upstream("up", settings).whole.chat(messages)
        finally:
            trace_context.propagate_to_upstreams(True)
    assert Provider.traceparents[-1] is None and Provider.tracestates[-1] is None


async def test_each_failed_attempt_is_an_event_on_the_upstream_call_span():
    upstream = metered(f"http://127.0.0.1:{free_port()}/v1", retries=1)  # nothing listens there
    handoff = upstream.handoff([{"role": "user", "content": "Capital of France?"}])
    with pytest.raises(UpstreamUnavailable):
        await upstream.continue_text(handoff, 2, 0.0, 1.0, None)
    [span] = named("gateway.upstream_call")
    attempts = [event for event in span.events if event.name == "upstream.attempt_failed"]
    assert [event.attributes["failure"] for event in attempts] == ["outage", "outage"]  # the call and its retry
    assert span.status.status_code == StatusCode.ERROR


# -- shadow calls --

async def test_a_shadow_call_has_a_span_in_the_trace_of_the_request_it_shadows():
    shadow = make_shadow({**SHADOWED, "shadow": {"rate": 1.0}})
    with trace.get_tracer("test").start_as_current_span("request") as request:
        shadow.offer(dataclasses.replace(case("42"), trace=request_trace()))
    worker = asyncio.create_task(shadow.work())
    await asyncio.wait_for(shadow.queue.join(), 10)
    worker.cancel()
    [call] = named("gateway.shadow_call")  # after the request's own span ended, within its trace
    assert call.parent.span_id == request.get_span_context().span_id
    assert call.context.trace_id == request.get_span_context().trace_id
    assert call.attributes["gateway.alias"] == "routed"
