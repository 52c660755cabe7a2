"""Chat messages in shapes an upstream's parser accepts.

OpenAI accepts messages that the open servers' parsers refuse (llama.cpp's server answers 500,
llama-cpp-python's fails in its template): a null or missing `content`, an empty content array,
an assistant turn with neither content nor tool calls, tool calls whose `arguments` are empty or
not JSON (they parse them to render the template). Before a request is passed through to such a
server, its messages are rewritten into equivalent ones: the same text and the same calls. Providers behind litellm (kind `provider`) get the messages as sent: litellm
adapts them to each provider, and their parsers are OpenAI's.
"""

from __future__ import annotations

import json
from typing import Any

PICKY = ("llama-server", "vllm", "llama-cpp-python")  # render templates from messages as they parse them


def for_upstream(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """`messages` as the upstream of `kind` (UpstreamSettings.kind) accepts them."""
    if kind not in PICKY:
        return messages
    return [_accepted(message) for message in messages]


def _accepted(message: dict[str, Any]) -> dict[str, Any]:
    message = dict(message)
    if message.get("content") in (None, []):
        message["content"] = ""
    calls = message.pop("tool_calls", None)
    if calls:
        message["tool_calls"] = [_with_json_arguments(call) for call in calls]
    return message


def _with_json_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose `arguments` parse as JSON: empty is `{}`, other text a JSON string of itself."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments") or "{}"
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments)
    return {**call, "function": {**function, "arguments": arguments}}
