"""Chat messages in shapes an upstream's parser accepts.

OpenAI accepts messages that the open servers' parsers refuse (llama.cpp's server answers 500 or
400, llama-cpp-python's fails in its template): a null or missing `content`, an empty content
array, an assistant turn with neither content nor tool calls, an assistant's `refusal` part, tool
calls whose `arguments` are empty or not JSON (they parse them to render the template), two
assistant turns in a row. Before a request is passed through to such a server, its messages are
rewritten into equivalent ones: the same text, in the same order, and the same calls. Providers
behind litellm (kind `provider`) get the messages as sent: litellm adapts them to each provider,
and their parsers are OpenAI's.
"""

from __future__ import annotations

import json
from typing import Any

PICKY = ("llama-server", "vllm", "llama-cpp-python")  # render templates from messages as they parse them


def for_upstream(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """`messages` as the upstream of `kind` (UpstreamSettings.kind) accepts them."""
    if kind not in PICKY:
        return messages
    shaped: list[dict[str, Any]] = []
    for message in map(_accepted, messages):
        if shaped and shaped[-1].get("role") == message.get("role") == "assistant":
            shaped[-1] = _joined(shaped[-1], message)
        else:
            shaped.append(message)
    return shaped


def _accepted(message: dict[str, Any]) -> dict[str, Any]:
    message = dict(message)
    content = message.get("content")
    if content in (None, []):
        message["content"] = ""
    elif isinstance(content, list):  # a refusal part is text the assistant wrote
        message["content"] = [{"type": "text", "text": p.get("refusal") or ""} if p.get("type") == "refusal" else p
                              for p in content]
    calls = message.pop("tool_calls", None)
    if calls:
        message["tool_calls"] = [_with_json_arguments(call) for call in calls]
    return message


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One assistant turn saying what two consecutive ones said (their text, then their calls)."""
    joined = {**first, **{k: v for k, v in second.items() if v is not None}}
    texts = [m["content"] for m in (first, second) if m["content"]]
    if all(isinstance(text, str) for text in texts):
        joined["content"] = "\n".join(texts)
    else:
        joined["content"] = [part for text in texts
                             for part in ([{"type": "text", "text": text}] if isinstance(text, str) else text)]
    calls = [call for m in (first, second) for call in m.get("tool_calls") or ()]
    if calls:
        joined["tool_calls"] = calls
    return joined


def _with_json_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose `arguments` parse as JSON: empty is `{}`, other text a JSON string of itself."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments") or "{}"
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):  # "[" * 100_000 recurses past Python's parser
        arguments = json.dumps(arguments)
    return {**call, "function": {**function, "arguments": arguments}}
