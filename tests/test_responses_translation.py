"""The Responses API's translation to and from chat completions (unit: no model, no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.responses.events import ResponseEvents
from gateway.responses.output import ResponseDraft, conversation_messages, response_of
from gateway.responses.request import ResponsesRequest, chat_request, input_messages
from gateway.wire.errors import InvalidRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "routed", "input": "Hi", **fields})


def test_a_string_is_one_user_message_after_the_instructions():
    body = request(instructions="Be brief.", max_output_tokens=20, temperature=0)
    chat = chat_request(body, input_messages(body.input))
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.stream) == (20, 0, False)


def test_input_is_optional_after_instructions_or_a_stored_conversation():
    body = request(input=None, instructions="Greet the user.")
    assert [m.role for m in chat_request(body, input_messages(body.input)).messages] == ["system"]
    body = request(input=None)
    stored = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert [m.role for m in chat_request(body, stored + input_messages(body.input)).messages] == ["user", "assistant"]


def test_items_become_chat_messages_and_calls_join_the_assistant_turn():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25 C"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    messages = input_messages(items)
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]}
    assert messages[1]["content"] == [{"type": "text", "text": "Checking."}]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                            {"role": "tool", "tool_call_id": "call_2", "content": "25 C"}]
    assert len(messages) == 4


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": None}, "input"),  # no input, no instructions, no conversation: nothing to answer
])
def test_what_chat_completions_cannot_express_is_a_400_naming_the_field(fields, param):
    body = request(**fields)
    with pytest.raises(InvalidRequest) as caught:
        chat_request(body, input_messages(body.input))
    assert caught.value.param == param


def test_function_tools_structured_output_and_logprobs_map_onto_chat_fields():
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}
    body = request(tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                   text={"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}},
                   include=["message.output_text.logprobs"], top_logprobs=2, stream=True)
    chat = chat_request(body, input_messages(body.input))
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    allowed = request(tool_choice={"type": "allowed_tools", "mode": "required",
                                   "tools": [{"type": "function", "name": "get_weather"}]})
    assert chat_request(allowed, input_messages(allowed.input)).tool_choice == {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert (chat.logprobs, chat.top_logprobs, chat.stream_options.include_usage) == (True, 2, True)


@pytest.mark.parametrize(("fields", "param"), [
    ({"user": "u" * 65}, "user"),
    ({"safety_identifier": "s" * 65}, "safety_identifier"),
    ({"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
    ({"service_tier": "x" * 1000}, "service_tier"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_what_a_response_echoes_is_held_to_openais_limits(fields, param):
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    assert caught.value.errors()[0]["loc"][0] == param


def test_openais_limits_themselves_are_accepted():
    body = request(user="u" * 64, safety_identifier="s" * 64, prompt_cache_key="k" * 64, service_tier="flex",
                   metadata={f"{i:064d}": "v" * 512 for i in range(16)})
    assert ResponseDraft(body).render([], "completed", None)["service_tier"] == "flex"


def test_store_false_reaches_the_chat_request_so_nothing_is_cached():
    assert chat_request(request(store=False), [{"role": "user", "content": "Hi"}]).store is False
    assert chat_request(request(), [{"role": "user", "content": "Hi"}]).store is None  # not forwarded upstream


@pytest.mark.parametrize(("usage", "cached"), [
    # token-level: input_tokens is the local count; the upstream's 94 cached are of its own prompts
    ({"prompt_tokens": 34, "routing": {"mode": "token_level", "upstream_cached_tokens": 94}}, 0),
    # passed through: input_tokens is the upstream's own count, and so is its cached share
    ({"prompt_tokens": 34, "routing": {"mode": "passthrough", "upstream_cached_tokens": 20}}, 20),
    ({"prompt_tokens": 34, "prompt_tokens_details": {"cached_tokens": 16}, "routing": {"mode": "token_level"}}, 16),
    ({"prompt_tokens": 34, "prompt_tokens_details": {"cached_tokens": 50}}, 34),  # never more than the input
])
def test_cached_tokens_are_the_cached_share_of_input_tokens(usage, cached):
    response = response_of(ResponseDraft(request()), chat_body({"content": "Hi"}) | {
        "usage": {"completion_tokens": 3, **usage}})
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": cached}
    assert response["usage"]["input_tokens"] == 34
    assert response["usage"].get("routing") == usage.get("routing")  # upstream figures stay there


def chat_body(message: dict, finish_reason: str = "stop") -> dict:
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "routing": {"mode": "token_level"}}
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage}


def test_a_chat_answer_becomes_a_response_with_routing_usage():
    response = response_of(ResponseDraft(request()), chat_body({"role": "assistant", "content": "Hello"}))
    assert response["object"] == "response" and response["status"] == "completed"
    [item] = response["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello"
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 3
    assert response["usage"]["routing"] == {"mode": "token_level"}


def test_a_cut_answer_is_incomplete_and_a_tool_call_is_a_function_call_item():
    cut = response_of(ResponseDraft(request()), chat_body({"content": "Hel"}, "length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = response_of(ResponseDraft(request()), chat_body({"content": None, "tool_calls": [call]}, "tool_calls"))
    assert [i["type"] for i in called["output"]] == ["function_call"]
    assert conversation_messages(called["output"]) == [{"role": "assistant", "content": None, "tool_calls": [call]}]


def test_streamed_chunks_become_the_responses_event_sequence():
    events = ResponseEvents(ResponseDraft(request()))
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}], "routing": {"source": "local"}},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}], "routing": {"source": "upstream"}},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": chat_body({})["usage"]},
    ]
    sequence = events.start() + [e for c in chunks for e in events.feed(c)] + events.finish()
    assert [e["type"] for e in sequence] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in sequence] == list(range(len(sequence)))
    deltas = [e for e in sequence if e["type"] == "response.output_text.delta"]
    assert [d["routing"]["source"] for d in deltas] == ["local", "upstream"]
    final = sequence[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][1]["arguments"] == "{}" and final["output"][1]["call_id"] == "call_1"
    assert final["usage"]["routing"] == {"mode": "token_level"}
    assert sequence[9]["item"]["arguments"] == ""  # the added item as it was then, not as it ended


def test_a_schema_past_the_grammar_bounds_is_a_400_naming_text_format():
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "string", "maxLength": 100_000_000}}}})
    with pytest.raises(InvalidRequest) as refused:
        chat_request(body, input_messages(body.input))
    assert refused.value.param == "text.format.schema.maxLength"
