"""A Response object (and the chat messages it adds to a conversation) from a chat answer."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.responses.request import ResponsesRequest

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseDraft:
    """What a Response says besides its output: the request's settings, echoed as OpenAI echoes them."""

    body: ResponsesRequest
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def render(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
               finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = INCOMPLETE.get(finish_reason or "")
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "background": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "service_tier": body.service_tier or "default", "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text.get("format", {"type": "text"}), "verbosity": text.get("verbosity", "medium")},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {}, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        }


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses usage of chat usage, keeping the gateway's `routing` block. The fields keep
    OpenAI's meaning: `input_tokens_details.cached_tokens` is the cached share of `input_tokens`
    (never more), so that input - cached is what was read anew; upstream figures beside a local
    count stay in `usage.routing`."""
    if not chat_usage:
        return None
    usage = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": min(_cached_share(chat_usage), chat_usage["prompt_tokens"])},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }
    if "routing" in chat_usage:
        usage["routing"] = chat_usage["routing"]
    return usage


def _cached_share(chat_usage: dict[str, Any]) -> int:
    """Cached tokens of the count `prompt_tokens` is: as its details give them, or, passed through
    (where it is the upstream's own count), the upstream's; on the token-level path it is the local
    model's count, whose prefix cache reports no share, and the upstream's prompts are other counts."""
    details = chat_usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return details["cached_tokens"]
    routing = chat_usage.get("routing") or {}
    return (routing.get("upstream_cached_tokens") or 0) if routing.get("mode") == "passthrough" else 0


def message_item(text: str, status: str, logprobs: list[dict[str, Any]] | None = None,
                 item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status, "call_id": call.get("id") or "",
            "name": function.get("name") or "", "arguments": function.get("arguments") or ""}


def output_items(message: dict[str, Any], status: str, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The output items of a chat answer's message: its text (or refusal), then its tool calls."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("refusal"):
        items.append({**message_item("", status), "content": [{"type": "refusal", "refusal": message["refusal"]}]})
    elif message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", status, logprobs))
    items += [call_item(call) for call in calls]
    return items


def logprobs_of(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Responses logprobs (token, logprob, bytes, top_logprobs) of a chat choice's `logprobs`."""
    entries = (chat_logprobs or {}).get("content") or []
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes") or [],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes") or []}
                              for t in e.get("top_logprobs") or ()]} for e in entries]


def response_of(draft: ResponseDraft, chat_body: dict[str, Any]) -> dict[str, Any]:
    """The Response of a chat.completion body (one choice: Responses has no `n`)."""
    choice = chat_body["choices"][0]
    status = "incomplete" if choice.get("finish_reason") in INCOMPLETE else "completed"
    items = output_items(choice.get("message") or {}, status, logprobs_of(choice.get("logprobs")))
    return draft.render(items, "completed", usage_of(chat_body.get("usage")), choice.get("finish_reason"))


def conversation_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat message a Response's output adds to its conversation (for previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] += "".join(p.get("text") or p.get("refusal") or "" for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return [message]
