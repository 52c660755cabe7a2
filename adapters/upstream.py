"""Upstream models through litellm: continue a partial answer for a few tokens.

One class for every provider; how a half-written assistant message is continued depends on the
provider (see DESIGN.md) and is set per upstream by `mode`:

- completions:   raw /v1/completions on a prompt rendered with the upstream's own chat template
                 (vLLM, llama.cpp servers, llama-cpp-python's server).
- chat_continue: chat with a trailing assistant message and `continue_final_message: true,
                 add_generation_prompt: false` (vLLM, and this gateway itself).
- chat_prefix:   chat with a trailing assistant message marked `prefix: true` (DeepSeek, Mistral).
- chat_fallback: chat-only providers: ask to continue exactly, then strip any echoed overlap.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price map at import
import litellm  # noqa: E402

litellm.suppress_debug_info = True
litellm.disable_aiohttp_transport = True  # httpx: its aiohttp sessions leak on failed calls
for _name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
    logging.getLogger(_name).setLevel(logging.WARNING)  # it logs every call at INFO

from adapters.chat_template import ChatTemplate  # noqa: E402
from gateway.settings import UpstreamSettings  # noqa: E402

FALLBACK_INSTRUCTION = (
    "Continue your previous answer exactly where it stopped, mid-word if needed. "
    "Output only the continuation, without repeating any of it."
)


class UpstreamUnavailable(Exception):
    """The upstream failed, timed out, or its circuit breaker is open."""


@dataclass(frozen=True)
class Handoff:
    """One question to the upstream: continue `answer` after `messages`.

    `prefix` is the conversation as this upstream sees it (its own chat template in completions
    mode), rendered once per request by `Upstream.handoff`.
    """

    prefix: str
    messages: list[dict[str, Any]]
    answer: str = ""
    continue_final: bool = False


@dataclass(frozen=True)
class Continuation:
    text: str
    finished: bool  # the upstream ended its answer within this call
    prompt_tokens: int  # billed
    completion_tokens: int  # billed
    cost_usd: float
    latency_s: float


class CircuitBreaker:
    """Opens after `failures` consecutive failures; lets one trial call through after `cooldown_s`."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self._limit, self._cooldown = failures, cooldown_s
        self._consecutive = 0
        self._opened_at: float | None = None

    def allows(self, now: float) -> bool:
        return self._opened_at is None or now - self._opened_at >= self._cooldown

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self._consecutive, self._opened_at = 0, None
            return
        self._consecutive += 1
        if self._consecutive >= self._limit:
            self._opened_at = now


