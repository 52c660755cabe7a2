"""The openai SDK's own calls that used to be refused: tools (passed through whole to a real
upstream server: llama-cpp-python's, whose chatml-function-calling format makes even SmolLM2 call
a named tool; llama.cpp's llama-server needs a model that writes its template's tool tags), structured outputs (a grammar on the token-level path), n, penalties,
logit_bias, streaming of each, and the refusals that are left."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from llama_cpp import Llama
from pydantic import BaseModel, Field

from tests.conftest import ADMIN_KEY, DEMO_KEY, gateway_config, live_gateway

pytestmark = pytest.mark.integration

KEYS = {"TEST_PRIVATE_KEY": "sk-private", "TEST_POOR_KEY": "sk-poor"}
LOCAL_LIMIT = 64
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


class Capital(BaseModel):
    country: str = Field(max_length=24)
    capital: str = Field(max_length=24)


@pytest.fixture(scope="module")
def gateway(smol_tools_upstream, tmp_path_factory):
    config = gateway_config(smol_tools_upstream)
    config["server"]["max_tokens_limit"] = LOCAL_LIMIT
    config["aliases"]["strict"] = {"local": "smol", "upstream": "up", "unsupported": "refuse",
                                   "routing": {"policy": "never"}}
    config["tenants"] += [{"id": "private", "api_key_env": "TEST_PRIVATE_KEY", "allow_upstream": False},
                          {"id": "poor", "api_key_env": "TEST_POOR_KEY", "daily": {"upstream_tokens": 10}}]
    with live_gateway(config, tmp_path_factory.mktemp("dropin"), env=KEYS) as running:
        yield running


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return gateway.client()


def routing_of(usage) -> dict:
    return usage.model_extra["routing"]


# -- tools: passed through whole --

def test_tool_call_and_tool_result_round_trip(client):
    first = client.chat.completions.create(model="routed", messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                           tool_choice=CALL_WEATHER, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert first.choices[0].finish_reason == "tool_calls"
    routing = routing_of(first.usage)
    assert routing["mode"] == "passthrough" and routing["passthrough_reason"] == "tools"
    assert routing["upstream_calls"] == 1 and first.usage.prompt_tokens == routing["upstream_prompt_tokens"] > 0
    assert first.model == "routed" and first.id.startswith("chatcmpl-")

    # content "" rather than null: llama-cpp-python's server refuses null and fails on a missing one
    history = [*ASK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model="routed", messages=history, max_tokens=40, temperature=0)
    assert second.choices[0].message.content
    assert routing_of(second.usage)["passthrough_reason"] == "messages[1].tool_calls"


def test_streamed_tool_call_arrives_in_openai_deltas(client):
    chunks = list(client.chat.completions.create(
        model="routed", messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=CALL_WEATHER, max_tokens=60,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in calls)
    assert isinstance(json.loads(arguments), dict)
    assert len({c.id for c in chunks}) == 1 and {c.model for c in chunks} == {"routed"}
    assert chunks[-1].choices == [] and routing_of(chunks[-1].usage)["mode"] == "passthrough"


def test_tool_message_alone_passes_through_naming_the_message(client):
    history = [*ASK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and clear"}]
    answer = client.chat.completions.create(model="routed", messages=history, max_tokens=20, temperature=0)
    assert routing_of(answer.usage)["passthrough_reason"] == "messages[1].tool_calls"


def test_max_tokens_above_the_local_limit_passes_through(client):
    answer = client.chat.completions.create(model="routed", messages=ASK_WEATHER, max_tokens=LOCAL_LIMIT + 1,
                                            temperature=0)
    assert routing_of(answer.usage)["passthrough_reason"] == "max_tokens"
    assert answer.usage.completion_tokens <= LOCAL_LIMIT + 1


@pytest.mark.parametrize(("model", "key", "param", "why"), [
    ("strict", DEMO_KEY, "tools", "configured to refuse"),
    ("routed", "sk-private", "tools", "may not send requests to the upstream"),
    ("local", DEMO_KEY, "tools", "has no upstream"),
    ("local", DEMO_KEY, "max_tokens", "has no upstream"),
])
def test_refusals_name_the_field_and_say_why(gateway, model, key, param, why):
    fields = {"tools": [WEATHER_TOOL], "max_tokens": 8} if param == "tools" else {"max_tokens": LOCAL_LIMIT + 1}
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client(key).chat.completions.create(model=model, messages=ASK_WEATHER, **fields)
    assert caught.value.body["param"] == param and why in caught.value.body["message"]


def test_image_part_without_an_upstream_is_a_400_naming_the_part(gateway):
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().chat.completions.create(model="local", messages=image, max_tokens=8)
    assert caught.value.body["param"] == "messages[0].content[1]"


def test_pass_through_is_budgeted_and_billed(gateway):
    with pytest.raises(openai.RateLimitError) as caught:
        gateway.client("sk-poor").chat.completions.create(model="routed", messages=ASK_WEATHER,
                                                               tools=[WEATHER_TOOL], max_tokens=8)
    assert caught.value.code == "insufficient_quota"
    before = _billed(gateway)
    answer = gateway.client().chat.completions.create(model="routed", messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                         max_tokens=30, temperature=0)
    assert _billed(gateway) - before == answer.usage.prompt_tokens + answer.usage.completion_tokens
    metrics = httpx.get(f"{gateway.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert 'gateway_passthrough_requests_total{alias="routed",reason="tools"}' in metrics


def _billed(gateway) -> int:
    usage = httpx.get(f"{gateway.base_url}/v1/usage", headers={"Authorization": f"Bearer {DEMO_KEY}"}).json()
    day = next(w for w in usage["windows"] if w["period"] == "day")
    return day["upstream_prompt_tokens"] + day["upstream_completion_tokens"]


# -- structured outputs: a grammar on the token-level path --

@pytest.mark.parametrize("policy", ["never", "always"])
def test_structured_output_parses_local_and_routed(client, policy):
    completion = client.beta.chat.completions.parse(
        model="routed", messages=[{"role": "user", "content": "Name a country and its capital."}],
        response_format=Capital, max_tokens=LOCAL_LIMIT, temperature=0, extra_body={"routing": {"policy": policy}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Capital)
    routing = routing_of(completion.usage)
    assert routing["mode"] == "token_level"
    assert (routing["upstream_tokens"] + routing["cache_tokens"] > 0) == (policy == "always")


def test_json_object_streamed_is_valid_json(client):
    chunks = list(client.chat.completions.create(
        model="routed", messages=[{"role": "user", "content": "Describe a cat as JSON with two short fields."}],
        response_format={"type": "json_object"}, max_tokens=LOCAL_LIMIT, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix the grammar accepts
        assert text.lstrip().startswith("{")


def test_sampled_json_schema_answers_validate(client):
    schema = Capital.model_json_schema()
    completion = client.chat.completions.create(
        model="routed", messages=[{"role": "user", "content": "Name a country and its capital."}], n=2,
        temperature=1.0, seed=3, max_tokens=LOCAL_LIMIT,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    assert len(completion.choices) == 2
    for choice in completion.choices:  # the schema's short fields end well within the limit
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


# -- n, penalties and logit_bias on the local model --

def test_n_choices_with_penalties_streamed_and_not(client):
    params = dict(model="local", messages=[{"role": "user", "content": "Write a short poem about rain."}], n=2,
                  max_tokens=12, temperature=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.5)
    whole = client.chat.completions.create(**params)
    assert [c.index for c in whole.choices] == [0, 1] and all(c.message.content for c in whole.choices)
    streamed = list(client.chat.completions.create(**params, stream=True))
    for index in (0, 1):  # sampled in a batch whose make-up differs: the texts may differ too
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) and mine[-1].finish_reason in ("stop", "length")


def repeated_share(text: str) -> float:
    words = text.lower().split()
    return 1 - len(set(words)) / len(words)


def test_frequency_penalty_reduces_repetition(client):
    params = dict(model="local", messages=[{"role": "user", "content": "Say the word cat twenty times."}],
                  max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**params).choices[0].message.content
    penalised = client.chat.completions.create(**params, frequency_penalty=2.0).choices[0].message.content
    assert repeated_share(penalised) < repeated_share(plain), (plain, penalised)


def test_logit_bias_names_local_token_ids(client, smol_path):
    vocab = Llama(str(smol_path), vocab_only=True, verbose=False)
    token = vocab.tokenize(b" banana", add_bos=False, special=False)[0]
    piece = vocab.detokenize([token]).decode()
    answer = client.chat.completions.create(model="local", messages=ASK_WEATHER, max_tokens=3, temperature=0,
                                            logit_bias={str(token): 100})
    assert answer.choices[0].message.content.split() == [piece.strip()] * 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="local", messages=ASK_WEATHER, max_tokens=3,
                                       logit_bias={str(vocab.n_vocab()): 5})
    assert caught.value.body["param"] == "logit_bias"
