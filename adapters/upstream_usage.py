"""What one upstream call billed and cost, read from whichever usage shape its provider returns.

Shapes, as each provider documents them (streamed answers carry the same object in their last chunk):
- OpenAI, vLLM, llama-server's /v1, and litellm's normalised responses: `usage.prompt_tokens`,
  `usage.completion_tokens`, `usage.prompt_tokens_details.cached_tokens`.
- DeepSeek: `usage.prompt_cache_hit_tokens` (and `prompt_cache_miss_tokens`).
- Anthropic's own body: `usage.input_tokens` (excluding cache reads and writes),
  `cache_read_input_tokens`, `cache_creation_input_tokens`, `output_tokens`.
- llama-server: a top-level `timings` object (`prompt_n`, `prompt_ms`, `predicted_n`,
  `predicted_ms`, `cache_n`): the upstream's own compute time for the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallUsage:
    """Billed counts of one call; None where the provider did not say."""

    prompt_tokens: int | None  # all prompt tokens, cached ones included
    completion_tokens: int | None
    cached_tokens: int  # prompt tokens read from the provider's cache (billed at its cached price)
    compute_ms: float | None  # prompt + generation time on the upstream, where it reports timings


def field_of(holder: Any, name: str) -> Any:
    """`holder[name]` or `holder.name` (provider objects come as dicts or as pydantic models)."""
    if holder is None:
        return None
    if isinstance(holder, dict):
        return holder.get(name)
    value = getattr(holder, name, None)
    if value is None:
        extra = getattr(holder, "model_extra", None) or {}
        value = extra.get(name)
    return value


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None


def read_usage(response: Any) -> CallUsage:
    """The usage of a response (or a streamed chunk) in any of the shapes above."""
    usage = field_of(response, "usage")
    prompt = _int(field_of(usage, "prompt_tokens"))
    completion = _int(field_of(usage, "completion_tokens"))
    cached = _int(field_of(field_of(usage, "prompt_tokens_details"), "cached_tokens"))
    if cached is None:
        cached = _int(field_of(usage, "prompt_cache_hit_tokens"))
    read = _int(field_of(usage, "cache_read_input_tokens"))
    if prompt is None and _int(field_of(usage, "input_tokens")) is not None:  # Anthropic's own counts
        prompt = sum(_int(field_of(usage, k)) or 0 for k in
                     ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        completion = _int(field_of(usage, "output_tokens"))
    if cached is None:
        cached = read
    return CallUsage(prompt, completion, min(cached or 0, prompt or 0) if prompt is not None else cached or 0,
                     _compute_ms(field_of(response, "timings")))


def _compute_ms(timings: Any) -> float | None:
    prompt_ms, predicted_ms = field_of(timings, "prompt_ms"), field_of(timings, "predicted_ms")
    if prompt_ms is None and predicted_ms is None:
        return None
    return float(prompt_ms or 0.0) + float(predicted_ms or 0.0)
