"""What an upstream's tokens cost: prices per token from the configuration or litellm's price map.

The cost issue's price model (cache-write prices, minimum cacheable prompt lengths, compute prices
of self-hosted upstreams) extends this module; the upstream client only asks it for a cost.
"""

from __future__ import annotations

from typing import NamedTuple

from adapters.litellm_client import litellm


class Prices(NamedTuple):
    """USD per token."""

    input: float
    cached_input: float
    output: float

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """Price of a call of this size, `cached_tokens` of its prompt at the cached price."""
        return ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output)

    @classmethod
    def of(cls, model: str, input_usd_per_mtok: float | None = None, output_usd_per_mtok: float | None = None,
           cached_input_usd_per_mtok: float | None = None) -> "Prices":
        """The configured prices (per million tokens), else litellm's map for `model`, else 0.
        Cached input without a known price costs the full input price: a discount nobody stated is
        never assumed."""
        if input_usd_per_mtok is not None or output_usd_per_mtok is not None:
            fresh, output = (input_usd_per_mtok or 0.0) / 1e6, (output_usd_per_mtok or 0.0) / 1e6
            known_cached = None
        else:
            try:
                info = litellm().get_model_info(model)
            except Exception:  # noqa: BLE001 - litellm raises bare Exception for unmapped models
                info = {}
            fresh, output = info.get("input_cost_per_token") or 0.0, info.get("output_cost_per_token") or 0.0
            known_cached = info.get("cache_read_input_token_cost")
        if cached_input_usd_per_mtok is not None:
            known_cached = cached_input_usd_per_mtok / 1e6
        return cls(fresh, fresh if known_cached is None else known_cached, output)
