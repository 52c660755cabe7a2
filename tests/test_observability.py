"""Metrics, health and logs, read through HTTP and the gateway's own log output like an operator."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.app import create_app
from gateway.logs import JsonFormatter, RequestIdFilter, request_id_var
from gateway.settings import Settings
from tests.conftest import ADMIN_KEY, DEMO_KEY, gateway_config, live_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

ALLOWED_LABELS = {"endpoint", "method", "alias", "status", "source", "reason", "model", "outcome", "le"}
API_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{response_id}",
                 "/v1/models", "/v1/usage", "/admin/tenants/{tenant_id}/usage"}
TIGHT_KEY = "sk-tight-budget"
CANARY = f"CANARY-{uuid.uuid4().hex}"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


# -- without a model: the app factory and the log format --

def fake_app():
    async def start(_settings):
        async def close():
            pass
        return SimpleNamespace(aliases={}, local_models={}, shadow=None, closed=False, close=close,
                               tenants=SimpleNamespace(authenticate=lambda _key: None,
                                                       is_admin=lambda key: key == ADMIN_KEY))

    return create_app(Settings.model_validate(gateway_config(None)), start_runtime=start)


def test_each_app_has_its_own_registry():
    first, second = fake_app(), fake_app()
    with TestClient(first) as one, TestClient(second) as two:
        assert one.post("/v1/chat/completions", json={}).status_code == 401
        assert one.get("/metrics").status_code == 401  # the admin key's only, by default
        text = one.get("/metrics", headers=ADMIN)
        assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
        assert value(samples(text.text), "gateway_chat_requests_total", alias="unknown", status="4xx") == 1
        assert value(samples(two.get("/metrics", headers=ADMIN).text), "gateway_chat_requests_total", alias="unknown", status="4xx") == 0


def test_every_api_endpoint_is_counted_under_its_route_template():
    wrong = {"Authorization": "Bearer sk-wrong"}
    calls = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
             ("GET", "/v1/responses/resp_private42"), ("DELETE", "/v1/responses/resp_private42"),
             ("GET", "/v1/models"), ("GET", "/v1/usage"), ("GET", "/admin/tenants/tenant-private/usage")]
    uncounted = [("GET", f"/v1/nope-{CANARY}"), ("PATCH", "/v1/models"), ("BREW", "/v1/models"),
                 ("GET", "/health/live"), ("GET", "/playground")]
    with TestClient(fake_app()) as client:
        for method, path in calls + uncounted:
            client.request(method, path, headers=wrong, json={} if method == "POST" else None)
        text = client.get("/metrics", headers=ADMIN).text
    m = samples(text)
    for method, path in calls:
        endpoint = path.replace("resp_private42", "{response_id}").replace("tenant-private", "{tenant_id}")
        assert value(m, "gateway_requests_total", endpoint=endpoint, method=method, alias="unknown", status="4xx") == 1
        assert value(m, "gateway_request_errors_total", endpoint=endpoint, method=method, alias="unknown",
                     reason="invalid_api_key") == 1
    counted = {dict(labels)["endpoint"] for name, labels in m if name == "gateway_requests_total"}
    assert counted == API_ENDPOINTS and sum(v for (name, _), v in m.items() if name == "gateway_requests_total") == 8
    assert "private" not in text and CANARY not in text and "BREW" not in text and "PATCH" not in text
    # the chat-only series, as dashboards read them before: chat completions and nothing else
    assert value(m, "gateway_chat_requests_total", alias="unknown", status="4xx") == 1
    assert value(m, "gateway_chat_errors_total", alias="unknown", reason="invalid_api_key") == 1


def test_json_log_lines_carry_the_request_id_and_mask_keys():
    record = logging.makeLogRecord({"name": "gateway.t", "levelname": "INFO", "msg": "auth: Bearer sk-abc123 seen",
                                    "tokens": {"local": 3}})
    token = request_id_var.set("req-42")
    try:
        RequestIdFilter().filter(record)
    finally:
        request_id_var.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req-42" and line["tokens"] == {"local": 3} and line["logger"] == "gateway.t"
    assert "sk-abc123" not in line["msg"]


# -- a live gateway with a real upstream --

@pytest.fixture(scope="module")
def gateway(smol_llama_server, tmp_path_factory):
    config = gateway_config(smol_llama_server, mode="tokens")
    config["tenants"].append({"id": "tight", "api_key_env": "TEST_TIGHT_KEY", "daily": {"upstream_tokens": 0}})
    with live_gateway(config, tmp_path_factory.mktemp("obs"), env={"TEST_TIGHT_KEY": TIGHT_KEY}) as running:
        yield running


def chat(client: httpx.Client, key: str = DEMO_KEY, stream: bool = False, rid: str = "obs", prompt: str = "Say hi.",
         **body) -> httpx.Response:
    payload = {"model": "routed", "messages": [{"role": "user", "content": f"{prompt} {CANARY}"}],
               "max_tokens": 6, "temperature": 0, "seed": 3, "stream": stream, **body}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return client.post("/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key}",
                                                                        "x-request-id": rid})


def streamed_usage(response: httpx.Response) -> dict:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


@pytest.fixture(scope="module")
def traffic(gateway):
    """One of each kind of request; returns the usage blocks the gateway reported."""
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        always = {"policy": "always"}
        first = chat(client, stream=True, routing=always, rid="obs-stream")
        assert first.status_code == 200 and first.headers["x-request-id"] == "obs-stream"
        cached = chat(client, routing=always)  # same greedy prefixes: answered from the cache
        local = chat(client, model="local")
        tight = chat(client, key=TIGHT_KEY, routing=always, prompt="Say bye.")  # not cached: must reserve
        assert chat(client, key="sk-wrong").status_code == 401
        assert chat(client, model=f"nope-{CANARY}").status_code == 404
        metrics = client.get("/metrics", headers=ADMIN)
    assert all(r.status_code == 200 for r in (cached, local, tight))
    usages = {"stream": streamed_usage(first), "cached": cached.json()["usage"], "local": local.json()["usage"],
              "tight": tight.json()["usage"]}
    return usages, metrics



@pytest.mark.integration
def test_health_endpoints(gateway):
    assert httpx.get(f"{gateway.base_url}/health/live").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.base_url}/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert set(ready.json()["queue_depth"]) == {"smol"}


@pytest.mark.integration
def test_metrics_count_requests_tokens_and_upstream_calls(traffic):
    usages, response = traffic
    assert response.status_code == 200
    m = samples(response.text)
    assert value(m, "gateway_chat_requests_total", alias="routed", status="2xx") == 3
    assert value(m, "gateway_chat_requests_total", alias="local", status="2xx") == 1
    assert value(m, "gateway_chat_requests_total", alias="unknown", status="4xx") == 2
    assert value(m, "gateway_chat_errors_total", alias="unknown", reason="invalid_api_key") == 1
    assert value(m, "gateway_chat_errors_total", alias="unknown", reason="model_not_found") == 1

    routed = [usages[k]["routing"] for k in ("stream", "cached", "tight")]
    for source in ("local", "upstream", "cache"):
        expected = sum(r[f"{source}_tokens"] for r in routed)
        assert value(m, "gateway_completion_tokens_total", alias="routed", source=source) == expected, source
    assert usages["stream"]["routing"]["upstream_tokens"] > 0 and usages["cached"]["routing"]["cache_tokens"] > 0
    assert value(m, "gateway_cache_hits_total", alias="routed") >= 1
    assert value(m, "gateway_upstream_calls_total", alias="routed") == sum(r["upstream_calls"] for r in routed)
    assert value(m, "gateway_upstream_prompt_tokens_total", alias="routed") == sum(
        r["upstream_prompt_tokens"] for r in routed)
    assert value(m, "gateway_upstream_latency_seconds_count", alias="routed") == usages["stream"]["routing"]["upstream_calls"]
    assert value(m, "gateway_upstream_cached_tokens_total", alias="routed") == sum(
        r["upstream_cached_tokens"] for r in routed) > 0
    assert value(m, "gateway_upstream_compute_seconds_total", alias="routed") == pytest.approx(
        sum(r["upstream_compute_ms"] for r in routed) / 1000, abs=1e-3)
    assert usages["tight"]["routing"]["degraded"] == ["budget_exhausted"], usages["tight"]
    assert value(m, "gateway_degraded_requests_total", alias="routed", reason="budget_exhausted") == 1
    assert value(m, "gateway_time_to_first_token_seconds_count", alias="routed") == 3
    assert value(m, "gateway_token_latency_seconds_count", alias="routed", source="upstream") >= 1
    assert value(m, "gateway_token_latency_seconds_count", alias="local", source="local") >= 1
    assert value(m, "gateway_queue_depth", alias="routed") == 0


@pytest.mark.integration
def test_engine_counters_show_the_look_ahead_at_work(traffic):
    _, response = traffic
    m = samples(response.text)
    [model] = {dict(labels)["model"] for name, labels in m if name == "gateway_engine_steps_total"}
    taken = value(m, "gateway_engine_look_ahead_guesses_total", model=model, outcome="taken")
    dropped = value(m, "gateway_engine_look_ahead_guesses_total", model=model, outcome="dropped")
    # the greedy local-only answer's tokens after its first were each guessed ahead (6 tokens at most)
    assert 1 <= taken and taken + dropped < value(m, "gateway_engine_steps_total", model=model)


@pytest.mark.integration
def test_metric_labels_stay_low_cardinality(traffic):
    _, response = traffic
    for (name, labels) in samples(response.text):
        if name.startswith("gateway_"):
            assert {key for key, _ in labels} <= ALLOWED_LABELS, name
    assert CANARY not in response.text and "nope-" not in response.text
    assert "demo" not in response.text and "tight" not in response.text  # tenant ids are not labels


@pytest.mark.integration
def test_logs_are_json_with_request_ids_and_never_hold_prompts_or_keys(gateway, traffic):
    logs = gateway.logs()
    assert CANARY not in logs
    assert DEMO_KEY not in logs and TIGHT_KEY not in logs and "sk-wrong" not in logs
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    done = [line for line in lines if line.get("request_id") == "obs-stream"]
    assert done, "no log line carries the request id"
    summary = done[-1]
    assert summary["path"] == "/v1/chat/completions" and summary["status"] == 200 and summary["alias"] == "routed"
    assert summary["tenant"] == "demo" and summary["tokens"]["upstream"] > 0 and summary["ttft_ms"] > 0


@pytest.mark.integration
def test_completions_and_responses_are_counted_under_their_endpoints(gateway):
    auth = {"authorization": f"Bearer {DEMO_KEY}"}
    with httpx.Client(base_url=gateway.base_url, timeout=60, headers=auth) as client:
        before = samples(client.get("/metrics", headers=ADMIN).text)
        completed = client.post("/v1/completions", headers={"x-request-id": "obs-completion"},
                                json={"model": "local", "prompt": "The capital of France is", "max_tokens": 4})
        answered = client.post("/v1/responses", json={"model": "local", "input": "Say hi.", "max_output_tokens": 4})
        assert completed.status_code == 200 and answered.status_code == 200
        assert client.get(f"/v1/responses/{answered.json()['id']}").status_code == 200
        scraped = client.get("/metrics", headers=ADMIN).text
    after = samples(scraped)

    def counted(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"alias": "local", "status": "2xx"}
    assert counted("gateway_requests_total", endpoint="/v1/completions", method="POST", **ok) == 1
    assert counted("gateway_requests_total", endpoint="/v1/responses", method="POST", **ok) == 1
    assert counted("gateway_requests_total", endpoint="/v1/responses/{response_id}", method="GET", alias="unknown",
                   status="2xx") == 1
    assert counted("gateway_chat_requests_total", **ok) == 0  # the chat-only series stays chat-only
    assert counted("gateway_time_to_first_token_seconds_count", alias="local") == 2
    assert answered.json()["id"] not in scraped
    lines = [json.loads(line) for line in gateway.logs().splitlines() if line.startswith("{")]
    [logged] = [line for line in lines if line.get("request_id") == "obs-completion"]
    assert logged["endpoint"] == "/v1/completions" and logged["alias"] == "local" and logged["tenant"] == "demo"


@pytest.mark.integration
def test_metrics_can_be_scraped_while_a_stream_runs(gateway):
    async def scrape_during_stream():
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            payload = {"model": "local", "messages": [{"role": "user", "content": "Count to five."}],
                       "max_tokens": 8, "temperature": 0, "stream": True}
            stream = asyncio.create_task(client.post("/v1/chat/completions", json=payload,
                                                     headers={"authorization": f"Bearer {DEMO_KEY}"}))
            scraped = await client.get("/metrics", headers=ADMIN)
            return scraped, await stream

    scraped, streamed = asyncio.run(scrape_during_stream())
    assert scraped.status_code == 200 and streamed.status_code == 200
    assert "gateway_queue_depth" in scraped.text


@pytest.mark.integration
def test_a_dead_upstream_is_counted_and_its_errors_do_not_leak_the_prompt(tmp_path):
    with socket.socket() as closed:  # a port that nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    with live_gateway(gateway_config(dead), tmp_path) as gateway, httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        response = chat(client, routing={"policy": "always"}, prompt="Say hello.")
        metrics = samples(client.get("/metrics", headers=ADMIN).text)
        logs = gateway.logs()
    assert response.status_code == 200
    assert response.json()["usage"]["routing"]["degraded"] == ["upstream_unavailable"]
    assert value(metrics, "gateway_upstream_errors_total", alias="routed", reason="error") >= 1
    assert value(metrics, "gateway_degraded_requests_total", alias="routed", reason="upstream_unavailable") == 1
    assert CANARY not in logs and DEMO_KEY not in logs
