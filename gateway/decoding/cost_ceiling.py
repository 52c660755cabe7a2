"""A request's cost ceiling: its hand-offs never bill more than a multiple of asking the upstream
directly for the same answer.

What asking directly costs is the upstream's price sheet applied to the prompt once (as the
upstream counts it) and the answer's tokens (all choices'). Before each hand-off the decoder
`hold`s the call's worst case (no prompt token read from a cache, each written to it where that
costs more) and `settle`s it to what was billed after, so what is billed can only be less, and the
ceiling holds whatever the provider's cache does. One ceiling is shared by a request's choices
(`n`), since asking directly would bill their prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adapters.pricing import Prices
from gateway.settings.routing_values import CeilingRule


@dataclass
class CostCeiling:
    """One request's ceiling under `rule` (the routing's max_cost_ratio and on_ceiling), as it is spent."""

    rule: CeilingRule
    prices: Prices
    prompt_tokens: int  # the upstream's count of the request's prompt
    spent_usd: float = 0.0  # billed by this request's hand-offs so far, every choice's
    held_usd: float = 0.0  # the worst case of hand-offs in flight (choices decode concurrently)
    answered: dict[int, int] = field(default_factory=dict)  # choice -> answer tokens so far

    @property
    def ratio(self) -> float | None:
        """The most the hand-offs may bill, as a multiple of asking directly; None: no ceiling, only the report."""
        return self.rule.max_cost_ratio

    @property
    def escalates(self) -> bool:
        """Past the ceiling, the upstream writes the rest of the answer (on_ceiling: escalate), which may pass it."""
        return self.rule.on_ceiling == "escalate"

    def note(self, choice: int, answered: int) -> None:
        self.answered[choice] = answered

    def direct_usd(self, more_tokens: int = 0) -> float:
        """What asking the upstream directly for the answers so far (plus `more_tokens`) would cost."""
        return self.prices.direct(self.prompt_tokens, sum(self.answered.values()) + more_tokens)

    def hold(self, choice: int, answered: int, call_prompt_tokens: int, span: int, unwritten: int = 0) -> float | None:
        """Hold the worst case of a hand-off of this size by choice `choice`, `answered` tokens into
        its answer, if it keeps the request under the ceiling; None if it would not. `unwritten`:
        completion tokens the call bills beyond the answer's (an echo, what it reads ahead)."""
        self.note(choice, answered)
        if self.ratio is not None and not self._fits(call_prompt_tokens, span, unwritten):
            return None
        worst = self.prices.worst_case(call_prompt_tokens, span + unwritten)
        self.held_usd += worst
        return worst

    def _fits(self, call_prompt_tokens: int, span: int, unwritten: int) -> bool:
        """Whether the request stays under the ceiling whatever the call writes, if the answer ends
        there. Its bill and what asking directly costs both grow linearly in the tokens it writes,
        so writing none and writing all `span` bound every outcome: with a ratio above 1 the call
        that writes nothing binds (its prompt is paid for without the answer's tokens that would
        raise the ceiling), below 1 the one that writes all."""
        committed = self.spent_usd + self.held_usd
        return all(committed + self.prices.worst_case(call_prompt_tokens, written + unwritten)
                   <= self.ratio * self.direct_usd(written) for written in (0, span))

    def settle(self, held: float, billed_usd: float) -> None:
        """Replace a hold by what the hand-off billed (0 when it failed)."""
        self.held_usd -= held
        self.spent_usd += billed_usd


def cost_ratio(decodings: Sequence[Any]) -> float | None:
    """What a request's hand-offs billed over what asking the upstream directly for the same
    answers would cost (each prompt once, at the upstream's prices); None without an upstream or
    a price. `decodings` are the request's Decodings (each with `.request.routing.ceiling` and `.usage`)."""
    ceilings = {id(c): c for c in (d.request.routing.ceiling for d in decodings) if c is not None}
    direct = sum(c.direct_usd() for c in ceilings.values())
    billed = sum(d.usage.upstream_cost_usd for d in decodings)
    return round(billed / direct, 4) if direct > 0 else None
