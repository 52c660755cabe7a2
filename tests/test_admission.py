"""Admission: queue limits, token rate limits, tenant alias lists and routing overrides."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import DEMO_KEY, gateway_config, live_gateway

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Tell me a long story about a dragon."}]
KEYS = {"TEST_TPM_KEY": "sk-tpm", "TEST_NARROW_KEY": "sk-narrow", "TEST_SOLO_KEY": "sk-solo",
        "TEST_RPM_KEY": "sk-rpm"}


@pytest.fixture(scope="module")
def gateway(smol_upstream, tmp_path_factory):
    config = gateway_config(smol_upstream)
    config["server"]["queue_limit"] = 0  # no waiting: a second request while one decodes gets 503
    config["models"]["local"]["smol"]["parallel"] = 1
    config["tenants"] += [
        {"id": "tpm", "api_key_env": "TEST_TPM_KEY", "rate_limits": {"tokens_per_minute": 120}},
        {"id": "narrow", "api_key_env": "TEST_NARROW_KEY", "aliases": ["local"],
         "routing": {"policy": "always", "max_upstream_share": 0.5}},
        {"id": "solo", "api_key_env": "TEST_SOLO_KEY", "rate_limits": {"max_parallel": 1}},
        {"id": "rpm", "api_key_env": "TEST_RPM_KEY", "rate_limits": {"requests_per_minute": 3}},
    ]
    with live_gateway(config, tmp_path_factory.mktemp("admission"), env=KEYS) as running:
        yield running


def client(gateway, key: str = DEMO_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


def test_full_queue_is_503_with_retry_after(gateway):
    started = threading.Event()

    def long_stream():
        stream = client(gateway).chat.completions.create(model="local", messages=QUESTION, max_tokens=150, stream=True)
        for _ in stream:
            started.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert started.wait(30)
    with pytest.raises(openai.InternalServerError) as caught:
        client(gateway).chat.completions.create(model="local", messages=QUESTION, max_tokens=2)
    worker.join(60)
    assert caught.value.status_code == 503 and caught.value.code == "overloaded"
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_tokens_per_minute(gateway):
    """120 tokens a calendar minute, counted as prompt + max_tokens: a ~30-token prompt with 20 fits,
    the same with 60 more does not, a small one still does; the refusal says when the minute ends."""
    tpm, hi = client(gateway, "sk-tpm"), [{"role": "user", "content": "hi"}]
    for _ in range(2):  # a pair of requests that straddles a minute's turn is tried once more
        minute = int(time.time() // 60)
        tpm.chat.completions.create(model="local", messages=hi, max_tokens=20)
        try:
            tpm.chat.completions.create(model="local", messages=hi, max_tokens=60)
            refusal = None
        except openai.RateLimitError as exc:
            refusal, refused_at = exc, time.time()
        small = tpm.chat.completions.create(model="local", messages=hi, max_tokens=1)
        if int(time.time() // 60) == minute:
            break
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert small.choices[0].finish_reason in ("stop", "length")  # tokens are counted, not requests
    retry_after = int(refusal.response.headers["retry-after"])
    assert 1 <= retry_after <= round(60 - refused_at % 60) + 1


def test_tenant_alias_list_and_routing_override(gateway):
    narrow = client(gateway, "sk-narrow")
    with pytest.raises(openai.NotFoundError):
        narrow.chat.completions.create(model="routed", messages=QUESTION, max_tokens=2)
    assert [m.id for m in narrow.models.list()] == ["local"]
    answer = narrow.chat.completions.create(model="local", messages=QUESTION, max_tokens=8, temperature=0)
    assert answer.usage.model_extra["routing"]["policy"] == "always"  # the tenant's override applies


def test_out_of_range_share_cap_is_400(gateway):
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": "Bearer sk-narrow"},
                          json={"model": "local", "messages": QUESTION, "max_tokens": 4,
                                "routing": {"max_upstream_share": 2}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "routing.max_upstream_share"


def test_parallel_slot_is_released_when_a_client_leaves_mid_stream(gateway):
    headers = {"Authorization": "Bearer sk-solo"}
    body = {"model": "local", "messages": QUESTION, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as response:
        for line in response.iter_lines():
            if '"content"' in line:
                break  # leave mid-stream
    for _ in range(50):  # the server notices the disconnect within a few decode steps
        retry = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers=headers, timeout=60,
                           json={"model": "local", "messages": QUESTION, "max_tokens": 2})
        if retry.status_code != 503:
            break
        threading.Event().wait(0.2)
    assert retry.status_code == 200, retry.text


def solo_admitted_within(gateway, seconds: float) -> httpx.Response:
    """Poll with the solo tenant (one parallel slot, no queue) until a request is served or time is up."""
    deadline = time.monotonic() + seconds
    while True:
        retry = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": "Bearer sk-solo"},
                           json={"model": "local", "messages": QUESTION, "max_tokens": 2}, timeout=60)
        if retry.status_code == 200 or time.monotonic() > deadline:
            return retry
        time.sleep(0.1)


def test_a_client_that_leaves_a_non_streaming_request_stops_its_decoding(gateway):
    body = {"model": "local", "messages": QUESTION, "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # ~15 s of decoding if nobody stopped it
        httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=0.5,
                   headers={"Authorization": "Bearer sk-solo"})
    retry = solo_admitted_within(gateway, 2.0)
    assert retry.status_code == 200, retry.text


def test_a_stream_whose_client_leaves_before_the_first_event_frees_its_slot(gateway):
    body = json.dumps({"model": "local", "messages": QUESTION, "max_tokens": 1000, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-solo\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(head + body)  # and hang up without reading a byte
    retry = solo_admitted_within(gateway, 2.0)
    assert retry.status_code == 200, retry.text


def wait_for_a_fresh_minute(margin_s: float = 15.0) -> None:
    """Start a run of per-minute requests no later than `margin_s` before the minute turns."""
    if time.time() % 60 > 60 - margin_s:
        time.sleep(60.5 - time.time() % 60)


def test_a_prompt_past_the_context_counts_against_the_rate_limit_before_it_is_tokenized(gateway):
    """Security round three: prompts too long for the context were tokenized and refused before the
    rate limiter, so they never counted. Now the limiter comes first: the fourth such request in a
    minute is a 429, and nothing of it is tokenized."""
    huge = [{"role": "user", "content": "word " * 20_000}]  # far past the 2,048-token context
    wait_for_a_fresh_minute()
    statuses = []
    for _ in range(4):
        try:
            client(gateway, "sk-rpm").chat.completions.create(model="local", messages=huge, max_tokens=1)
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
    assert statuses == [400, 400, 400, 429]


def test_a_huge_prompt_is_tokenized_off_the_event_loop(gateway):
    """A 900 kB prompt takes about a second to tokenize: a health probe sent meanwhile is answered
    before that request's own answer (a 400: it is past the context), not after it."""
    huge = {"model": "local", "max_tokens": 1, "messages": [{"role": "user", "content": "lorem ipsum " * 75_000}]}
    finished: list[str] = []

    def big() -> None:
        httpx.post(f"{gateway.base_url}/v1/chat/completions", json=huge, timeout=60,
                   headers={"Authorization": f"Bearer {DEMO_KEY}"})
        finished.append("big")

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(0.3)  # the body is sent and being tokenized
    assert httpx.get(f"{gateway.base_url}/health/live", timeout=30).status_code == 200
    finished.append("health")
    worker.join(60)
    assert finished == ["health", "big"]
