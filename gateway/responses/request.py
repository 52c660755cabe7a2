"""The Responses request body and its translation into a chat completions request.

Input items map onto chat messages one for one (a run of function calls becomes one assistant
message with tool calls, as chat completions has it); what chat completions cannot express
(built-in tools, item references, reusable prompts, background runs) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.settings import RoutingOverride
from gateway.wire.errors import InvalidRequest, param_of, quoted
from gateway.wire.schemas import TOKENS_MAX, ChatCompletionRequest, Open, Wire, check_schema_bounds

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# OpenAI's limits on what a Response echoes and the store keeps: identifiers up to 64 characters;
# metadata at most 16 pairs, keys up to 64 characters, values up to 512.
IDENTIFIER_CHARS = 64
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]


class TextFormat(Open):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(Open):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(Open):
    include_obfuscation: bool | None = None  # nothing to obfuscate here


class ResponsesRequest(Wire):
    """POST /v1/responses. Annotations (`user`, `metadata`, `service_tier`, ...) are forwarded when
    the request passes through to the upstream, as chat completions does. Those a Response echoes
    (and the store keeps) are held to OpenAI's limits: longer is a 400 naming the field."""

    model: str
    input: str | list[dict[str, Any]] | None = Field(None, description="Text, or input items (messages, function "
                                                     "calls and their outputs).")
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, which are not served here: no effect
    store: bool | None = True
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=IDENTIFIER_CHARS)
    safety_identifier: str | None = Field(None, max_length=IDENTIFIER_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=IDENTIFIER_CHARS)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: ServiceTier | None = None
    reasoning: dict[str, Any] | None = None  # no reasoning model here: accepted, without effect
    truncation: Literal["auto", "disabled"] | None = None  # nothing is dropped: too long is a 400 either way
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    # Refused when set: the gateway has no Conversations API, reusable prompts or background runs.
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    routing: RoutingOverride | None = None  # the gateway's extension, as in chat completions

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if not metadata:
            return metadata
        if len(metadata) > METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {METADATA_PAIRS} key-value pairs, not {len(metadata)}")
        if max(map(len, metadata)) > METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys are at most {METADATA_KEY_CHARS} characters long")
        if max(map(len, metadata.values())) > METADATA_VALUE_CHARS:
            raise ValueError(f"metadata values are at most {METADATA_VALUE_CHARS} characters long")
        return metadata

    @model_validator(mode="after")
    def _null_means_default(self) -> "ResponsesRequest":
        self.store = True if self.store is None else self.store
        self.stream = bool(self.stream)
        return self

    def check(self) -> None:
        """Refuse what the gateway does not serve, naming the field."""
        for name, what in (("conversation", "the Conversations API is not served here: pass previous_response_id"),
                           ("prompt", "reusable prompts are not served here: send input and instructions"),
                           ("background", "background responses are not served here")):
            if getattr(self, name):
                raise InvalidRequest(f"'{name}': {what}", param=name)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


def chat_request(body: ResponsesRequest, turns: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completions request that answers `body`, whose conversation so far is `turns`
    (chat messages: the stored ones before it, then `input_messages(body.input)`); instructions
    come first and are not part of the conversation. Raises InvalidRequest naming the field."""
    body.check()
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + turns
    if not messages:
        raise InvalidRequest("nothing to answer: give input, instructions or previous_response_id", param="input")
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "response_format": _response_format(body.text), "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "routing": body.routing,
    }
    if body.wants_logprobs:
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or None)
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # the completed event carries usage
    if not body.store:
        chat["store"] = False  # nothing of the request is kept: the continuation cache included
    for name in ("metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                 "prompt_cache_options", "service_tier"):
        chat[name] = getattr(body, name)
    if body.reasoning and body.reasoning.get("effort"):
        chat["reasoning_effort"] = body.reasoning["effort"]
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        location = param_of(tuple(error["loc"]))
        param = "input" if location and location.startswith("messages") else location
        raise InvalidRequest(f"{error['msg']} (in the chat request this becomes: {location})", param=param) from exc


def input_messages(input_: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat messages of Responses input: a string is one user message; items map one for one,
    except that consecutive function calls join the assistant message before them."""
    if input_ is None:
        return []
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            _append_call(messages, item, f"input[{i}]")
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", f"input[{i}]"),
                             "content": _output_text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # the models here do not reason in items; a client may echo one back
        else:
            raise InvalidRequest(f"input items of type '{quoted(str(kind))}' are not served here (served: message, "
                                 "function_call, function_call_output)", param=f"input[{i}].type")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}.content' must be a string or a list of parts", param=f"{where}.content")
    return {"role": role, "content": [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]}


def _part(part: Any, where: str) -> dict[str, Any]:
    """A chat content part of a Responses content part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _text_field(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _text_field(part, "refusal", where)}
    if kind == "input_image":
        if not part.get("image_url"):
            raise InvalidRequest(f"'{where}': images are served by URL or data URL (image_url); there are no "
                                 "uploaded files here", param=f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail") or "auto"}}
    if kind == "input_file":
        file = {key: part[key] for key in ("file_data", "file_id", "filename") if part.get(key) is not None}
        return {"type": "file", "file": file}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio") or {}}
    raise InvalidRequest(f"content parts of type '{quoted(str(kind))}' are not served here", param=f"{where}.type")


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    call = {"id": _text_field(item, "call_id", where), "type": "function",
            "function": {"name": _text_field(item, "name", where), "arguments": _text_field(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    return value


def _output_text(output: Any, where: str) -> str:
    """A function call's output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
        return "".join(str(p.get("text", "")) for p in output)
    raise InvalidRequest(f"'{where}' must be a string or a list of input_text parts", param=where)


def _response_format(text: TextOptions | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if not fmt.name or fmt.schema_ is None:
        raise InvalidRequest("text.format of type json_schema needs name and schema", param="text.format")
    check_schema_bounds(fmt.schema_, "text.format.schema")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat tools of Responses function tools (flat: name, parameters, strict at the top)."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequest(f"tools of type '{quoted(str(tool.get('type')))}' are not served here (served: "
                                 "function)", param=f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's tool_choice of a Responses one: a mode, a function, or allowed function tools."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = [{"type": "function", "function": {"name": tool.get("name")}}
                 for tool in choice["tools"] if isinstance(tool, dict) and tool.get("type") == "function"]
        if len(tools) == len(choice["tools"]):
            return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": tools}}
    raise InvalidRequest(f"tool_choice of type '{quoted(str(kind))}' is not served here (served: a mode, a function, "
                         "or allowed function tools)", param="tool_choice")
