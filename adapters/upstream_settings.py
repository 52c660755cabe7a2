"""The settings of upstream models and of the servers the gateway launches for them: one branch of
the gateway's settings tree (gateway/settings/ loads the whole tree), defined here so that the
adapters that use them import nothing from the gateway."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LaunchSettings(Strict):
    gguf: str = Field(..., description="Catalog name or GGUF path the child server loads.")
    server: Literal["llama-server", "llama-cpp-python"] = Field(
        "llama-server", description="llama-server: llama.cpp's own server (built by scripts/setup.sh; keeps its KV "
        "cache between hand-offs and reports timings); llama-cpp-python: `python -m llama_cpp.server`.")
    port: int = Field(0, ge=0, le=65535, description="Loopback port for the child server; 0 picks a free one.")
    n_threads: int = Field(1, ge=1, description="Threads of the child server.")
    n_ctx: int = Field(4096, ge=256, description="Context length of the child server (per sequence).")
    parallel: int = Field(2, ge=1, le=64, description="llama-server: sequences served at once, each keeping its own "
                          "cached prefix (requests routed at the same time do not evict each other).")
    extra_args: list[str] = Field(default_factory=list, description="More command-line arguments for the child server.")


UpstreamMode = Literal["tokens", "completions", "chat_continue", "chat_prefix", "chat_fallback"]


class UpstreamSettings(Strict):
    model: str = Field(..., description="litellm model name, e.g. text-completion-openai/qwen or deepseek/deepseek-chat.")
    api_base: str | None = Field(None, description="Base URL; filled in automatically for a launched server.")
    api_key_env: str | None = Field(None, description="Environment variable that holds the upstream API key.")
    mode: UpstreamMode = Field(
        "completions",
        description="How a partial answer is continued: tokens (llama-server/vLLM: /v1/completions on token ids "
        "of the upstream's own chat template, extended incrementally so the server re-uses its KV cache), "
        "completions (the same prompt as text), chat_continue (vLLM/this gateway: continue_final_message), chat_prefix "
        "(DeepSeek/Mistral: assistant prefix), chat_fallback (chat-only providers: asked to repeat the answer's end, "
        "then continue; only what follows the echo is kept).",
    )
    template_gguf: str | None = Field(
        None, description="GGUF whose chat template renders prompts in completions mode (defaults to launch.gguf)."
    )
    launch: LaunchSettings | None = Field(None, description="Start a llama-server (or llama-cpp-python) child process.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Provider-specific fields sent with every call, e.g. {repeat_penalty: 1.0} for "
        "llama-cpp-python servers, whose default penalty of 1.1 would make temperature 0 non-greedy.",
    )
    timeout_s: float = Field(20.0, gt=0, description="Time-out of one upstream call.")
    chat_model: str | None = Field(
        None, description="litellm model name for requests passed through whole (tools, images, ...); default: "
        "`model`, with text-completion-openai/ read as openai/ (the same server's chat endpoint).")
    inputs: list[Literal["image", "audio", "file"]] | None = Field(
        None, description="Media the upstream reads in messages (image_url, input_audio, file parts); default: what "
        "litellm's model map says of the chat model, else none (such parts are then refused by name).")
    passthrough_timeout_s: float = Field(120.0, gt=0, description="Time-out of a request passed through whole.")
    retries: int = Field(1, ge=0, le=5, description="Retries of a failed upstream call.")
    breaker_failures: int = Field(3, ge=1, description="Consecutive failures that open the circuit breaker.")
    breaker_cooldown_s: float = Field(30.0, ge=0, description="How long an open breaker skips the upstream.")
    input_usd_per_mtok: float | None = Field(None, ge=0, description="Price per million prompt tokens (else litellm's map).")
    output_usd_per_mtok: float | None = Field(None, ge=0, description="Price per million completion tokens.")
    cached_input_usd_per_mtok: float | None = Field(
        None, ge=0, description="Price per million cached prompt tokens (else litellm's cache_read_input_token_cost, "
        "else the full input price: a discount is never assumed).")
    cache_write_usd_per_mtok: float | None = Field(
        None, ge=0, description="Price per million prompt tokens written to the provider's cache (Anthropic-class: "
        "1.25x input; else litellm's cache_creation_input_token_cost, else the input price). A cost ceiling "
        "(routing.max_cost_ratio) counts every prompt token of a hand-off at the higher of the two.")
    cache_min_prompt_tokens: int | None = Field(
        None, ge=0, description="The shortest prompt the provider caches (OpenAI, Anthropic: 1,024; DeepSeek: 64; "
        "self-hosted: 0); default: by the model name's provider, 0 for text-completion-openai/ servers. Used to "
        "predict what a hand-off bills (gateway_handoff_cost_prediction metric).")
    read_ahead: int | None = Field(
        None, ge=0, le=64, description="Tokens a hand-off asks for past its span, in the same call (billed). While the "
        "answer goes on as they read (the local model writes the same text, or nothing, before the next routed step), "
        "the request's next hand-offs take them instead of calling again. Default: 8 in chat_fallback, where each call "
        "is a new turn that may restate the answer rather than continue it; 0 elsewhere.")
    warm: bool = Field(
        False, description="tokens mode: send the prompt (no answer) when a routed request starts, so the "
        "upstream's cache holds it by the first hand-off.")
    kind: Literal["llama-server", "vllm", "llama-cpp-python", "provider"] = Field(
        "provider", description="What serves this upstream, which says how tenants are kept apart in its prefix "
        "cache, how a request passed through is counted, and which message shapes its parser needs "
        "(adapters/message_shapes.py): llama-server (each tenant's calls go to slots only it "
        "has used: start it with --cache-ram 0 --slot-save-path DIR, and give `slots`; pass-through prompts are "
        "counted with its /apply-template and /tokenize), vllm (a per-tenant cache_salt), llama-cpp-python (its "
        "OpenAI server), provider (anything else). A launched server is of its own kind by itself.")
    slots: int | None = Field(None, ge=1, le=64, description="llama-server: its --parallel (a launched one: launch.parallel).")
    cache_isolation: Literal["tenant", "shared"] = Field(
        "tenant", description="tenant: no tenant can tell from an answer's fields or timing that another sent the same "
        "prompt prefix (see docs/security.md); shared: one cache for all, with its counts reported as they are.")
    tool_types: list[str] = Field(
        default_factory=lambda: ["function"], description="Tool types a request passed through may carry (OpenAI's "
        "`tools[].type`); others are a 400 rather than reaching litellm's own handlers.")

    @model_validator(mode="after")
    def _has_endpoint(self) -> "UpstreamSettings":
        if self.mode in ("tokens", "completions") and not (self.template_gguf or self.launch):
            raise ValueError(f"{self.mode} mode needs template_gguf or launch (the upstream's chat template)")
        if self.warm and self.mode != "tokens":
            raise ValueError("warm needs tokens mode (a server that keeps its KV cache between calls)")
        if self.kind == "llama-server" and self.cache_isolation == "tenant" and not (self.slots or self.launch):
            raise ValueError("a llama-server upstream isolated by tenant needs `slots` (its --parallel)")
        return self


def api_key_of(settings: UpstreamSettings) -> str:
    """The upstream's API key, read from its environment variable at call time ("none" without one)."""
    return os.environ.get(settings.api_key_env, "") if settings.api_key_env else "none"
