"""OpenAI wire shapes (requests and responses) plus the gateway's documented extensions.

The request model accepts every field of OpenAI's chat request. Which of them the token-level
path serves and which send the request whole to the upstream is decided in gateway.admission.passthrough.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from adapters.grammar import SchemaRefused, check_schema
from gateway.settings import RoutingOverride  # the `routing` extension: the same shape as a tenant's override
from gateway.wire.errors import InvalidRequest, quoted


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """Objects inside a request (messages, parts, formats): OpenAI's schema lets them carry more keys
    (`prompt_cache_breakpoint`, providers' own such as `cache_control`). Kept when a request passes
    through; no effect locally. Unknown keys at the top level are refused, as OpenAI refuses them."""

    model_config = ConfigDict(extra="allow")


class TextPart(Open):
    type: Literal["text"]
    text: str


class MediaPart(Open):
    """Image, audio and file parts (and an assistant's refusal part): only an upstream reads them."""

    type: Literal["image_url", "input_audio", "file", "refusal"]


class FunctionCall(Open):
    name: str
    arguments: str


class ToolCall(Open):
    id: str
    type: Literal["function", "custom"]
    function: FunctionCall | None = None
    custom: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_its_call(self) -> "ToolCall":
        if getattr(self, self.type) is None:
            raise ValueError(f"a tool call of type {self.type} needs `{self.type}`")
        return self


class MessageBase(Open):
    content: str | list[TextPart | MediaPart] | None  # required (null allowed only where OpenAI allows it)
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class SystemMessage(MessageBase):
    role: Literal["system"]
    content: str | list[TextPart]


class DeveloperMessage(MessageBase):
    role: Literal["developer"]
    content: str | list[TextPart]


class UserMessage(MessageBase):
    role: Literal["user"]
    content: str | list[TextPart | MediaPart]


class AssistantMessage(MessageBase):
    role: Literal["assistant"]
    content: str | list[TextPart | MediaPart] | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None


class ToolMessage(MessageBase):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(MessageBase):
    role: Literal["function"]


ROLES = {"system": SystemMessage, "developer": DeveloperMessage, "user": UserMessage,
         "assistant": AssistantMessage, "tool": ToolMessage, "function": FunctionMessage}


def _role_of(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return ROLES[role].__name__ if isinstance(role, str) and role in ROLES else None


# One shape per role, as OpenAI's schema has it (the tag names are class names, which error
# locations skip when they name the offending field).
Message = Annotated[
    Union[tuple(Annotated[cls, Tag(cls.__name__)] for cls in ROLES.values())],  # noqa: UP007 - built from ROLES
    Discriminator(_role_of, custom_error_type="invalid_role",
                  custom_error_message=f"role must be one of {', '.join(ROLES)}"),
]


class StreamOptions(Open):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # the OpenAI SDK may send it; nothing to obfuscate here


class JsonSchemaFormat(Open):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


def check_schema_bounds(schema: Any, where: str) -> None:
    """Refuse (400 naming the keyword under `where`) a JSON schema that would size a grammar past
    adapters.grammar's bounds: checked before anything, local or upstream, compiles it."""
    try:
        check_schema(schema)
    except SchemaRefused as exc:
        param = ".".join(filter(None, (where, exc.path)))
        raise InvalidRequest(f"'{param}': {exc}", param=param) from exc


class ResponseFormat(Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


TOKEN_ID = re.compile(r"[0-9]{1,9}")
# Numbers a request forwards to an upstream stay within what every upstream's API parses: a seed is
# OpenAI's 64-bit signed integer (llama-server answered 500 to 10**309, which held the upstream's
# breaker against every tenant); a token count fits 32 bits (llama-server's own limit), far past any context.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOKENS_MAX = 2**31 - 1
NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "stream", "logprobs", "frequency_penalty", "presence_penalty",
                      "echo", "max_tokens")


class SamplingRequest(Wire):
    """What chat and legacy completions requests share: null means the documented default (OpenAI's
    schema lets clients send null for these), at most 4 stop strings, logit_bias by token id."""

    @model_validator(mode="after")
    def _null_means_default(self) -> "SamplingRequest":
        for name in NULL_MEANS_DEFAULT:
            if name in type(self).model_fields and getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        return self

    @field_validator("stop", check_fields=False)
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _bias_by_token_id(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not TOKEN_ID.fullmatch(key):  # ASCII digits: str.isdigit also passes "²", which int() refuses
                raise ValueError(f"logit_bias keys are token ids, not {quoted(key)!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are between -100 and 100, not {bias}")
        return value


class ChatCompletionRequest(SamplingRequest):
    model: str
    messages: list[Message] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int | None = Field(1, ge=1, le=8, description="Choices: n sequences decoded together in the local model's batch.")
    response_format: ResponseFormat | None = None
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (in the local model's vocabulary) -> bias in [-100, 100], added to the logits.")
    modalities: list[Literal["text", "audio"]] | None = None
    # Annotations: accepted, forwarded when the request passes through, else without effect here.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    # Only an upstream can do these: the request passes through (gateway.admission.passthrough).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # The gateway's extensions.
    routing: RoutingOverride | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @field_validator("metadata")
    @classmethod
    def _metadata_as_openai_limits_it(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("metadata holds at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return value

    def check(self) -> None:
        """Refuse what the schema alone cannot: inconsistent fields."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        fmt = self.response_format
        if fmt and fmt.type == "json_schema" and not fmt.json_schema:
            raise InvalidRequest("response_format of type json_schema needs json_schema", param="response_format")
        if fmt and fmt.json_schema:
            check_schema_bounds(fmt.json_schema.schema_, "response_format.json_schema.schema")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequest("continue_final_message requires add_generation_prompt: false",
                                     param="add_generation_prompt")
            if self.messages[-1].role != "assistant":
                raise InvalidRequest("continue_final_message requires a final assistant message", param="messages")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def token_logprobs(self) -> tuple[bool, int]:
        """Whether each answer token's logprob is returned, and how many alternatives with it."""
        return bool(self.logprobs), self.top_logprobs or 0


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (legacy text completions): raw prompts, continued as plain text."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text, texts, or token ids in the local model's vocabulary (one list per prompt).")
    max_tokens: int | None = Field(16, ge=0, le=TOKENS_MAX)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, ge=0, le=1)
    n: int | None = Field(1, ge=1, le=8)
    best_of: int | None = Field(None, ge=1, le=8)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    suffix: str | None = None
    user: str | None = None
    routing: RoutingOverride | None = None

    def check(self, max_tokens_limit: int, max_sequences: int = 8) -> None:
        """Refuse what the schema alone cannot, naming the field (nothing passes through to an
        upstream here, so the local model's limits are the limits)."""
        if self.suffix:
            raise InvalidRequest("suffix (insertion) is not served here", param="suffix")
        if self.best_of not in (None, self.n):
            raise InvalidRequest("best_of other than n is not served here", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs (the prompt's own logprobs) is not served here", param="echo")
        if not self.prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if len(self.prompts_raw) * self.n > max_sequences:
            raise InvalidRequest(f"prompts times n may be at most {max_sequences}", param="prompt")
        if self.max_tokens == 0:
            raise InvalidRequest("max_tokens of 0 (scoring a prompt) is not served here", param="max_tokens")
        if self.max_tokens > max_tokens_limit:
            raise InvalidRequest(f"max_tokens is at most {max_tokens_limit} here", param="max_tokens")

    @property
    def prompts_raw(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def token_logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0
