"""OpenAI wire shapes (requests and responses) plus the gateway's documented extensions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import InvalidRequest
from gateway.settings import RoutingOverride  # the `routing` extension: the same shape as a tenant's override


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Wire):
    type: Literal["text"]
    text: str


class Message(Wire):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Wire):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # the OpenAI SDK may send it; nothing to obfuscate here


class ResponseFormat(Wire):
    type: Literal["text"]


UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "logit_bias",
               "prediction", "parallel_tool_calls", "web_search_options", "reasoning_effort")


class ChatCompletionRequest(Wire):
    model: str
    messages: list[Message] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=8, description="Choices: n sequences decoded together in the local model's batch.")
    user: str | None = None
    response_format: ResponseFormat | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    modalities: list[Literal["text"]] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Annotations only: accepted so that clients (and other gateways' cache hints) are not refused.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    routing: RoutingOverride | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Known OpenAI fields the gateway cannot honour: refused by name instead of ignored.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    logit_bias: Any = None
    prediction: Any = None
    parallel_tool_calls: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    def check(self) -> None:
        """Refuse what the schema alone cannot: unsupported features and inconsistent fields."""
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name)
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"'{name}' is not supported (only 0)", param=name)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequest("continue_final_message requires add_generation_prompt: false",
                                     param="add_generation_prompt")
            if self.messages[-1].role != "assistant":
                raise InvalidRequest("continue_final_message requires a final assistant message", param="messages")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
