"""What an upstream's tokens cost: prices per token from the configuration or litellm's price map.

Prompt tokens are billed fresh, read from the provider's cache (`cached_input`), or written to it
(`cache_write`: Anthropic-class providers bill a prompt they cache at 1.25x); output tokens at
`output`. The upstream client only asks this module for a cost; the decoder asks it for the most a
call may cost (`worst_case`) and for what asking the upstream directly would cost (`direct`).
"""

from __future__ import annotations

from typing import NamedTuple

from adapters.litellm_client import litellm


class Prices(NamedTuple):
    """USD per token."""

    input: float
    cached_input: float
    output: float
    cache_write: float | None = None  # None: a cache write costs the input price
    cache_min_prompt_tokens: int = 0  # a shorter prompt is never cached by the provider

    @property
    def free(self) -> bool:
        """No token has a price: nothing a price rule weighs."""
        return not (self.input or self.cached_input or self.output or self.cache_write)

    def predicted(self, prompt_tokens: int, completion_tokens: int, reusable_tokens: int) -> float:
        """What a call is expected to bill when `reusable_tokens` of its prompt were in an earlier
        call of the same request (read from the cache if the prompt reaches the provider's
        minimum; the rest written to it where that has a price)."""
        cached = min(reusable_tokens, prompt_tokens) if prompt_tokens >= self.cache_min_prompt_tokens else 0
        fresh = self.input if self.cache_write is None or cached == 0 else self.cache_write
        return (prompt_tokens - cached) * fresh + cached * self.cached_input + completion_tokens * self.output

    def worst_case(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The most a call of this size can bill: no prompt token read from a cache, every one
        written to it if that costs more."""
        return prompt_tokens * max(self.input, self.cache_write or 0.0) + completion_tokens * self.output

    def direct(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What asking the upstream directly costs: the prompt once, fresh, and the answer."""
        return prompt_tokens * self.input + completion_tokens * self.output

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """Price of a call of this size, `cached_tokens` of its prompt at the cached price."""
        return ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output)

    @classmethod
    def of(cls, model: str, input_usd_per_mtok: float | None = None, output_usd_per_mtok: float | None = None,
           cached_input_usd_per_mtok: float | None = None, cache_write_usd_per_mtok: float | None = None,
           cache_min_prompt_tokens: int | None = None) -> "Prices":
        """The configured prices (per million tokens), else litellm's map for `model`, else 0.
        Cached input without a known price costs the full input price: a discount nobody stated is
        never assumed; a cache write without one costs the input price."""
        if input_usd_per_mtok is not None or output_usd_per_mtok is not None:
            fresh, output = (input_usd_per_mtok or 0.0) / 1e6, (output_usd_per_mtok or 0.0) / 1e6
            known_cached = known_write = None
        else:
            try:
                info = litellm().get_model_info(model)
            except Exception:  # noqa: BLE001 - litellm raises bare Exception for unmapped models
                info = {}
            fresh, output = info.get("input_cost_per_token") or 0.0, info.get("output_cost_per_token") or 0.0
            known_cached = info.get("cache_read_input_token_cost")
            known_write = info.get("cache_creation_input_token_cost")
        if cached_input_usd_per_mtok is not None:
            known_cached = cached_input_usd_per_mtok / 1e6
        if cache_write_usd_per_mtok is not None:
            known_write = cache_write_usd_per_mtok / 1e6
        if cache_min_prompt_tokens is None:
            cache_min_prompt_tokens = cache_minimum_of(model)
        return cls(fresh, fresh if known_cached is None else known_cached, output, known_write, cache_min_prompt_tokens)


# The shortest prompt each provider caches, as its documentation states it: OpenAI's prompt caching
# and Anthropic's (Claude Sonnet/Opus; Haiku models need 2,048) from 1,024 tokens; DeepSeek's
# context caching in 64-token units from the first unit; self-hosted servers cache any prefix.
CACHE_MINIMUMS = {"openai/": 1024, "gpt-": 1024, "azure/": 1024, "anthropic/": 1024, "claude": 1024,
                  "deepseek": 64}


def cache_minimum_of(model: str) -> int:
    """The provider's minimum cacheable prompt for a litellm model name (0: any prefix)."""
    if model.startswith("text-completion-openai/"):  # an OpenAI-compatible server: self-hosted
        return 0
    return next((tokens for prefix, tokens in CACHE_MINIMUMS.items() if model.startswith(prefix)), 0)
