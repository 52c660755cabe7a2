"""Requests the token-level path cannot serve go whole to the alias's upstream (query-level routing).

`blocker_of` names the first field that keeps a request off the token-level path. `admit` then
either refuses the request (a 400 that names the field and says why) or holds one budget
reservation for its prompt plus its answer tokens, for one upstream chat call that is settled to
what the upstream billed. Answers keep the upstream's shapes (tool calls, structured output,
streamed deltas) under the gateway's id and model name, with `usage.routing.mode: "passthrough"`
and the field that sent them there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from adapters.message_shapes import for_upstream
from adapters.upstream import Upstream
from gateway.admission.limits import admit_rates, admit_tokens, release
from gateway.decoding.passing import Blocker, Passing
from gateway.runtime import Alias, Runtime
from gateway.settings import ServerSettings
from gateway.tenancy.budget import RESERVATION_MARGIN_S, HandoffGate
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import GatewayError, InvalidRequest, Overloaded, QuotaExceeded, quoted
from gateway.wire.request_body import depth_of
from gateway.wire.schemas import ChatCompletionRequest, MediaPart

log = logging.getLogger("gateway.admission.passthrough")

UPSTREAM_ONLY = (  # request fields only an upstream can honour, and what each asks for
    ("tools", "tool calling"), ("tool_choice", "tool calling"), ("functions", "function calling"),
    ("function_call", "function calling"), ("audio", "audio output"), ("web_search_options", "web search"),
    ("moderation", "moderation"),
)
GATEWAY_FIELDS = {"model", "routing", "continue_final_message", "add_generation_prompt", "stream", "stream_options"}


MEDIA = {"image_url": "image", "input_audio": "audio", "file": "file"}


def blocker_of(body: ChatCompletionRequest, max_tokens_limit: int) -> Blocker | None:
    """The first field of `body` the local model cannot serve, or None."""
    for name, needs in UPSTREAM_ONLY:
        if getattr(body, name) is not None:
            return Blocker(name, f"{needs} needs the upstream model")
    if body.modalities and "audio" in body.modalities:
        return Blocker("modalities", "audio output needs the upstream model")
    for i, message in enumerate(body.messages):
        if message.role in ("tool", "function"):
            return Blocker(f"messages[{i}].role", "tool results need the upstream model", kind="tool_result")
        for name in ("tool_calls", "function_call", "audio"):  # an assistant's; extra keys elsewhere
            if message.role == "assistant" and getattr(message, name):
                return Blocker(f"messages[{i}].{name}", f"a message with {name} needs the upstream model",
                               kind=f"assistant_{name}")
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, MediaPart) and part.type != "refusal":
                return Blocker(f"messages[{i}].content[{j}]", f"{part.type} parts need the upstream model",
                               kind=f"{MEDIA[part.type]}_part")
    requested = body.requested_max_tokens
    if requested is not None and requested > max_tokens_limit:
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return Blocker(name, f"more than the local model's limit of {max_tokens_limit} tokens needs the upstream model")
    return None


async def admit(runtime: Runtime, tenant: Tenant, alias: Alias, body: ChatCompletionRequest,
                blocker: Blocker) -> Passing:
    """Refuse `body` (400 naming `blocker.param`) or reserve budget for passing it through whole."""
    refusal = _refusal(alias, tenant)
    if refusal:
        raise InvalidRequest(f"'{blocker.param}': {blocker.why}; {refusal}", param=blocker.param)
    upstream = alias.upstream
    check_media(body, upstream)
    check_tools(body, upstream.settings.tool_types, runtime.settings.server)
    if not upstream.available:
        raise Overloaded(f"'{blocker.param}' needs the upstream model, which is unavailable; retry shortly",
                         retry_after_s=upstream.settings.breaker_cooldown_s)
    max_tokens = body.requested_max_tokens or runtime.settings.server.max_tokens_limit
    params = upstream_params(body, upstream, max_tokens)
    answers = max_tokens * body.n
    gate = HandoffGate(runtime.ledger, tenant.id, tenant.limits, allowed=True, cache_scope=tenant.cache_scope)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    await admit_rates(runtime, tenant, gate, request_id)  # before the prompt is counted
    reservation = None
    try:
        prompt = await upstream.whole.count_chat_tokens(params) or await asyncio.to_thread(
            upstream.whole.estimate_chat_tokens, params["messages"], params.get("tools"))
        await admit_tokens(runtime, tenant, request_id, prompt + answers)
        if gate.allowed:
            reservation = await gate.reserve(prompt + answers, upstream.estimate_cost(prompt, answers),
                                             ttl_s=upstream.settings.passthrough_timeout_s + RESERVATION_MARGIN_S)
    except BaseException:  # the request ended before its reservation: give the slot back
        await asyncio.shield(release(runtime, tenant, request_id))
        raise
    if reservation is None:
        await release(runtime, tenant, request_id)
        if gate.refusal == "store_unavailable":
            error = GatewayError("the usage ledger is unreachable, so upstream spending cannot be checked; retry shortly")
            error.status, error.code = 503, "store_unavailable"
            raise error
        raise QuotaExceeded(f"'{blocker.param}' needs the upstream model, and this tenant's upstream budget "
                            "does not cover the request")
    return Passing(request_id, int(time.time()), tenant.id, body, blocker, upstream, gate, reservation, params, prompt,
                   give_back_slot=lambda: release(runtime, tenant, request_id))


def upstream_params(body: ChatCompletionRequest, upstream: Upstream, max_tokens: int) -> dict[str, Any]:
    """The client's own fields for the upstream (the gateway's extensions left out), with the
    text of messages and tools neutralized as on the token path (control-token strings a client
    typed reach the upstream as text, never as turns of its template) and the messages in shapes
    the upstream's parser accepts (adapters.message_shapes)."""
    params = body.model_dump(exclude_unset=True, by_alias=True, exclude=GATEWAY_FIELDS)
    if body.max_completion_tokens is None:
        params["max_tokens"] = max_tokens
    params["messages"] = for_upstream([_neutral_message(m, upstream.neutral) for m in params["messages"]],
                                      upstream.settings.kind)
    for name in ("tools", "functions"):
        if name in params:
            params[name] = _neutral_values(params[name], upstream.neutral)
    return params


