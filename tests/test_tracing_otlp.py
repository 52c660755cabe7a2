"""Traces exported over OTLP/HTTP by a real gateway process (`python -m gateway serve`) to a receiver
started here, which decodes each ExportTraceServiceRequest as a collector does: a routed answer
with hand-offs shows each hand-off's span, its upstream call beneath it, in the client's trace."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import gateway_config, live_gateway
from tests.fakes import serve

pytestmark = pytest.mark.integration

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint: keeps every span it is sent as a dict (name, ids, attributes)."""

    spans: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            service = {kv.key: kv.value.string_value for kv in resource.resource.attributes}["service.name"]
            for scope in resource.scope_spans:
                self.spans.extend(_span(span, service) for span in scope.spans)
        data = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def _span(span, service: str) -> dict:
    attributes = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}
    return {"name": span.name, "service": service, "trace": span.trace_id.hex(), "id": span.span_id.hex(),
            "parent": span.parent_span_id.hex(), "attributes": attributes}


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    for base in serve(Receiver):
        yield f"{base}/traces"


def spans_of(request_id: str, timeout_s: float = 20.0) -> list[dict]:
    """The request's spans once its `gateway.request` span has arrived (the processor batches)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ours = [span for span in Receiver.spans if span["attributes"].get("gateway.request_id") == request_id]
        if any(span["name"] == "gateway.request" for span in ours):
            time.sleep(0.5)  # spans that ended with it may come in the next batch
            return [span for span in Receiver.spans if span["attributes"].get("gateway.request_id") == request_id]
        time.sleep(0.1)
    raise AssertionError(f"no spans of {request_id} arrived; the receiver has {len(Receiver.spans)}")


def ancestors(span: dict) -> list[str]:
    """The ids of the spans above `span`, nearest first."""
    by_id, found = {each["id"]: each for each in Receiver.spans}, []
    while span["parent"] in by_id:
        span = by_id[span["parent"]]
        found.append(span["id"])
    return found


def test_a_routed_answer_shows_each_hand_off_in_the_clients_trace(smol_llama_server, receiver, tmp_path):
    config = gateway_config(smol_llama_server, mode="tokens")
    config["tracing"] = {"otlp_endpoint": receiver, "service_name": "gateway-under-test"}
    with live_gateway(config, tmp_path, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as gateway:
        answer = gateway.client().chat.completions.create(
            model="routed", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=8,
            temperature=0, extra_body={"routing": {"policy": "always"}},
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "x-request-id": "traced-1"})
        spans = spans_of("traced-1")
    calls = answer.usage.model_extra["routing"]["upstream_calls"]
    assert calls >= 2
    assert {span["trace"] for span in spans} == {CLIENT_TRACE} and {span["service"] for span in spans} == {
        "gateway-under-test"}
    [request] = [span for span in spans if span["name"] == "gateway.request"]
    server = {span["id"]: span for span in Receiver.spans}[request["parent"]]  # FastAPI's: no request id yet
    assert server["name"] == "POST /v1/chat/completions" and server["parent"] == CLIENT_SPAN
    assert request["attributes"]["gateway.alias"] == "routed" and request["attributes"]["gateway.upstream_calls"] == calls
    handoffs = [span for span in spans if span["name"] == "gateway.handoff"]
    assert len(handoffs) == calls and all(request["id"] in ancestors(span) for span in handoffs)
    for handoff in handoffs:  # each hand-off's one upstream call, beneath it, with its figures
        [call] = [span for span in spans if span["parent"] == handoff["id"]]
        figures = call["attributes"]
        assert call["name"] == "gateway.upstream_call" and figures["gateway.upstream.mode"] == "tokens"
        assert figures["gateway.upstream.completion_tokens"] >= 1 and figures["gateway.upstream.breaker"] == "closed"
        assert handoff["attributes"]["gateway.handoff.source"] == "upstream"
    assert {"gateway.admission", "gateway.decoding"} <= {span["name"] for span in spans}
    [queued] = [span for span in spans if span["name"] == "gateway.queue_wait"]  # waiting for a local sequence
    assert request["id"] in ancestors(queued)
