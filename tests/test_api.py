"""The HTTP surface, driven like users drive it: the openai SDK, curl, litellm, raw HTTP."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, DEMO_KEY, gateway_config, live_gateway, router_file

pytestmark = pytest.mark.integration

KEYS = {"TEST_RPM_KEY": "sk-rpm", "TEST_BROKE_KEY": "sk-broke", "TEST_PRIVATE_KEY": "sk-private"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(smol_upstream, tmp_path_factory):
    config = gateway_config(smol_upstream)
    config["tenants"] += [
        {"id": "rpm", "api_key_env": "TEST_RPM_KEY", "rate_limits": {"requests_per_minute": 1}},
        {"id": "broke", "api_key_env": "TEST_BROKE_KEY", "daily": {"upstream_tokens": 0}, "on_budget_exhausted": "refuse"},
        {"id": "private", "api_key_env": "TEST_PRIVATE_KEY", "allow_upstream": False},
    ]
    tmp = tmp_path_factory.mktemp("api")
    config["aliases"]["learned"] = {"local": "smol", "upstream": "up", "routing": {
        "policy": "learned", "target_fraction": 0.1, "router": router_file(tmp)}}
    # a share the router was not fitted for starts where the threshold comes from traffic
    config["aliases"]["learned-traffic"] = {"local": "smol", "upstream": "up", "routing": {
        "policy": "learned", "target_fraction": 0.5, "threshold_from": "traffic", "router": router_file(tmp)}}
    with live_gateway(config, tmp, env=KEYS) as running:
        yield running


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=DEMO_KEY, max_retries=0)


def ask(client, **kw):
    params = dict(model="routed", messages=QUESTION, max_tokens=12, temperature=0)
    params.update(kw)
    return client.chat.completions.create(**params)


def routing_of(usage) -> dict:
    return usage.model_extra["routing"]


def test_non_streaming_answer_with_routing_usage(client):
    raw = client.chat.completions.with_raw_response.create(
        model="routed", messages=QUESTION, max_tokens=12, temperature=0)
    completion = raw.parse()
    assert completion.id.startswith("chatcmpl-")
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    routing = routing_of(completion.usage)
    assert routing["local_tokens"] + routing["upstream_tokens"] + routing["cache_tokens"] == completion.usage.completion_tokens
    assert routing["policy"] == "entropy"
    assert "policy=entropy" in raw.headers["x-routing-summary"]
    assert raw.headers["x-request-id"]


def test_streaming_matches_non_streaming_and_frames_like_openai(client):
    full = ask(client, extra_body={"routing": {"policy": "always"}})
    chunks = list(ask(client, stream=True, stream_options={"include_usage": True},
                      extra_body={"routing": {"policy": "always"}}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert {c.model_extra["routing"]["source"] for c in content} <= {"upstream", "cache"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    routing = routing_of(usage_chunk.usage)
    assert routing["local_tokens"] == 0 and routing["upstream_tokens"] + routing["cache_tokens"] > 0


def test_routing_override_never_and_always(client):
    never = ask(client, extra_body={"routing": {"policy": "never"}})
    assert routing_of(never.usage)["upstream_tokens"] == 0 and routing_of(never.usage)["upstream_calls"] == 0
    always = ask(client, max_tokens=6, seed=1, extra_body={"routing": {"policy": "always", "max_upstream_tokens": 3}})
    routing = routing_of(always.usage)
    assert 0 < routing["upstream_tokens"] + routing["cache_tokens"] <= 3 + 1  # a re-merged boundary may add one


def test_learned_policy_serves_its_router_and_refuses_a_share_it_was_not_fitted_for(client):
    answer = ask(client, model="learned", max_tokens=8, extra_body={"routing": {"target_fraction": 0.2}})
    assert routing_of(answer.usage)["policy"] == "learned"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model="learned", extra_body={"routing": {"target_fraction": 0.9}})
    assert caught.value.body["param"] == "routing.target_fraction" and "0.1, 0.2" in caught.value.body["message"]
    # a threshold taken from traffic serves any share
    answer = ask(client, model="learned", max_tokens=8,
                 extra_body={"routing": {"target_fraction": 0.9, "threshold_from": "traffic"}})
    assert routing_of(answer.usage)["policy"] == "learned"
    assert routing_of(ask(client, model="learned-traffic", max_tokens=8).usage)["policy"] == "learned"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model="learned", extra_body={"routing": {"threshold_from": "fit rows"}})
    assert caught.value.body["param"] == "routing.threshold_from"


def test_logprobs_from_the_local_model(client):
    completion = ask(client, logprobs=True, top_logprobs=3, extra_body={"routing": {"policy": "never"}})
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the top token


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"routing": {"policy": "entropy", "threshold": "high"}}, "routing.threshold"),
        ({"routing": {"policy": "top1"}}, "routing.threshold"),
        ({"routing": {"colour": "red"}}, "routing.colour"),
        ({"n": 9}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_bad_fields_are_400_naming_the_param(client, body, param):
    params = dict(model="routed", messages=QUESTION, max_tokens=4)
    params.update({k: v for k, v in body.items() if k in ("messages", "max_tokens", "n", "temperature", "tools")})
    extra = {k: v for k, v in body.items() if k not in params}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**params, extra_body=extra or None)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, messages=[{"role": "user", "content": "word " * 5000}])
    assert caught.value.code == "context_length_exceeded"


def test_auth_and_model_errors(gateway):
    base = f"{gateway.base_url}/v1"
    with pytest.raises(openai.AuthenticationError):
        ask(openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0))
    with pytest.raises(openai.NotFoundError) as caught:
        ask(openai.OpenAI(base_url=base, api_key=DEMO_KEY, max_retries=0), model="gpt-17")
    assert caught.value.code == "model_not_found"
    response = httpx.post(f"{base}/chat/completions", json={"model": "routed", "messages": QUESTION})
    assert response.status_code == 401 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_invalid_json_and_unknown_path_keep_the_openai_shape(gateway):
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.get(f"{gateway.base_url}/v1/nothing-here", headers=headers)
    assert response.status_code == 404 and "error" in response.json()


def test_rate_limit_is_429_with_retry_after(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-rpm", max_retries=0)
    if time.time() % 60 > 45:  # the window is a calendar minute: both requests must fall in one
        time.sleep(61 - time.time() % 60)
    ask(client, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as caught:
        ask(client, max_tokens=1)
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_exhausted_budget_refuses_with_insufficient_quota(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-broke", max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        ask(client)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_upstream_forbidden_tenant_never_reaches_upstream(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-private", max_retries=0)
    completion = ask(client, extra_body={"routing": {"policy": "always"}})
    routing = routing_of(completion.usage)
    assert routing["upstream_calls"] == 0 and routing["upstream_tokens"] == 0
    assert routing["local_tokens"] == completion.usage.completion_tokens > 0
    assert "upstream_forbidden" in routing["degraded"]


def test_models_lists_the_aliases(client):
    assert {m.id for m in client.models.list()} == {"routed", "local", "learned", "learned-traffic"}


def test_usage_endpoints_and_admin_permissions(gateway, client):
    ask(client, extra_body={"routing": {"policy": "always"}}, max_tokens=3)
    mine = httpx.get(f"{gateway.base_url}/v1/usage", headers={"Authorization": f"Bearer {DEMO_KEY}"}).json()
    assert mine["tenant"] == "demo" and [w["period"] for w in mine["windows"]] == ["day", "month"]
    assert mine["windows"][0]["upstream_prompt_tokens"] > 0 and mine["windows"][0]["requests"] > 0
    admin = httpx.get(f"{gateway.base_url}/admin/tenants/demo/usage", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200 and admin.json()["windows"][1]["requests"] >= mine["windows"][1]["requests"]
    forbidden = httpx.get(f"{gateway.base_url}/admin/tenants/demo/usage", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    assert forbidden.status_code == 403
    assert httpx.get(f"{gateway.base_url}/v1/usage").status_code == 401


def test_curl_sees_openai_sse_framing(gateway):
    body = json.dumps({"model": "routed", "messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True})
    result = subprocess.run(
        ["curl", "-sN", f"{gateway.base_url}/v1/chat/completions", "-H", f"Authorization: Bearer {DEMO_KEY}",
         "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=60)
    events = [block for block in result.stdout.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in events if not block.startswith(":"))
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_litellm_as_a_client(gateway):
    from adapters.litellm_client import litellm as configured

    litellm = configured()  # as the gateway configures it: the bundled price map, no fetch
    response = litellm.completion(model="openai/routed", api_base=f"{gateway.base_url}/v1", api_key=DEMO_KEY,
                                  messages=QUESTION, max_tokens=5, temperature=0)
    assert response.choices[0].message.content
    assert response.usage.completion_tokens > 0


def test_continue_final_message_continues_the_assistant_turn(client):
    full = ask(client, model="local", max_tokens=16).choices[0].message.content
    words = full.split(" ")
    prefix = " ".join(words[:3])
    continued = client.chat.completions.create(
        model="local", max_tokens=16, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "content": prefix}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    ).choices[0].message.content
    assert (prefix + continued)[: len(full) - 8] == full[: len(full) - 8]


def test_sampling_is_reproducible_with_a_seed(client):
    def sample(seed):
        return ask(client, model="local", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed).choices[0].message.content

    sample(11)  # the next two then reuse the same cached prompt: the same batch shapes, bit for bit
    first = sample(11)
    assert sample(11) == first
    assert len({first, sample(12), sample(13), sample(14)}) > 1
    assert sample(-268)  # OpenAI's seed is any 64-bit integer: a negative one is served, not a 500


def test_concurrent_requests_do_not_disturb_each_other(gateway):
    import asyncio

    prompts = ["Name a fruit.", "What is 2+2?", "Say hi.", "Name a river."]

    async def both():
        async_client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=DEMO_KEY, max_retries=0)

        async def one(text):
            answer = await async_client.chat.completions.create(
                model="routed", messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0)
            return answer.choices[0].message.content

        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]
        return together, alone

    together, alone = asyncio.run(both())
    assert together == alone


def test_oversized_body_is_a_clear_400(gateway):
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {DEMO_KEY}"},
                          json={"model": "routed", "messages": [{"role": "user", "content": "x" * 1_100_000}]})
    assert response.status_code == 400 and "exceeds" in response.json()["error"]["message"]


def test_n_choices_decode_together_streamed_or_not(client):
    reply = ask(client, n=2, temperature=0.9, seed=3, max_tokens=10, logprobs=True,
                extra_body={"routing": {"policy": "never"}})
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert all(choice.message.content and choice.finish_reason in ("stop", "length") for choice in reply.choices)
    per_choice = [len(choice.logprobs.content) for choice in reply.choices]
    assert routing_of(reply.usage)["local_tokens"] == reply.usage.completion_tokens == sum(per_choice)
    texts, finished = {0: "", 1: ""}, {}
    for part in ask(client, n=2, temperature=0.9, seed=3, max_tokens=10, stream=True):
        for choice in part.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert all(texts.values()) and set(finished) == {0, 1}
