"""Messages OpenAI accepts, rewritten into shapes llama.cpp's server parses (unit)."""

from __future__ import annotations

import json

from adapters.message_shapes import for_upstream

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}


def test_null_missing_and_empty_content_become_empty_text():
    messages = [{"role": "user", "content": []}, {"role": "assistant", "content": None},
                {"role": "user", "content": "x"}, {"role": "assistant"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    shaped = for_upstream(messages, "llama-server")
    assert [m["content"] for m in shaped] == ["", "", "x", "", [{"type": "text", "text": "hi"}]]


def test_tool_call_arguments_always_parse_as_json():
    calls = [CALL, {**CALL, "function": {"name": "f", "arguments": "not json"}},
             {**CALL, "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]
    shaped = for_upstream([{"role": "assistant", "content": None, "tool_calls": calls}], "vllm")[0]
    arguments = [c["function"]["arguments"] for c in shaped["tool_calls"]]
    assert arguments == ["{}", '"not json"', '{"city": "Paris"}']
    assert [json.loads(a) for a in arguments] == [{}, "not json", {"city": "Paris"}]
    assert shaped["content"] == ""


def test_an_empty_tool_call_list_is_dropped_and_providers_get_messages_as_sent():
    messages = [{"role": "assistant", "content": None, "tool_calls": []}]
    assert for_upstream(messages, "llama-server") == [{"role": "assistant", "content": ""}]
    assert for_upstream(messages, "provider") is messages


def test_refusal_parts_become_text_and_consecutive_assistant_turns_join():
    call = {**CALL, "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                {"role": "assistant", "content": "But here:", "tool_calls": [call]},
                {"role": "assistant", "content": None, "tool_calls": [{**call, "id": "call_2"}]}]
    shaped = for_upstream(messages, "llama-server")
    assert len(shaped) == 2 and shaped[0] == messages[0]
    assert shaped[1]["content"] == [{"type": "text", "text": "No."}, {"type": "text", "text": "But here:"}]
    assert [c["id"] for c in shaped[1]["tool_calls"]] == ["call_1", "call_2"]
    assert for_upstream(messages[2:], "llama-server")[0]["content"] == "But here:"