class Upstream:
    """A large model that continues partial answers. Safe to share across requests."""

    def __init__(self, name: str, settings: UpstreamSettings, template: ChatTemplate | None,
                 count_tokens: Any = None) -> None:
        self.name = name
        self.settings = settings
        self._template = template
        self._count_tokens = count_tokens  # text -> int, the upstream's own tokenizer if known
        self._breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_s)

    @property
    def available(self) -> bool:
        return self._breaker.allows(time.monotonic())

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool = False) -> Handoff:
        """A hand-off of an empty answer; the decoder replaces `answer` as the answer grows."""
        if self.settings.mode == "completions":
            prefix = self._template.render(messages, continue_final)
        else:  # a stable serialisation, for cache keys and token estimates
            prefix = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages) + "\x1d"
        return Handoff(prefix, messages, "", continue_final)

    @staticmethod
    def prompt_text(handoff: Handoff) -> str:
        """The text the upstream is asked to continue."""
        return handoff.prefix + handoff.answer

    def cache_key(self, handoff: Handoff, max_tokens: int) -> str:
        digest = hashlib.sha256(self.prompt_text(handoff).encode("utf-8")).hexdigest()
        return f"{self.settings.model}|{self.settings.mode}|{max_tokens}|{digest}"

    def estimate_prompt_tokens(self, handoff: Handoff) -> int:
        """Billed prompt tokens of this hand-off: exact with the upstream's tokenizer, else an
        over-estimate from tiktoken (cl100k, plus 25%) so a reservation rarely falls short."""
        text = self.prompt_text(handoff)
        if self._count_tokens is not None:
            return self._count_tokens(text)
        return int(litellm.token_counter(model="gpt-4o", text=text) * 1.25) + 8

    def estimate_cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Price of a call of this size: the configured price, else litellm's price map, else 0."""
        s = self.settings
        if s.input_usd_per_mtok is not None or s.output_usd_per_mtok is not None:
            return (prompt_tokens * (s.input_usd_per_mtok or 0.0) + completion_tokens * (s.output_usd_per_mtok or 0.0)) / 1e6
        try:
            prompt_cost, completion_cost = litellm.cost_per_token(
                model=s.model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        except Exception:  # noqa: BLE001 - litellm raises bare Exception for unmapped models
            return 0.0
        return prompt_cost + completion_cost

    async def continue_text(self, handoff: Handoff, max_tokens: int, temperature: float,
                            top_p: float, seed: int | None) -> Continuation:
        """Ask the upstream for up to `max_tokens` tokens continuing the answer.

        Retries up to `retries` times within the call; raises UpstreamUnavailable when all
        attempts fail or the breaker is open.
        """
        if not self.available:
            raise UpstreamUnavailable(f"circuit breaker open for upstream '{self.name}'")
        last: Exception | None = None
        for _ in range(self.settings.retries + 1):
            started = time.monotonic()
            try:
                response = await self._call(handoff, max_tokens, temperature, top_p, seed)
            except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                self._breaker.record(False, time.monotonic())
                last = exc
                if not self.available:
                    break
                continue
            self._breaker.record(True, time.monotonic())
            return self._continuation(handoff, response, time.monotonic() - started)
        raise UpstreamUnavailable(f"upstream '{self.name}' failed: {type(last).__name__}: {last}") from last

    async def _call(self, handoff: Handoff, max_tokens: int, temperature: float, top_p: float,
                    seed: int | None) -> Any:
        s = self.settings
        common: dict[str, Any] = dict(
            model=s.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            api_base=s.api_base, api_key=os.environ.get(s.api_key_env, "") if s.api_key_env else "none",
            timeout=s.timeout_s, num_retries=0,
        )
        if seed is not None:
            common["seed"] = seed
        if s.mode == "completions":
            return await litellm.atext_completion(prompt=self.prompt_text(handoff), extra_body=s.extra_body, **common)
        messages, extra_body = self._chat_messages(handoff)
        return await litellm.acompletion(messages=messages, extra_body={**s.extra_body, **extra_body}, **common)

    @staticmethod
    def _split(handoff: Handoff) -> tuple[list[dict[str, Any]], str]:
        """The messages before the assistant's turn, and the whole partial assistant text."""
        messages = [dict(m) for m in handoff.messages]
        if handoff.continue_final:  # the client's own partial assistant message comes first
            return messages[:-1], messages[-1]["content"] + handoff.answer
        return messages, handoff.answer

    def _chat_messages(self, handoff: Handoff) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The chat messages of a hand-off, and the extra body fields its mode needs."""
        messages, answer = self._split(handoff)
        if not answer:
            return messages, {}
        mode = self.settings.mode
        if mode == "chat_continue":
            extra = {"continue_final_message": True, "add_generation_prompt": False}
            return messages + [{"role": "assistant", "content": answer}], extra
        if mode == "chat_prefix":
            return messages + [{"role": "assistant", "content": answer, "prefix": True}], {}
        fallback = [{"role": "assistant", "content": answer}, {"role": "user", "content": FALLBACK_INSTRUCTION}]
        return messages + fallback, {}

    def _continuation(self, handoff: Handoff, response: Any, latency_s: float) -> Continuation:
        choice = response.choices[0]
        text = choice.text if self.settings.mode == "completions" else (choice.message.content or "")
        if self.settings.mode == "chat_fallback":
            text = strip_echo(self._split(handoff)[1], text)
        usage = getattr(response, "usage", None)
        prompt_tokens = getattr(usage, "prompt_tokens", None) or self.estimate_prompt_tokens(handoff)
        completion_tokens = getattr(usage, "completion_tokens", None)
        if completion_tokens is None:
            completion_tokens = litellm.token_counter(model="gpt-4o", text=text)
        return Continuation(
            text=text, finished=choice.finish_reason == "stop",
            prompt_tokens=int(prompt_tokens), completion_tokens=int(completion_tokens),
            cost_usd=self.estimate_cost(int(prompt_tokens), int(completion_tokens)), latency_s=latency_s,
        )


def strip_echo(answer: str, text: str, min_overlap: int = 4) -> str:
    """Drop the start of `text` that repeats the end of `answer` (chat-only providers echo it)."""
    if text.startswith(answer) and answer:
        return text[len(answer):]
    for size in range(min(len(answer), len(text)), min_overlap - 1, -1):
        if answer.endswith(text[:size]):
            return text[size:]
    return text
