"""The Responses API against a live gateway, driven by the official openai SDK and the OpenAI
Agents SDK, unmodified: text answers on the token-level path (with routing provenance), structured
output through the grammar path, function calls passed through whole to a real upstream server
(llama-cpp-python's, whose grammar-driven tool calling makes even SmolLM2 call a named tool),
stored conversations that only their tenant can read, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import uuid

import agents
import httpx
import openai
import pytest

from tests.conftest import DEMO_KEY, gateway_config, live_gateway
from tests.test_dropin import Capital  # the same pydantic model the chat tests parse into

pytestmark = pytest.mark.integration

OTHER_KEY = "sk-other-tenant"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_WEATHER = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def gateway(smol_tools_upstream, tmp_path_factory):
    config = gateway_config(smol_tools_upstream)
    config["upstreams"]["up"]["kind"] = "llama-cpp-python"  # its parser wants content, never null
    config["tenants"].append({"id": "other", "api_key_env": "TEST_OTHER_KEY"})
    with live_gateway(config, tmp_path_factory.mktemp("responses"), env={"TEST_OTHER_KEY": OTHER_KEY}) as running:
        yield running


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return gateway.client()


def test_a_text_response_is_routed_token_by_token(client):
    response = client.responses.create(model="routed", input="Name the capital of France.", max_output_tokens=16,
                                       temperature=0, instructions="Answer in one short sentence.")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "routed"
    assert response.output_text and response.output[0].type == "message"
    assert response.status in ("completed", "incomplete")
    routing = response.usage.model_extra["routing"]
    assert routing["mode"] == "token_level"
    written = routing["local_tokens"] + routing["upstream_tokens"] + routing["cache_tokens"]
    assert written == response.usage.output_tokens
    assert response.usage.input_tokens > 10 and response.instructions == "Answer in one short sentence."


def test_a_streamed_response_follows_the_responses_event_sequence(client):
    # the raw events (responses.stream() rebuilds each event and drops the `routing` extension)
    events = list(client.responses.create(model="routed", input="Count from one to five.", max_output_tokens=12,
                                          temperature=0, stream=True))
    final = events[-1].response  # response.completed, or response.incomplete if the answer was cut
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(d.delta for d in deltas) == final.output_text
    assert {d.model_extra["routing"]["source"] for d in deltas} <= {"local", "upstream", "cache"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.model_extra["routing"]["mode"] == "token_level"


def test_parse_with_a_pydantic_model_follows_the_schema_locally(client):
    response = client.responses.parse(model="routed", input="France: its country name and capital, as JSON.",
                                      text_format=Capital, max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, Capital)
    assert response.usage.model_extra["routing"]["mode"] == "token_level"


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="routed", input="My name is Ada. Say hello.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model="routed", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # the second prompt holds the first turn: its input, its answer, then the new question
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_stored_responses_belong_to_their_tenant(gateway, client):
    response = client.responses.create(model="routed", input="Hi", max_output_tokens=4, temperature=0)
    other = gateway.client(OTHER_KEY)
    for attempt in (lambda: other.responses.retrieve(response.id), lambda: other.responses.delete(response.id),
                    lambda: other.responses.create(model="routed", input="Go on", previous_response_id=response.id,
                                                   max_output_tokens=4)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(response.id).id == response.id  # still there for its owner
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    assert caught.value.body["code"] == "not_found"


def test_store_false_keeps_nothing(client):
    response = client.responses.create(model="routed", input="Hi", max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="routed", input="Go on", previous_response_id=response.id, max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"


def test_store_false_leaves_nothing_in_the_continuation_cache(client):
    prompt = f"Spell the word {uuid.uuid4().hex[:6]}."  # no other request has asked it

    def ask(store: bool):
        return client.responses.create(model="routed", input=prompt, max_output_tokens=4, temperature=0, store=store,
                                       extra_body={"routing": {"policy": "always"}})  # every token from upstream

    unstored = ask(False)
    routing = unstored.usage.model_extra["routing"]
    assert routing["upstream_calls"] > 0
    assert unstored.usage.input_tokens_details.cached_tokens == 0  # a local count: the upstream's cache is not its
    assert ask(False).usage.model_extra["routing"]["cache_tokens"] == 0  # the first kept nothing to reuse
    ask(True)
    assert ask(True).usage.model_extra["routing"]["cache_tokens"] > 0  # while a stored one does keep its hand-offs


def test_echoed_annotations_past_openais_limits_are_a_400_naming_the_field(gateway):
    # each would be echoed in the Response and stored with it for 30 days
    for field, value in (("user", "u" * 900_000), ("prompt_cache_key", "k" * 65), ("safety_identifier", "s" * 65),
                         ("service_tier", "x" * 100), ("metadata", {f"k{i}": "v" for i in range(17)}),
                         ("metadata", {"k": "v" * 513})):
        reply = httpx.post(f"{gateway.base_url}/v1/responses", headers={"Authorization": f"Bearer {DEMO_KEY}"},
                           json={"model": "routed", "input": "Hi", "max_output_tokens": 1, field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (field, reply.text[:200])


def test_past_its_quota_a_tenant_is_answered_but_not_stored(tmp_path):
    config = gateway_config(None, store={"backend": "memory", "responses_max_per_tenant": 2})
    with live_gateway(config, tmp_path) as small:
        client = small.client()

        def ask(**fields):
            return client.responses.create(model="local", input="Hi", max_output_tokens=2, **fields)

        first, second, third = ask(), ask(), ask()
        assert (first.store, second.store, third.store) == (True, True, False)  # it says so
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(third.id)
        client.responses.delete(first.id)  # frees its place
        kept, over = list(ask(stream=True)), list(ask(stream=True))
        assert kept[-1].response.store is True and client.responses.retrieve(kept[-1].response.id)
        assert over[0].response.store is True and over[-1].response.store is False  # asked for, then not kept


def test_function_call_round_trip_passes_through(client):
    first = client.responses.create(model="routed", input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice=CALL_WEATHER, max_output_tokens=60, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert first.usage.model_extra["routing"]["mode"] == "passthrough"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}
    second = client.responses.create(model="routed", previous_response_id=first.id, input=[result],
                                     max_output_tokens=30, temperature=0)
    assert second.output_text
    assert second.usage.model_extra["routing"]["passthrough_reason"] == "messages[1].tool_calls"  # the call


def test_a_streamed_function_call_arrives_as_argument_deltas(client):
    with client.responses.stream(model="routed", input="Weather in Rome?", tools=[WEATHER_TOOL],
                                 tool_choice=CALL_WEATHER, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and isinstance(json.loads(call.arguments), dict)
    assert any(e.type == "response.function_call_arguments.done" for e in events)


def test_errors_are_openai_shaped_and_name_the_field(gateway, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="nope", input="Hi")
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="routed", input="Hi", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools[0].type"
    reply = httpx.post(f"{gateway.base_url}/v1/responses", headers={"Authorization": f"Bearer {DEMO_KEY}"},
                       json={"model": "routed", "input": "Hi", "bogus": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "bogus"
    with pytest.raises(openai.AuthenticationError):
        gateway.client("sk-wrong").responses.create(model="routed", input="Hi")


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(gateway):
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"21 C and clear in {city}"

    model = agents.OpenAIResponsesModel(
        model="routed", openai_client=openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=DEMO_KEY))
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           run_config=agents.RunConfig(tracing_disabled=True)))
    assert len(calls) == 1 and result.final_output == f"21 C and clear in {calls[0]}"
