"""Which field keeps a request off the token-level path (unit: the request schema and blocker_of)."""

from __future__ import annotations

import pytest

from gateway.admission.passthrough import blocker_of
from gateway.api.schemas import ChatCompletionRequest

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


@pytest.mark.parametrize(("fields", "param", "medium"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ({"tool_choice": "none"}, "tool_choice", None),
    ({"functions": [{"name": "f"}]}, "functions", None),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", None),
    ({"modalities": ["text", "audio"]}, "modalities", None),
    ({"web_search_options": {}}, "web_search_options", None),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages[1].tool_calls", None),
    ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages[0].role", None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[1]", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0]", "audio"),
    ({"max_tokens": 65}, "max_tokens", None),
    ({"max_completion_tokens": 65}, "max_completion_tokens", None),
])
def test_the_first_field_only_an_upstream_serves_is_named(fields, param, medium):
    blocker = blocker_of(request(**fields), max_tokens_limit=64)
    assert blocker is not None and (blocker.param, blocker.medium) == (param, medium)


@pytest.mark.parametrize("fields", [
    {},
    {"max_tokens": 64, "n": 2, "presence_penalty": 1.0, "frequency_penalty": -1.0, "logit_bias": {"5": -100}},
    {"response_format": {"type": "json_object"}, "user": "u", "metadata": {"k": "v"}, "store": True,
     "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low",
     "verbosity": "low", "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": {}}],
                   "tool_calls": "an extra key of a user message, not a call"}]},
    {"messages": [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, USER]},
])
def test_what_the_local_model_serves_stays_local(fields):
    assert blocker_of(request(**fields), max_tokens_limit=64) is None


def test_null_means_the_documented_default():
    body = request(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None)
    assert (body.temperature, body.top_p, body.n, body.stream, body.presence_penalty) == (1.0, 1.0, 1, False, 0.0)
