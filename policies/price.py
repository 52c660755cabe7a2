"""Price-aware routing: a wrapper that weighs each hand-off its policy wants against its price.

A hand-off is worth its price when the chance that it is needed, times what a correct answer is
worth, covers what it is predicted to bill:

    need x answer_value x direct_price >= handoff_price

`need` is the inner policy's own estimate (a learned router's score) or else 1 - top-1, the local
model's own chance of being wrong. `answer_value` is in multiples of asking the upstream directly
for the whole answer (`direct_price`), so the bar is a unitless share that rises with the price of
this hand-off: one whose prefix the provider reads from its cache at a tenth of the price clears
it far more easily than one that re-bills a long prefix.

In an answer expected to run at most SHORT_ANSWER_TOKENS tokens (a label, an option, a number) a
hand-off is weighed against asking directly instead. Such an answer turns on one or two of its
steps, and its prompt is most of its price, so each hand-off costs most of what asking directly
does: the bar above would veto the deciding step unless the policy were nearly sure, though the
alternatives are staying local, wrong at the chance the policy judged too high, or asking
directly, which buys the same step for more. Which step decides is not known as it is decoded (an
upstream that opens with "The correct answer is" writes the letter on its fifth step), so every
hand-off the policy wants in such an answer is made when it costs at most answer_value x
direct_price, a draft's included (`Decision.decisive`).

Escalation: after `min_calls` hand-offs, the running rate of hand-offs per answer token predicts
how many are still to come; once those would cost (at this hand-off's price) at least what the
upstream writing the rest in one call costs, the rest is handed over at once. The hand-offs a draft
wanted and did not make count as made: the rate measures how often the answer needs the upstream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policies.base import Decision, Policy, Route, RoutingState, Signal, Wrapping

SHORT_ANSWER_TOKENS = 16  # an option letter with its text, a yes or no, a number, a short label


@dataclass(frozen=True)
class PriceAware(Wrapping):
    inner: Policy
    answer_value: float = 1.0
    escalate: bool = True
    min_calls: int = 3
    reads_prices = True

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        wanted = self.inner.decide(signal, state)
        if not wanted.upstream:
            return wanted
        need = (1.0 - signal.top1) if wanted.need is None else wanted.need
        decisive = self.decisive(state)
        if not decisive and need * self.answer_value * state.direct_price_usd < state.handoff_price_usd:
            return Decision(Route.LOCAL, vetoed="price")
        if self.escalate and self.hand_over_rest(state):
            return Decision(Route.UPSTREAM, escalate=True, need=need)
        if decisive:
            return dataclasses.replace(wanted, decisive=True)
        return wanted

    def decisive(self, state: RoutingState) -> bool:
        """A hand-off in a short answer, costing at most what the answer is worth."""
        short = state.answer_tokens + state.rest_tokens <= SHORT_ANSWER_TOKENS
        priced = state.direct_price_usd > 0  # unpriced (a free upstream) says nothing of the answer's length
        return priced and short and state.handoff_price_usd <= self.answer_value * state.direct_price_usd

    def hand_over_rest(self, state: RoutingState) -> bool:
        """The hand-offs the running rate predicts cost at least the upstream writing the rest."""
        calls = state.upstream_calls + state.drafted_calls
        if calls < self.min_calls or state.answer_tokens == 0 or state.rest_price_usd <= 0:
            return False
        to_come = calls / state.answer_tokens * state.rest_tokens
        return to_come * state.handoff_price_usd >= state.rest_price_usd