def _neutral_message(message: dict[str, Any], neutral: Callable[[str], str]) -> dict[str, Any]:
    """A message with its content (text and text parts) and its tool calls' arguments neutralized."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = neutral(content)
    elif isinstance(content, list):
        message["content"] = [{**p, "text": neutral(p["text"])} if p.get("type") == "text" else p for p in content]
    if message.get("tool_calls"):
        message["tool_calls"] = [_neutral_values(call, neutral) for call in message["tool_calls"]]
    return message


def _neutral_values(value: Any, neutral: Callable[[str], str]) -> Any:
    """`value` with every string in it (not its keys) neutralized."""
    if isinstance(value, str):
        return neutral(value)
    if isinstance(value, list):
        return [_neutral_values(item, neutral) for item in value]
    if isinstance(value, dict):
        return {key: _neutral_values(item, neutral) for key, item in value.items()}
    return value


def check_media(body: ChatCompletionRequest, upstream: Upstream) -> None:
    """Refuse (400) a part in any message of a medium the upstream does not read (not only the
    part that sent the request to it: a request with tools may carry an image further on)."""
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            medium = MEDIA.get(part.type) if isinstance(part, MediaPart) else None
            if medium and not upstream.whole.reads(medium):
                raise InvalidRequest(f"'messages[{i}].content[{j}]': {part.type} parts need the upstream model, and "
                                     f"this model's upstream does not read {medium} input",
                                     param=f"messages[{i}].content[{j}]")


def check_tools(body: ChatCompletionRequest, tool_types: list[str], server: ServerSettings) -> None:
    """Refuse (400) a tool of a type the upstream is not configured for (litellm would handle it
    itself: MCP servers, web search), and a definition nested or sized past the server's limits
    (an upstream compiles each schema, and a deep one held one for tens of seconds). Tool calls in
    the conversation must be of a served type too (an upstream parses them to render its template)."""
    for i, message in enumerate(body.messages):
        for j, call in enumerate(getattr(message, "tool_calls", None) or ()):
            if call.type not in tool_types:
                raise InvalidRequest(f"tool calls of type '{call.type}' are not served here (served: "
                                     f"{', '.join(tool_types)})", param=f"messages[{i}].tool_calls[{j}].type")
    for name, tools in (("tools", body.tools or ()), ("functions", body.functions or ())):
        for i, tool in enumerate(tools):
            kind = tool.get("type", "function") if name == "tools" else "function"
            if kind not in tool_types:
                raise InvalidRequest(f"tools of type '{quoted(str(kind))}' are not served here (served: "
                                     f"{', '.join(tool_types)})", param=f"{name}[{i}].type")
            if kind == "function":
                _check_named(tool.get("function") if name == "tools" else tool, f"{name}[{i}]" + (
                    ".function" if name == "tools" else ""))
            if depth_of(tool) > server.max_tool_schema_depth:
                raise InvalidRequest(f"'{name}[{i}]' is nested deeper than {server.max_tool_schema_depth} levels",
                                     param=f"{name}[{i}]")
            if len(json.dumps(tool)) > server.max_tool_schema_bytes:
                raise InvalidRequest(f"'{name}[{i}]' is larger than {server.max_tool_schema_bytes} bytes of JSON",
                                     param=f"{name}[{i}]")


def _check_named(function: Any, where: str) -> None:
    """A function definition must name its function: llama-server answers one without a name with a
    500, which reads as an outage (a 502 to the client, and a failure against the breaker)."""
    if not isinstance(function, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(f"Missing required parameter: '{where}.name'.", param=f"{where}.name")


def _refusal(alias: Alias, tenant: Tenant) -> str | None:
    """Why this alias and tenant may not pass a request through, or None."""
    unsupported = tenant.settings.unsupported or alias.settings.unsupported
    if unsupported == "refuse":
        return "this model is configured to refuse such requests rather than pass them to its upstream"
    if alias.upstream is None:
        return "this model has no upstream model"
    if not tenant.settings.allow_upstream:
        return "this API key may not send requests to the upstream model"
    return None
