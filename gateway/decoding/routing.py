"""A step's decision: what the request's policy wants, given the answer so far (and, for a policy
that weighs them, the next hand-off's predicted prices), and what the request allows of it.

A step stays local where hand-offs are closed (refused, or past the cost ceiling), the upstream is
down, the answer ends inside a character, or the answer is a draft (`escalation: draft`: a wanted
hand-off is only counted); once escalated, every step is the upstream's.

A routed step's token is then chosen by the request's combine rule (`Combining`): the upstream's
(take), or the upstream's alternatives weighed against the local distribution (contrastive, fuse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from adapters.upstream import Continuations
from gateway.decoding.answer import Answer
from gateway.decoding.handoffs import Gate, HandoffCalls
from gateway.decoding.values import LOCAL, DecodeRequest, RoutingUsage, Written
from gateway.settings.routing_values import CombineRule
from policies import LOCAL as LOCAL_STEP
from policies import UPSTREAM as UPSTREAM_STEP
from policies import Decision, RoutingState, Signal
from policies.combine import TokenIndex, combine, log_softmax


class Routing:
    """The decisions of one request's steps, counted in `usage` (vetoes, drafted hand-offs, degrades)."""

    def __init__(self, request: DecodeRequest, upstream: Continuations | None, gate: Gate, calls: HandoffCalls,
                 usage: RoutingUsage, answer: Answer, prompt_tokens: int) -> None:
        self._routing, self._upstream, self._gate, self._calls = request.routing, upstream, gate, calls
        self._usage, self._answer, self._prompt_tokens = usage, answer, prompt_tokens
        # the per-step prices are worked out only for a policy that weighs them, and need the ceiling's prompt count
        self._reads_prices = request.routing.policy.reads_prices and request.routing.ceiling is not None

    @property
    def may_route(self) -> bool:
        """Whether a step may be handed off at all: hand-offs open, a routing policy, the upstream up."""
        return not self._calls.closed and self._routing.policy.routes and self._upstream.available

    @property
    def drafts(self) -> bool:
        """The held answer is a local draft until it escalates: no hand-off is made before then."""
        review = self._routing.review
        return review.held and review.escalation == "draft" and not self._usage.escalated

    @property
    def warms_up(self) -> bool:
        """Whether to read the prompt into the upstream's cache ahead of the first hand-off: not under a
        cost ceiling (the first hand-off would pay for the prompt again) nor for a draft (it makes none)."""
        return (self.may_route and self._upstream.warms and self._routing.policy.wants_warm_up
                and not self._routing.capped_cost and not self.drafts)

    def decide(self, signal: Signal) -> Decision:
        """The step's decision: the policy's, or LOCAL where the request does not allow it."""
        calls, usage, text = self._calls, self._usage, self._answer.text
        if usage.escalated and not calls.closed and not text.mid_character:
            return UPSTREAM_STEP  # the upstream writes the rest
        wanted = self._routing.policy.decide(signal, self._state())
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
                calls.reusable_tokens = self._routing.ceiling.prompt_tokens + len(self._answer.tokens)
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
            handoff_cost_tokens=self._prompt_tokens + answered + self._routing.handoffs.span,
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
        prices, prompt, span = self._upstream.prices, self._routing.ceiling.prompt_tokens, self._routing.handoffs.span
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
        lengths = self._routing.answer_lengths
        excess = None if lengths is None else lengths.mean_excess(answered)  # None too while none ran longer
        return allowed if excess is None else min(allowed, max(1, round(excess)))


class LocalVocabulary(Protocol):
    """The local model's tokens as bytes (adapters.local_model.LocalModel)."""

    n_vocab: int
    end_token: int

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...


class Combining:
    """How one request's routed steps choose their token (policies/combine.py), each counted in
    `usage.combined`. A combined token that differs from the upstream's replaces what the hand-off
    wrote (the rest of a longer span followed the upstream's own token, so it is dropped); one that
    agrees keeps the whole span. An escalated answer's text is the upstream's, uncombined."""

    def __init__(self, rule: CombineRule, local: LocalVocabulary, usage: RoutingUsage) -> None:
        self._rule, self._local, self._usage = rule, local, usage

    async def written(self, got: Written | None, logits: np.ndarray) -> Written | None:
        """What the routed step keeps of `got` (None: nothing was written), given the step's local `logits`."""
        if got is None or self._usage.escalated:
            return got
        if not self._rule.combines:
            self._usage.count_combined("taken")
            return got
        first = got.first
        ends = first is not None and not first.token  # the upstream's token is the end (servers send it empty)
        if first is None or (ends and not (got.finished and not got.text)) \
                or not got.text.encode("utf-8").startswith(first.token):
            self._usage.count_combined("fell_back")  # no alternatives, a control token, text not the token's
            return got
        index, pieces = await vocabulary_of(self._local)
        chosen = combine(self._rule.params, first.token, first.top, log_softmax(logits), index, pieces)
        text = _text(chosen.text) if chosen.changed else None
        if chosen.changed and text is None:  # a token ending inside a character: not written on its own
            self._usage.count_combined("fell_back")
            return got
        self._usage.count_combined(chosen.how)
        return got if text is None else Written(text, not text, got.source)  # an empty text: the end chosen


def _text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def vocabulary_of(local: LocalVocabulary) -> tuple[TokenIndex, Sequence[bytes]]:
    """The local vocabulary's index and bytes by id (end-of-generation tokens empty; empty bytes
    align with its end token), built once per model on a worker thread."""
    known = _VOCABULARIES.get(local)
    if known is None:
        known = await asyncio.to_thread(_vocabulary, local)
        _VOCABULARIES[local] = known
    return known


def _vocabulary(local: LocalVocabulary) -> tuple[TokenIndex, list[bytes]]:
    pieces = [b"" if local.is_end_of_generation(t) else local.token_bytes(t) for t in range(local.n_vocab)]
    return TokenIndex(pieces, end=local.end_token), pieces
