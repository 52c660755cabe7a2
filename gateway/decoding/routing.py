"""A step's decision: what the request's policy wants, given the answer so far (and, for a policy
that weighs them, the next hand-off's predicted prices), and what the request allows of it.

A step stays local where hand-offs are closed (refused, or past the cost ceiling), the upstream is
down, the answer ends inside a character, or the answer is a draft (`escalation: draft`: a wanted
hand-off is only counted); once escalated, every step is the upstream's.
"""

from __future__ import annotations

import dataclasses

from adapters.upstream import Continuations
from gateway.decoding.answer import Answer
from gateway.decoding.handoffs import Gate, HandoffCalls
from gateway.decoding.values import LOCAL, DecodeRequest, RoutingUsage
from policies import LOCAL as LOCAL_STEP
from policies import UPSTREAM as UPSTREAM_STEP
from policies import Decision, RoutingState, Signal


class Routing:
    """The decisions of one request's steps, counted in `usage` (vetoes, drafted hand-offs, degrades)."""

    def __init__(self, request: DecodeRequest, upstream: Continuations | None, gate: Gate, calls: HandoffCalls,
                 usage: RoutingUsage, answer: Answer, prompt_tokens: int) -> None:
        self._request, self._upstream, self._gate, self._calls = request, upstream, gate, calls
        self._usage, self._answer, self._prompt_tokens = usage, answer, prompt_tokens
        # the per-step prices are worked out only for a policy that weighs them, and need the ceiling's prompt count
        self._reads_prices = request.policy.reads_prices and request.ceiling is not None

    @property
    def may_route(self) -> bool:
        """Whether a step may be handed off at all: hand-offs open, a routing policy, the upstream up."""
        return not self._calls.closed and self._request.policy.routes and self._upstream.available

    @property
    def drafts(self) -> bool:
        """The held answer is a local draft until it escalates: no hand-off is made before then."""
        request = self._request
        return request.held and request.escalation == "draft" and not self._usage.escalated

    @property
    def warms_up(self) -> bool:
        """Whether to read the prompt into the upstream's cache ahead of the first hand-off: not under a
        cost ceiling (the first hand-off would pay for the prompt again) nor for a draft (it makes none)."""
        return (self.may_route and self._upstream.warms and self._request.policy.wants_warm_up
                and not self._request.capped_cost and not self.drafts)

    def decide(self, signal: Signal) -> Decision:
        """The step's decision: the policy's, or LOCAL where the request does not allow it."""
        calls, usage, text = self._calls, self._usage, self._answer.text
        if usage.escalated and not calls.closed and not text.mid_character:
            return UPSTREAM_STEP  # the upstream writes the rest
        wanted = self._request.policy.decide(signal, self._state())
        if wanted.vetoed == "budget" and not calls.closed:
            usage.degrade("budget_exhausted")
        elif wanted.vetoed == "price" and self.may_route:
            usage.price_vetoes += 1
        if not wanted.upstream or calls.closed or text.mid_character:  # read only where it decides
            return LOCAL_STEP
        if not self._upstream.available:
            usage.degrade("upstream_unavailable")
            return LOCAL_STEP
        if self.drafts and not (wanted.escalate or wanted.decisive):
            usage.draft_hand_offs += 1
            if self._reads_prices:  # priced on as if made: the next call would extend this one's prefix
                calls.reusable_tokens = self._request.ceiling.prompt_tokens + len(self._answer.tokens)
            return LOCAL_STEP
        return wanted

    def _state(self) -> RoutingState:
        answered = len(self._answer.tokens)
        state = RoutingState(
            answer_tokens=answered,
            upstream_tokens=answered - self._answer.sources.count(LOCAL),
            upstream_calls=self._usage.upstream_calls,
            drafted_calls=self._usage.draft_hand_offs,
            budget_tokens_left=self._gate.tokens_left(),
            handoff_cost_tokens=self._prompt_tokens + answered + self._request.span,
        )
        return self._priced(state) if self._reads_prices and not self._calls.closed else state

    def _priced(self, state: RoutingState) -> RoutingState:
        """The state with the next hand-off's predicted prices. The hand-off's prompt is counted as
        the upstream's count of the request's prompt plus the answer's local tokens (no second
        tokenization per step), and at least the previous call's, whose prefix the provider's
        cache may read; a warm-up in flight has paid for reading the prompt into it already (the
        hand-off waits for it), so decisions weigh what is left to pay. The answer is expected to
        run as long as recent answers that ran longer than it has (the limit, before there are any):
        priced at the limit, a short answer's direct price is inflated several times over, and with
        it what a hand-off may cost and how many more the rest of the answer seems to need."""
        prices, prompt, span = self._upstream.prices, self._request.ceiling.prompt_tokens, self._request.span
        reused = max(self._calls.reusable_tokens, prompt if self._calls.warming is not None else 0)
        call_prompt, rest = max(prompt + state.answer_tokens, reused), self._expected_rest(state.answer_tokens)
        return dataclasses.replace(
            state, rest_tokens=rest,
            handoff_price_usd=prices.predicted(call_prompt, span, reused),
            direct_price_usd=prices.direct(prompt, state.answer_tokens + rest),
            rest_price_usd=prices.predicted(call_prompt, rest, reused))

    def _expected_rest(self, answered: int) -> int:
        """Answer tokens still to come: on average, what recent answers longer than `answered` wrote
        past it, within the limit; all the limit allows when there are none."""
        allowed = self._answer.limit - answered
        lengths = self._request.answer_lengths
        excess = None if lengths is None else lengths.mean_excess(answered)  # None too while none ran longer
        return allowed if excess is None else min(allowed, max(1, round(excess)))
