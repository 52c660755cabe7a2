"""Price-aware routing: a hand-off is made only when its chance of being needed, times what the
answer is worth, covers its predicted price, or in a short answer when it costs less than asking
directly; a costly running rate of hand-offs escalates."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.pricing import Prices
from policies import Route, RoutingState, Signal, build_policy
from policies.learned import FEATURES, Router

# An OpenAI-class sheet (USD per token): output 8x input, cached reads 0.1x, cache from 1,024 tokens
FRONTIER = Prices(1e-6, 0.1e-6, 8e-6, cache_min_prompt_tokens=1024)
UNSURE = Signal(entropy=1.0, top1=0.8, margin=0.6, position=40)  # need = 1 - top1 = 0.2


def handoff(prompt: int, answered: int, reused: int, limit: int = 512, prices: Prices = FRONTIER,
            calls: int = 0) -> RoutingState:
    """The state of a one-token hand-off `answered` tokens into an answer to a `prompt`-token
    prompt, priced as the decoder prices it; `reused`: prompt tokens of the request's last call."""
    call_prompt = prompt + answered
    return RoutingState(answer_tokens=answered, upstream_calls=calls, rest_tokens=limit - answered,
                        handoff_price_usd=prices.predicted(call_prompt, 1, reused),
                        direct_price_usd=prices.direct(prompt, limit),
                        rest_price_usd=prices.predicted(call_prompt, limit - answered, reused))


def test_a_cached_prefix_clears_the_bar_that_a_rebilled_one_does_not():
    policy = build_policy("always", answer_value=1.0, early_escalation=False)
    cached = handoff(prompt=1500, answered=100, reused=1599)  # the last call read 1,599 of these 1,600 tokens
    rebilled = handoff(prompt=1500, answered=100, reused=0)
    assert cached.handoff_price_usd < rebilled.handoff_price_usd / 5
    assert policy.decide(UNSURE, cached).upstream
    decision = policy.decide(UNSURE, rebilled)
    assert decision.route is Route.LOCAL and decision.vetoed == "price"


def test_a_prompt_under_the_providers_cache_minimum_is_never_priced_as_cached():
    policy = build_policy("always", answer_value=1.0, early_escalation=False)
    short = handoff(prompt=600, answered=100, reused=699)  # 700 tokens < 1,024: the provider caches nothing
    assert short.handoff_price_usd == FRONTIER.predicted(700, 1, 0)
    assert policy.decide(Signal(1.0, 0.95, 0.9, 40), short).vetoed == "price"  # need 0.05 < 0.16 of the answer
    assert policy.decide(Signal(3.0, 0.3, 0.1, 40), short).upstream  # need 0.7 clears it


def test_a_short_answers_hand_offs_are_weighed_against_asking_directly():
    policy = build_policy("always", answer_value=1.0, early_escalation=False)
    letter = handoff(prompt=84, answered=0, reused=0, limit=5)  # an option letter: 0.74 of asking directly
    decision = policy.decide(UNSURE, letter)  # need 0.2 would not clear the bar
    assert decision.upstream and decision.decisive
    later = handoff(prompt=84, answered=4, reused=0, limit=5, calls=1)  # "The correct answer is" and now the letter
    assert policy.decide(UNSURE, later).decisive
    assert build_policy("always", answer_value=0.5, early_escalation=False).decide(UNSURE, letter).vetoed == "price"


def test_a_longer_answers_hand_off_meets_the_bar():
    policy = build_policy("always", answer_value=1.0, early_escalation=False)
    first = handoff(prompt=600, answered=0, reused=0, limit=17)  # one token more than a short answer
    decision = policy.decide(Signal(1.0, 0.95, 0.9, 0), first)  # need 0.05, 0.8 of asking directly
    assert decision.vetoed == "price" and not decision.decisive


def test_the_bar_scales_with_what_the_answer_is_worth():
    rebilled = handoff(prompt=1500, answered=100, reused=0)  # about 0.29 of asking directly
    assert build_policy("always", answer_value=2.0, early_escalation=False).decide(UNSURE, rebilled).upstream
    assert not build_policy("always", answer_value=0.5, early_escalation=False).decide(UNSURE, rebilled).upstream


def test_a_learned_routers_score_is_the_need():
    weights = np.zeros(len(FEATURES))
    router = Router(weights, 0.0, np.zeros(len(FEATURES)), np.ones(len(FEATURES)), {0.1: 0.4}, "sha", {})  # score 0.5
    learned = build_policy("learned", threshold=0.4, router=router, answer_value=1.0, early_escalation=False)
    confident_local_model = Signal(entropy=0.1, top1=0.99, margin=0.98, position=40)  # 1 - top1 would veto
    rebilled = handoff(prompt=1500, answered=100, reused=0)
    decision = learned.decide(confident_local_model, rebilled)
    assert decision.upstream and decision.need == pytest.approx(0.5)


def test_a_free_upstream_changes_nothing():
    free = handoff(prompt=1500, answered=100, reused=0, prices=Prices(0.0, 0.0, 0.0), calls=10)
    decision = build_policy("always", answer_value=1.0).decide(UNSURE, free)
    assert decision.upstream and not decision.escalate


def test_a_costly_running_rate_hands_the_rest_over_at_once():
    policy = build_policy("always", answer_value=10.0)
    # a call every other token so far, each re-billing 1,600 tokens: the next 200 would cost far more
    # than the upstream writing the rest in one call
    busy = handoff(prompt=1500, answered=100, reused=0, limit=500, calls=50)
    assert policy.decide(UNSURE, busy).escalate
    rare_uncached = handoff(prompt=1500, answered=100, reused=0, limit=500, calls=3)
    assert policy.decide(UNSURE, rare_uncached).escalate  # even 12 more calls re-billing 1,600 tokens cost more
    rare_cached = handoff(prompt=1500, answered=100, reused=1599, limit=500, calls=3)
    assert not policy.decide(UNSURE, rare_cached).escalate  # 12 more cached calls cost less than 400 tokens
    early = handoff(prompt=1500, answered=2, reused=0, limit=500, calls=2)  # too few calls to judge a rate
    assert not policy.decide(UNSURE, early).escalate


def test_a_share_cap_turns_an_escalation_into_a_hand_off_up_to_the_cap():
    policy = build_policy("always", answer_value=10.0, max_upstream_share=0.6)
    busy = handoff(prompt=1500, answered=100, reused=0, limit=500, calls=50)
    busy = RoutingState(**{**busy.__dict__, "upstream_tokens": 50})
    decision = policy.decide(UNSURE, busy)
    assert decision.upstream and not decision.escalate and decision.room == 25  # (50 + 25) / (100 + 25) = 0.6


def test_only_a_price_aware_policy_asks_the_decoder_for_prices():
    assert build_policy("always", answer_value=1.0).reads_prices  # through its caps
    assert not build_policy("always").reads_prices
