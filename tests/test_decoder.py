"""The decoder's logic with scripted fakes: hand-off, re-tokenization, accounting, failures."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from adapters.memory_store import MemoryStore
from adapters.pricing import Prices
from adapters.store import Limits, StoreUnavailable
from adapters.upstream import UpstreamRejected
from adapters.upstream_errors import UpstreamFailedRequest
from gateway.decoding.answer import Answer
from gateway.decoding.cost_ceiling import CostCeiling, cost_ratio
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.signals import Sampling
from gateway.decoding.values import RequestRouting
from gateway.settings.routing_values import AnswerReview, CeilingRule, CombineRule, HandoffRule
from gateway.tenancy.budget import HandoffGate, Ledger
from policies import LOCAL, RecentValues, build_policy
from policies.base import PolicyDefaults
from tests.fakes import FakeLocalModel, FakeUpstream

VOCAB = ["Par", "is", "Paris", " is", " nice", " big", *sorted(set("Paris is nice big."))]


def make(local, upstream, policy="always", max_tokens=20, span=1, stop=(), limits=Limits(), store=None,
         span_until="tokens", grammar=None, prompt=None, ceiling=None, choice=0,
         escalation="continue", held=False, tenant="t", cache_scope="", combine=CombineRule(), **kw):
    store = store or MemoryStore()
    gate = HandoffGate(Ledger(store), tenant, limits, allowed=True, cache_scope=cache_scope)
    routing = RequestRouting(build_policy(policy, **kw), HandoffRule(span, span_until), ceiling,
                             AnswerReview(escalation=escalation, held=held), combine=combine)
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=max_tokens, routing=routing,
                            stop=stop, grammar=grammar, prompt=prompt, choice=choice)
    return Decoding(local, upstream, gate, request), store


async def run(decoding) -> list:
    return [piece async for piece in decoding.pieces()]


def invariant(decoding) -> None:
    counts = decoding.source_counts()
    assert sum(counts.values()) == len(decoding.answer_tokens) == len(decoding.sources)
    assert b"".join(decoding.local.token_bytes(t) for t in decoding.answer_tokens) == bytes(decoding.answer_bytes)


async def test_boundary_that_remerges_becomes_one_upstream_token():
    local = FakeLocalModel(VOCAB, "Par", uncertain_at=frozenset({1}))
    upstream = FakeUpstream("Paris is nice.", chars_per_token=2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0, max_tokens=3)
    pieces = await run(decoding)
    assert [p.source for p in pieces][:2] == ["local", "upstream"]
    # "Par" (local) + "is" (upstream) re-tokenizes as the single token "Paris"
    assert local.vocab[decoding.answer_tokens[0]] == "Paris"
    assert decoding.sources[0] == "upstream"
    assert "".join(p.text for p in pieces) == bytes(decoding.answer_bytes).decode()
    invariant(decoding)


def test_a_split_the_local_model_chose_far_back_is_not_undone_by_a_hand_off():
    local = FakeLocalModel(VOCAB, "")
    decoding, _ = make(local, FakeUpstream(""))
    written = ["Par", "is", *[" is"] * 8, " "]  # "Par" + "is": not how the tokenizer would split "Paris"
    decoding.answer.tokens = [local.vocab.index(t) for t in written]
    decoding.answer.sources = ["local"] * len(written)
    decoding.answer.data = bytearray("".join(written).encode())
    first_new, added = decoding.answer.append_text("nice", "upstream")  # " " + "nice" re-merges as " nice"
    assert [local.vocab[t] for t in decoding.answer_tokens] == [*written[:-1], " nice"]
    assert (first_new, added) == (len(written) - 1, b"nice")
    assert decoding.sources == ["local"] * (len(written) - 1) + ["upstream"]
    invariant(decoding)


async def test_a_raw_prompt_is_continued_as_text_and_handed_off_as_text():
    local = FakeLocalModel(VOCAB, "")
    upstream = FakeUpstream("Paris is nice.", chars_per_token=3)
    decoding, _ = make(local, upstream, prompt="The capital of France: ")
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and local.prompt_length == len("The capital of France: ")
    assert upstream.calls[0].prefix == "The capital of France: " and upstream.calls[0].messages == []


async def test_a_raw_prompt_stays_local_when_the_upstream_continues_chats_only():
    class ChatsOnly(FakeUpstream):
        def text_handoff(self, prompt: str, scope: str = "shared") -> None:
            return None

    upstream = ChatsOnly("Paris is nice.")
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris is nice."), upstream, prompt="The capital of France: ")
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and upstream.calls == []
    assert decoding.usage.degraded == ["upstream_continues_chats_only"]


def unsure_local() -> FakeLocalModel:
    """A local model unsure at every step (a need near 1), its greedy guess still on "Paris is big."."""
    return FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)), lean=2.0)


def ceiling(ratio: float | None, on_ceiling: str = "local") -> CostCeiling:
    # the decoding sets the prompt's count
    return CostCeiling(CeilingRule(ratio, on_ceiling), FakeUpstream("").prices, prompt_tokens=0)


def test_a_hand_off_is_held_only_if_the_ceiling_holds_whatever_it_writes():
    limit = CostCeiling(CeilingRule(2.0), Prices(input=1e-6, cached_input=1e-7, output=4e-6), prompt_tokens=100)
    limit.spent_usd = 1.5e-4  # asking directly: 1e-4 for the prompt, so 0.5e-4 of room
    # 100 prompt tokens: if the upstream ends the answer at once, 2.5e-4 is billed against 2e-4
    # allowed, though the 50 tokens it might write would raise the ceiling more than they cost
    assert limit.hold(0, 0, call_prompt_tokens=100, span=50) is None and limit.held_usd == 0
    assert limit.hold(0, 0, call_prompt_tokens=40, span=50) == pytest.approx(40e-6 + 50 * 4e-6)


def test_a_hold_counts_what_a_call_bills_beyond_the_answers_tokens():
    """An echo and the tokens read ahead are billed but raise no ceiling: with 30 of them, a call
    that fitted without them (the hold above) does not."""
    limit = CostCeiling(CeilingRule(2.0), Prices(input=1e-6, cached_input=1e-7, output=4e-6), prompt_tokens=100)
    limit.spent_usd = 1.5e-4
    assert limit.hold(0, 0, call_prompt_tokens=40, span=50, unwritten=30) is None
    assert limit.hold(0, 0, call_prompt_tokens=10, span=50, unwritten=8) == pytest.approx(10e-6 + 58 * 4e-6)


async def test_a_cost_ceiling_of_one_keeps_the_answer_within_asking_directly():
    limit = ceiling(1.0)
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris is nice."), FakeUpstream("Paris is nice."), ceiling=limit)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and decoding.usage.upstream_calls >= 1
    assert "cost_ceiling" in decoding.usage.degraded and decoding.source_counts()["local"] > 0
    assert decoding.usage.upstream_cost_usd == pytest.approx(limit.spent_usd)
    assert limit.spent_usd <= limit.direct_usd()  # the prompt once plus the answer, at the sheet's prices
    invariant(decoding)


async def test_escalation_hands_the_rest_to_the_upstream_in_one_call():
    upstream = FakeUpstream("Paris is nice.")
    decoding, _ = make(FakeLocalModel(VOCAB, "Rome"), upstream, ceiling=ceiling(1.0, "escalate"), max_tokens=20)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and decoding.usage.escalated  # all of it the upstream's: its answer, not Rome
    assert len(upstream.calls) == 2 and decoding.usage.upstream_calls == 2  # one hand-off, then the rest at once
    assert "cost_ceiling" in decoding.usage.degraded


async def test_price_aware_routing_hands_the_rest_over_once_hand_offs_cost_more_than_it():
    upstream = FakeUpstream("Paris is nice.")
    unsure = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)))  # a need near 1 everywhere
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1000.0)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and decoding.usage.escalated and decoding.usage.price_vetoes == 0
    assert len(upstream.calls) == decoding.usage.upstream_calls == 4  # three at a token each, then the rest


async def test_an_escalated_held_answer_is_asked_afresh_when_the_request_says_so():
    upstream = FakeUpstream("Paris is nice.")
    unsure = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)))
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1000.0, escalation="afresh", held=True)
    pieces = await run(decoding)
    assert "".join(p.text for p in pieces) == "Paris is nice."
    usage = decoding.usage
    assert usage.escalated and usage.afresh and usage.discarded_tokens > 0
    answers = [call.answer for call in upstream.calls]
    assert answers[0] == "" and all(answers[1:3]) and answers[3] == ""  # three hand-offs, then the prompt alone
    assert len(upstream.calls) == usage.upstream_calls == 4
    assert unsure.pauses == 4  # out of the engine's batch during every call, the fresh one too
    assert all(p.source == "upstream" for p in pieces if p.tokens)  # nothing of the discarded answer shown
    invariant(decoding)


@pytest.mark.parametrize("calls_cap", [None, 1])  # the hand-offs a draft did not make are not calls for a cap
async def test_a_draft_makes_no_hand_off_before_it_is_asked_afresh(calls_cap):
    upstream = FakeUpstream("Paris is nice.")
    decoding, _ = make(unsure_local(), upstream, ceiling=ceiling(None), answer_value=1000.0, escalation="draft",
                       held=True, max_upstream_calls=calls_cap)
    pieces = await run(decoding)
    assert "".join(p.text for p in pieces) == "Paris is nice."
    usage = decoding.usage
    assert usage.draft_hand_offs == 3 and usage.discarded_tokens == 3  # the running rate's three, drafted locally
    assert usage.afresh and [call.answer for call in upstream.calls] == [""] and usage.upstream_calls == 1
    assert all(p.source == "upstream" for p in pieces if p.tokens)
    invariant(decoding)


async def test_a_draft_the_price_rule_never_escalates_costs_nothing_upstream():
    upstream = FakeUpstream("Paris is nice.")
    unsure_twice = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset({1, 2}), lean=2.0)
    decoding, _ = make(unsure_twice, upstream, ceiling=ceiling(None), answer_value=1000.0, escalation="draft",
                       held=True)
    assert "".join(p.text for p in await run(decoding)) == "Paris is big."
    assert decoding.usage.draft_hand_offs == 2 and upstream.calls == [] and not decoding.usage.escalated


async def test_a_short_answers_draft_makes_the_hand_off_it_turns_on():
    upstream = FakeUpstream("Paris is nice.")
    unsure_first = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset({0}), lean=2.0)
    # 4 tokens allowed: a short answer, whose hand-off costs most of asking directly
    decoding, _ = make(unsure_first, upstream, policy="entropy", threshold=1.0, ceiling=ceiling(None),
                       answer_value=1.0, escalation="draft", held=True, max_tokens=4)
    await run(decoding)
    assert decoding.sources[0] == "upstream" and len(upstream.calls) == 1 and upstream.calls[0].answer == ""
    assert not decoding.usage.afresh and decoding.usage.draft_hand_offs == 0
    invariant(decoding)


async def test_a_draft_holding_a_short_answers_hand_offs_escalates_by_continuing_it():
    upstream = FakeUpstream("Paris is nice.")
    unsure = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)), lean=2.0)
    # every step wanted upstream: the short answer's hand-offs are made, then the running rate escalates
    decoding, _ = make(unsure, upstream, policy="entropy", threshold=1.0, ceiling=ceiling(None),
                       answer_value=1.0, escalation="draft", held=True, max_tokens=8)
    assert "".join(p.text for p in await run(decoding)) == "Paris is nice."
    assert decoding.usage.escalated and not decoding.usage.afresh and decoding.usage.discarded_tokens == 0
    assert [call.answer for call in upstream.calls][-1] != ""  # the last call continued the answer
    invariant(decoding)


@pytest.mark.parametrize("escalation", ["afresh", "draft"])
async def test_a_streamed_answer_escalates_by_continuing_whatever_the_request_says(escalation):
    upstream = FakeUpstream("Paris is nice.")
    unsure = FakeLocalModel(VOCAB, "Paris is big.", uncertain_at=frozenset(range(20)))
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1000.0, escalation=escalation, held=False)
    assert "".join(p.text for p in await run(decoding)) == "Paris is nice."
    assert decoding.usage.escalated and not decoding.usage.afresh and upstream.calls[-1].answer != ""
    assert len(upstream.calls) == 4 and decoding.usage.draft_hand_offs == 0


async def test_an_escalation_past_the_ceiling_is_asked_afresh_in_full():
    upstream = FakeUpstream("Paris is nice.")
    decoding, _ = make(FakeLocalModel(VOCAB, "Rome"), upstream, ceiling=ceiling(1.0, "escalate"),
                       escalation="afresh", held=True)
    assert "".join(p.text for p in await run(decoding)) == "Paris is nice."
    assert decoding.usage.afresh and upstream.calls[-1].answer == ""
    assert len(upstream.calls) == 2 and "cost_ceiling" in decoding.usage.degraded


@pytest.mark.parametrize(("on_ceiling", "asked_afresh"), [("local", False), ("escalate", True)])
async def test_a_fresh_escalation_past_the_ceiling_is_made_only_where_on_ceiling_escalates(on_ceiling, asked_afresh):
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1)
    unsure = unsure_local()
    limit = ceiling(3.0, on_ceiling)  # room for three one-token hand-offs, not for the whole answer on top of them
    decoding, _ = make(unsure, upstream, ceiling=limit, answer_value=1000.0, escalation="afresh", held=True,
                       max_tokens=6)
    text = "".join(p.text for p in await run(decoding))
    assert decoding.usage.afresh == asked_afresh and limit.held_usd == 0 and "cost_ceiling" in decoding.usage.degraded
    if asked_afresh:  # the prompt alone, then (the fake writing a character a token) its continuations
        assert upstream.calls[3].answer == "" and all(decoding.sources) and decoding.source_counts()["local"] == 0
    else:  # nothing after the three hand-offs: finished locally
        assert len(upstream.calls) == 3 and text == "Paris is big."
    invariant(decoding)


@pytest.mark.parametrize("escalation", ["continue", "afresh"])
async def test_an_escalation_that_stops_by_its_own_length_ends_the_answer_under_the_ceiling(escalation):
    # The fake upstream counts a character a token, so the escalation's call stops by length short
    # of the answer's limit in local tokens: a direct call would have stopped there too, so no call
    # follows it for the difference (which would bill the whole prompt again).
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1)
    limit = ceiling(5.0)
    decoding, _ = make(unsure_local(), upstream, ceiling=limit, answer_value=1000.0, escalation=escalation, held=True,
                       max_tokens=6)
    await run(decoding)
    assert decoding.usage.escalated and decoding.finish_reason == "length" and len(decoding.answer_tokens) < 6
    if escalation == "afresh":
        assert decoding.usage.afresh and upstream.calls[-1].answer == ""  # the fresh call was the last
    assert limit.held_usd == 0 and limit.spent_usd <= 5.0 * limit.direct_usd()
    invariant(decoding)


async def test_an_upstream_answer_that_stops_by_its_own_length_is_one_call_as_asking_directly_is():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1)  # 6 "tokens": "Paris ", two local ones
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, span=6, max_tokens=6)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris " and len(decoding.answer_tokens) == 2
    assert len(upstream.calls) == decoding.usage.upstream_calls == 1 and decoding.finish_reason == "length"


@pytest.mark.parametrize(("target", "max_tokens", "finish"), [("Paris is nice.", 6, "length"), ("Paris.", 20, "stop")])
async def test_an_answer_the_upstream_wrote_in_one_call_costs_what_asking_directly_does(target, max_tokens, finish):
    # A character a token: the upstream bills more tokens than its text re-tokenizes into locally.
    # Asking directly bills the upstream's own count, so that is what the answer is compared with.
    upstream = FakeUpstream(target, chars_per_token=1)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, span=max_tokens, max_tokens=max_tokens,
                       ceiling=ceiling(None))
    await run(decoding)
    assert decoding.finish_reason == finish and decoding.usage.upstream_calls == 1
    assert decoding.usage.upstream_completion_tokens > len(decoding.answer_tokens) + (finish == "stop")
    assert cost_ratio([decoding]) == 1.0


async def test_a_draft_asked_afresh_under_a_ceiling_of_one_bills_what_asking_directly_does():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1)
    limit = ceiling(1.0)
    # 20 tokens allowed: not a short answer, whose first hand-off a draft would make
    decoding, _ = make(unsure_local(), upstream, ceiling=limit, answer_value=1000.0, escalation="draft", held=True)
    await run(decoding)
    assert decoding.usage.afresh and len(upstream.calls) == 1 and "cost_ceiling" not in decoding.usage.degraded
    assert limit.spent_usd == pytest.approx(limit.direct_usd()) and cost_ratio([decoding]) == 1.0


async def test_a_span_cut_at_a_word_short_of_the_limit_is_not_the_answer_s_end():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=3)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, span=4, max_tokens=4, span_until="word")
    text = "".join(p.text for p in await run(decoding))
    assert len(upstream.calls) > 1 and text.startswith("Paris is")  # the cut span was followed by more


async def test_choices_sharing_a_ceiling_stay_under_it_with_fresh_escalations_refused_or_made():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1)
    limit = ceiling(5.0)
    choices = [make(unsure_local(), upstream, ceiling=limit, answer_value=1000.0, escalation="afresh", held=True,
                    max_tokens=6, choice=c)[0] for c in (0, 1)]
    await asyncio.gather(*(run(decoding) for decoding in choices))
    refused, made = sorted(choices, key=lambda decoding: decoding.usage.afresh)
    assert not refused.usage.afresh and made.usage.afresh
    assert "cost_ceiling" in refused.usage.degraded and made.finish_reason == "length"  # made in one call
    assert limit.held_usd == 0 and limit.spent_usd <= 5.0 * limit.direct_usd()
    assert limit.spent_usd == pytest.approx(sum(decoding.usage.upstream_cost_usd for decoding in choices))


async def test_a_failed_fresh_escalation_finishes_the_answer_locally_without_asking_again():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=1, fail_after=3)
    unsure = unsure_local()
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1000.0, escalation="afresh", held=True)
    text = "".join(p.text for p in await run(decoding))
    assert not decoding.usage.afresh and decoding.usage.upstream_calls == 3 and len(upstream.calls) == 4
    assert text == "Paris is big." and decoding.source_counts()["local"] > 0 and decoding.finish_reason == "stop"
    assert "upstream_unavailable" in decoding.usage.degraded
    invariant(decoding)


async def test_price_aware_routing_keeps_steps_local_that_are_not_worth_their_price():
    upstream = FakeUpstream("Paris is nice.")
    unsure = unsure_local()
    decoding, _ = make(unsure, upstream, ceiling=ceiling(None), answer_value=1e-6)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is big." and upstream.calls == []
    assert decoding.usage.price_vetoes == len(decoding.answer_tokens) + 1  # and the end-of-answer step


class PricesSeen(PolicyDefaults):
    """Keeps every step local and remembers the priced states it was shown."""

    name, reads_prices = "prices_seen", True

    def __init__(self) -> None:
        self.states = []

    def decide(self, signal, state):
        self.states.append(state)
        return LOCAL


async def test_a_priced_answer_expects_the_rest_that_recent_answers_longer_than_it_wrote():
    lengths, seen = RecentValues(), PricesSeen()
    for length in (2, 5, 9):
        lengths.add(length)
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=20,
                            routing=RequestRouting(seen, ceiling=ceiling(None), answer_lengths=lengths))
    decoding = Decoding(FakeLocalModel(VOCAB, "Paris is big. Paris is nice. Paris is big."), FakeUpstream(""), HandoffGate(
        Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
    await run(decoding)
    rests = [(s.answer_tokens, s.rest_tokens) for s in seen.states]
    # at 0 tokens, (2 + 5 + 9) / 3 still to come; at 3, 5 and 9 wrote (2 + 6) / 2 more; at 9, the 20 allowed less 9
    assert rests[:4] == [(0, 5), (1, 4), (2, 5), (3, 4)] and rests[8:10] == [(8, 1), (9, 11)]
    held = [lengths.quantile(q) for q in (0, 1 / 3, 2 / 3, 1)]
    assert sorted(held) == sorted([2, 5, 9, len(decoding.answer_tokens)])  # and this answer joins them


async def test_choices_share_one_ceiling_as_asking_directly_bills_their_prompt_once():
    limit = ceiling(2.0)
    decodings = [make(FakeLocalModel(VOCAB, "Paris is nice."), FakeUpstream("Paris is nice."), ceiling=limit,
                      choice=choice)[0] for choice in range(3)]
    await asyncio.gather(*(run(d) for d in decodings))
    assert sum(d.usage.upstream_cost_usd for d in decodings) == pytest.approx(limit.spent_usd)
    assert limit.spent_usd <= 2.0 * limit.direct_usd()
    assert sum(limit.answered.values()) == sum(len(d.answer_tokens) + 1 for d in decodings)  # and each end token


async def test_always_writes_everything_upstream_and_bills_each_call():
    local = FakeLocalModel(VOCAB, "")
    upstream = FakeUpstream("Paris is nice.", chars_per_token=3)
    decoding, store = make(local, upstream, span=2)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice."
    assert decoding.finish_reason == "stop"
    assert decoding.source_counts()["local"] == 0
    assert decoding.usage.upstream_calls == len(upstream.calls)
    usage = (await store.usage("t", time.time()))[0]
    assert usage.upstream_prompt_tokens == decoding.usage.upstream_prompt_tokens
    invariant(decoding)


async def test_an_upstream_answer_that_ends_past_the_limit_is_cut_by_length_and_bills_no_end_token():
    upstream = FakeUpstream("Paris is nice. " * 6, chars_per_token=20)  # finished in one call of 20 "tokens"
    limit = ceiling(None)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, span=20, max_tokens=8, ceiling=limit)
    await run(decoding)
    assert len(upstream.calls) == 1 and len(decoding.answer_tokens) == 8
    assert decoding.finish_reason == "length" and limit.answered == {0: 8}  # as a direct call of max_tokens 8


async def test_failed_upstream_decodes_the_step_locally_and_flags_it():
    local = FakeLocalModel(VOCAB, "Paris is nice.")
    upstream = FakeUpstream("Paris is big.", fail=True)
    decoding, store = make(local, upstream)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice."
    assert decoding.usage.degraded == ["upstream_unavailable"]
    assert decoding.usage.upstream_calls == 0
    assert (await store.headroom("t", Limits(day_tokens=100), time.time())).tokens == 100
    invariant(decoding)


async def test_budget_refusal_finishes_locally_without_overspending():
    local = FakeLocalModel(VOCAB, "Paris is nice.")
    upstream = FakeUpstream("Paris is big.", chars_per_token=2)
    decoding, store = make(local, upstream, limits=Limits(day_tokens=25))
    await run(decoding)
    assert "budget_exhausted" in decoding.usage.degraded
    spent = (await store.usage("t", time.time()))[0]
    assert 0 < spent.upstream_prompt_tokens + spent.upstream_completion_tokens <= 25
    assert decoding.source_counts()["local"] > 0
    invariant(decoding)


async def test_cancelled_request_bills_the_call_in_flight():
    """A client that leaves mid-hand-off does not make the call free: the upstream writes and bills
    it all the same, so it runs to its end and the ledger is settled from what it reported."""
    local = FakeLocalModel(VOCAB, "")
    upstream = FakeUpstream("Paris", delay_s=0.5)
    store = MemoryStore()
    decoding, _ = make(local, upstream, limits=Limits(day_tokens=1000), store=store)
    task = asyncio.create_task(run(decoding))
    await asyncio.sleep(0.1)
    assert (await store.headroom("t", Limits(day_tokens=1000), time.time())).tokens < 1000  # reserved
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await store.usage("t", time.time()))[0].upstream_completion_tokens == 0  # still in flight
    await asyncio.sleep(0.6)
    spent = (await store.usage("t", time.time()))[0]
    assert spent.upstream_prompt_tokens > 0 and spent.upstream_completion_tokens > 0
    billed = spent.upstream_prompt_tokens + spent.upstream_completion_tokens
    assert (await store.headroom("t", Limits(day_tokens=1000), time.time())).tokens == 1000 - billed


async def test_cancelled_request_releases_a_failed_call():
    local = FakeLocalModel(VOCAB, "")
    upstream = FakeUpstream("Paris", delay_s=0.3, fail=True)
    store = MemoryStore()
    decoding, _ = make(local, upstream, limits=Limits(day_tokens=1000), store=store)
    task = asyncio.create_task(run(decoding))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.4)
    assert (await store.headroom("t", Limits(day_tokens=1000), time.time())).tokens == 1000
    assert (await store.usage("t", time.time()))[0].upstream_prompt_tokens == 0


async def test_stop_string_across_a_hand_off_is_cut_and_never_shown():
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({2}))
    upstream = FakeUpstream("Paris is big.", chars_per_token=2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0, stop=("s b",))
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris i"  # "...is" came from the local model, " b" from upstream
    assert decoding.finish_reason == "stop"


async def test_max_tokens_holds_even_with_a_long_span():
    local = FakeLocalModel(VOCAB, "")
    upstream = FakeUpstream("Paris is nice. Paris is big.", chars_per_token=6)
    decoding, _ = make(local, upstream, span=8, max_tokens=3)
    await run(decoding)
    assert len(decoding.answer_tokens) == 3 and decoding.finish_reason == "length"
    invariant(decoding)


async def test_a_span_stops_at_the_upstream_token_cap():
    local = FakeLocalModel(list("abcdefgh "), "")  # one character, one token: no re-tokenization
    upstream = FakeUpstream("abc defgh", chars_per_token=1)
    decoding, _ = make(local, upstream, span=8, max_tokens=12, max_upstream_tokens=3)
    await run(decoding)
    assert bytes(decoding.answer_bytes) == b"abc" and len(upstream.calls) == 1
    assert decoding.source_counts()["upstream"] == 3
    invariant(decoding)


async def test_cached_continuation_is_reused_without_upstream_calls():
    local = FakeLocalModel(VOCAB, "")
    store = MemoryStore()
    first, _ = make(local, FakeUpstream("Paris is nice."), store=store)
    await run(first)
    upstream = FakeUpstream("Paris is nice.")
    second, _ = make(local, upstream, store=store)
    text = "".join(p.text for p in await run(second))
    assert text == "Paris is nice." and upstream.calls == []
    assert second.source_counts()["cache"] == len(second.answer_tokens) > 0
    invariant(second)


async def test_budget_too_small_for_a_hand_off_is_reported():
    from adapters.store import Headroom

    local = FakeLocalModel(VOCAB, "Paris is nice.")
    upstream = FakeUpstream("Paris is big.")
    decoding, _ = make(local, upstream, limits=Limits(day_tokens=5))
    decoding.gate.headroom = Headroom(tokens=5, cost_usd=None)  # as read at admission
    await run(decoding)
    assert upstream.calls == [] and decoding.usage.degraded == ["budget_exhausted"]
    assert decoding.source_counts()["local"] == len(decoding.answer_tokens)


async def test_continuation_cache_is_scoped_to_the_tenant():
    store = MemoryStore()
    first, _ = make(FakeLocalModel(VOCAB, ""), FakeUpstream("Paris is nice."), store=store)
    await run(first)
    upstream = FakeUpstream("Paris is nice.")
    other_tenant, _ = make(FakeLocalModel(VOCAB, ""), upstream, store=store, tenant="u")
    await run(other_tenant)
    assert upstream.calls and other_tenant.source_counts()["cache"] == 0


async def test_tenants_that_share_a_cache_scope_reuse_each_other():
    store = MemoryStore()
    decodings = [make(FakeLocalModel(VOCAB, ""), FakeUpstream("Paris is nice."), store=store, tenant=tenant,
                      cache_scope="shared")[0] for tenant in "tu"]
    for decoding in decodings:
        await run(decoding)
    assert decodings[1].upstream.calls == [] and decodings[1].source_counts()["cache"] > 0


async def test_a_store_outage_skips_one_hand_off_not_the_rest_of_the_request():
    class BrieflyDown(MemoryStore):
        reserves = 0

        async def reserve(self, *args, **kwargs):
            self.reserves += 1
            if self.reserves == 1:
                raise StoreUnavailable("scripted outage")
            return await super().reserve(*args, **kwargs)

    upstream = FakeUpstream("Paris is nice.")
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris is big."), upstream, store=BrieflyDown())
    await run(decoding)
    assert decoding.usage.degraded == ["store_unavailable"]
    assert decoding.source_counts()["local"] == 1 and len(upstream.calls) > 1
    invariant(decoding)


@pytest.mark.parametrize(("error", "reason"), [
    (UpstreamRejected("400: context length exceeded"), "upstream_rejected"),
    (UpstreamFailedRequest("500 to the request's own seed"), "upstream_unavailable"),
])
async def test_a_rejected_hand_off_is_not_tried_again_in_the_request(error, reason):
    class Rejecting(FakeUpstream):
        async def continue_text(self, handoff, *args, **kwargs):
            self.calls.append(handoff)
            raise error

    upstream = Rejecting("Paris")
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris is big."), upstream)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is big." and len(upstream.calls) == 1
    assert decoding.usage.degraded == [reason]


class Echoing(FakeUpstream):
    """As a chat_fallback reply does, it repeats the answer's end (3 tokens) before the span."""

    def estimate_completion_tokens(self, handoff, span):
        return span + 3


@pytest.mark.parametrize("upstream", [Echoing("Paris", delay_s=0.3), FakeUpstream("Paris", delay_s=0.3, read_ahead=3)],
                         ids=["echo", "read_ahead"])
async def test_a_handoff_reserves_every_completion_token_its_call_bills(upstream):
    """Completion tokens beyond the span that the provider bills (an echo of the answer's end, the
    tokens a call reads ahead) are reserved with it: a budget's last tokens cannot pay them."""
    store = MemoryStore()
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, store=store)
    task = asyncio.create_task(run(decoding))
    await asyncio.sleep(0.1)
    held = 1000 - (await store.headroom("t", Limits(day_tokens=1000), time.time())).tokens
    assert held == upstream.estimate_prompt_tokens(upstream.calls[0]) + 1 + 3
    await task


async def test_the_next_routed_steps_take_what_a_call_read_ahead_without_calling():
    """A call reads 3 tokens past its span; while the answer goes on as they read, the next routed
    steps are written from them: the same answer for a quarter of the calls."""
    texts, calls = [], []
    for read_ahead in (0, 3):
        upstream = FakeUpstream("Paris is nice.", read_ahead=read_ahead)
        decoding, _ = make(FakeLocalModel(VOCAB, "Paris is big."), upstream)
        texts.append("".join(p.text for p in await run(decoding)))
        calls.append(len(upstream.calls))
        invariant(decoding)
    assert texts == ["Paris is nice."] * 2
    assert calls == [7, 2]  # 7 pieces of 2 characters (the last ends the answer): 1 + 3 read ahead a call
    assert decoding.source_counts()["cache"] > 0


async def test_what_was_read_ahead_is_dropped_once_the_local_model_writes_something_else():
    """Routed at the first step and again after the local model wrote "ris big" where the upstream
    had read "ris is" ahead: the second step asks the upstream, nothing is taken from the first."""
    upstream = FakeUpstream("Paris is nice.", read_ahead=3)
    local = FakeLocalModel(VOCAB, "Paris big.", uncertain_at=frozenset({0, 5}), lean=2.0)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    pieces = await run(decoding)
    assert [(p.text, p.source) for p in pieces[:4]] == [("Pa", "upstream"), ("r", "local"), ("is", "local"),
                                                        (" big", "local")]
    assert [call.answer for call in upstream.calls] == ["", "Paris big"]
    assert decoding.source_counts()["cache"] == 0


async def test_a_combined_step_reads_nothing_ahead():
    """A combined step needs the upstream's alternatives at its own position: a call per step."""
    upstream = FakeUpstream("Paris is nice.", read_ahead=3)
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris is big."), upstream, combine=CombineRule("fuse"))
    await run(decoding)
    assert len(upstream.calls) == 7 and all(call.alternatives for call in upstream.calls)
    assert decoding.source_counts()["cache"] == 0


async def test_a_request_like_an_earlier_one_takes_what_was_read_ahead_from_the_cache_too():
    """Steps written from what a call read ahead were never asked alone, so the cache keeps what was
    read ahead with the step: a request like it writes the same answer with no call (an upstream
    asked anew at those steps could answer otherwise: this one would write "big")."""
    store = MemoryStore()
    first, _ = make(FakeLocalModel(VOCAB, ""), FakeUpstream("Paris is nice.", read_ahead=3), store=store)
    await run(first)
    upstream = FakeUpstream("Paris is big.", read_ahead=3)
    second, _ = make(FakeLocalModel(VOCAB, ""), upstream, store=store)
    assert "".join(p.text for p in await run(second)) == "Paris is nice." and upstream.calls == []
    invariant(second)


async def test_a_reservation_outlives_its_slowest_possible_call():
    store = MemoryStore(reservation_ttl_s=60)
    upstream = FakeUpstream("Paris", delay_s=5.0, worst_case_s=300.0)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, store=store)
    task = asyncio.create_task(run(decoding))
    await asyncio.sleep(0.1)
    [(_, expires)] = store._held["t"].values()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert expires - time.time() >= 300.0


async def test_a_guess_the_upstream_confirms_is_kept():
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0}), lean=1.0)
    upstream = FakeUpstream("Paris is nice.", chars_per_token=5, delay_s=0.2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and len(upstream.calls) == 1
    assert decoding.usage.guess_kept_tokens == 3  # " is", " nice", "." decoded while "Paris" was upstream
    assert decoding.usage.guesses_dropped == 0
    assert decoding.source_counts() == {"local": 3, "upstream": 1, "cache": 0}
    invariant(decoding)


async def test_a_guess_the_upstream_contradicts_is_rolled_back():
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({2}), lean=1.0)
    upstream = FakeUpstream("Paris is big.", chars_per_token=4, delay_s=0.2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is big" and decoding.usage.guess_kept_tokens == 0  # " nice." was guessed, then dropped
    assert decoding.usage.guesses_dropped == 1
    assert local.forwards[-1] == [1] * local.prompt_length + local.tokenize_text(b"Paris is big")
    invariant(decoding)


async def test_a_guessed_step_the_policy_routes_is_decided_once():
    """A window-calibrated policy learns from every decision, so a step decided twice would count twice."""
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0, 2}), lean=1.0)
    upstream = FakeUpstream("Paris is nice.", chars_per_token=5, delay_s=0.2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    decided, policy = [], decoding.request.routing.policy

    class Recording:
        def __getattr__(self, name):
            return getattr(policy, name)

        def decide(self, signal, state):
            decided.append(signal.position)
            return policy.decide(signal, state)

    recorded = dataclasses.replace(decoding.request.routing, policy=Recording())
    decoding = Decoding(local, upstream, decoding.gate, dataclasses.replace(decoding.request, routing=recorded))
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice." and len(upstream.calls) == 2  # "Paris", then " nice" (guessed, routed)
    assert decided == sorted(set(decided))
    assert 2 in decided and decoding.usage.guess_kept_tokens >= 1  # " is" kept, " nice" routed from its guess


async def test_no_guess_is_started_that_would_end_after_the_reply_is_due():
    async def guessed(step_s: float | None) -> Decoding:
        local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0, 2}), lean=1.0)
        local.step_s = step_s
        upstream = FakeUpstream("Paris is nice.", chars_per_token=5, delay_s=0.05)
        decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
        assert "".join(p.text for p in await run(decoding)) == "Paris is nice."
        assert len(upstream.calls) == 2  # "Paris", then " nice" (guessed, routed)
        return decoding

    # both keep " is", guessed during the first hand-off (its reply time unknown); during the
    # second, known to answer in 0.05 s, a step said to take a second is not begun, so "." is not guessed
    assert (await guessed(None)).usage.guess_kept_tokens == 2
    assert (await guessed(1.0)).usage.guess_kept_tokens == 1


async def test_sampled_requests_do_not_guess():
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0}), lean=1.0)
    upstream = FakeUpstream("Paris is nice.", chars_per_token=5, delay_s=0.2)
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    decoding = Decoding(local, upstream, decoding.gate,
                        dataclasses.replace(decoding.request, sampling=Sampling(temperature=0.7), seed=1))
    await run(decoding)
    assert decoding.usage.guess_kept_tokens == 0 and len(local.forwards) == len(decoding.answer_tokens) + 1


async def test_cached_prompt_tokens_are_charged_at_the_cached_price():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=3, cached_share=0.5)
    decoding, store = make(FakeLocalModel(VOCAB, ""), upstream, span=2)
    await run(decoding)
    usage, day = decoding.usage, (await store.usage("t", time.time()))[0]
    cached = [int(upstream.estimate_prompt_tokens(h) * 0.5) for h in upstream.calls]
    assert usage.upstream_cached_tokens == sum(cached) > 0 and day.upstream_cached_tokens == sum(cached)
    full_price = sum(upstream.estimate_cost(upstream.estimate_prompt_tokens(h), 2) for h in upstream.calls)
    assert day.upstream_cost_usd == pytest.approx(usage.upstream_cost_usd, abs=1e-6)
    assert usage.upstream_cost_usd < full_price - 0.5 * sum(cached) * 1e-6
    assert usage.upstream_compute_ms == day.upstream_compute_ms == 5.0 * len(upstream.calls)


async def test_span_until_word_writes_one_word_per_hand_off():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=6)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, span=4, span_until="word")
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is nice."
    assert [h.answer for h in upstream.calls] == ["", "Paris", "Paris is"]
    invariant(decoding)


async def test_a_warm_up_whose_token_is_the_first_hand_off_is_not_called_twice():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=5, warms=True)
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0}))
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0)
    text = "".join(p.text for p in await run(decoding))
    assert [h.answer for h in upstream.calls] == [""]  # the warm-up only
    assert text.startswith("Paris") and decoding.sources[0] == "upstream"
    assert decoding.usage.upstream_calls == 1


async def test_a_warm_up_in_flight_prices_the_first_hand_off_as_reading_the_prompt_from_the_cache():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=5, warms=True)  # cached reads at 0.1x
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0}))
    # worth 0.3 of the answer: a hand-off re-billing the prompt would not clear the bar, a cached one does
    decoding, _ = make(local, upstream, policy="entropy", threshold=1.0, ceiling=ceiling(None), answer_value=0.3)
    await run(decoding)
    assert decoding.sources[0] == "upstream" and decoding.usage.price_vetoes == 0


async def test_warm_up_sends_the_prompt_before_the_first_hand_off_and_is_not_a_hand_off():
    upstream = FakeUpstream("Paris is nice.", chars_per_token=20, warms=True)
    decoding, _ = make(FakeLocalModel(VOCAB, ""), upstream, policy="top1", threshold=1.1, span=8)  # routes all
    await run(decoding)
    assert [h.answer for h in upstream.calls] == ["", ""]  # the warm-up, then the hand-off
    assert decoding.usage.upstream_calls == 1
    assert decoding.usage.upstream_prompt_tokens == 2 * upstream.estimate_prompt_tokens(upstream.calls[0])


@pytest.mark.parametrize("policy", ["never", "always"])
async def test_requests_that_never_or_always_route_do_not_warm_the_upstream(policy):
    upstream = FakeUpstream("Paris is nice.", chars_per_token=20, warms=True)
    decoding, _ = make(FakeLocalModel(VOCAB, "Paris"), upstream, policy=policy, span=8)
    await run(decoding)
    assert len(upstream.calls) == (0 if policy == "never" else 1)  # always: its first step is the hand-off


# -- under a grammar (a fake that accepts the prefixes of one text) --

async def test_upstream_text_is_kept_only_as_far_as_the_grammar_accepts_it():
    local = FakeLocalModel(VOCAB, "Paris is big.")
    upstream = FakeUpstream("Paris is nice.", chars_per_token=4)
    decoding, _ = make(local, upstream, span=4, grammar="Paris is big.")
    text = "".join(p.text for p in await run(decoding))
    assert text == "Paris is big." and decoding.finish_reason == "stop"
    assert decoding.sources[0] == "upstream" and "local" in decoding.sources  # " nice" was cut, " big" local
    invariant(decoding)


async def test_an_upstream_that_ends_early_cannot_end_the_answer():
    """The upstream says it is done before the grammar is complete: the answer goes on locally
    (it once looped forever, asking the upstream again and again)."""
    local = FakeLocalModel(VOCAB, "Paris is big.")
    upstream = FakeUpstream("Paris is", chars_per_token=4)
    decoding, _ = make(local, upstream, span=4, grammar="Paris is big.")
    text = "".join(p.text for p in await asyncio.wait_for(run(decoding), 5))
    assert text == "Paris is big." and decoding.finish_reason == "stop"
    invariant(decoding)


async def test_local_tokens_the_grammar_forbids_are_redrawn():
    local = FakeLocalModel(VOCAB, "Paris is nice.")
    decoding, _ = make(local, None, policy="never", grammar="Paris is big.")
    assert "".join(p.text for p in await run(decoding)) == "Paris is big."


async def test_a_cancelled_grammar_mask_returns_only_once_its_thread_has():
    """The request frees its grammar as it unwinds: a cancellation must not outrun the thread still
    masking with it."""
    running, release, returned = threading.Event(), threading.Event(), threading.Event()

    class SlowGrammar:
        def mask(self, tokens, logits):
            running.set()
            release.wait(5)
            returned.set()
            return logits

    answer = Answer(None, 8, (), SlowGrammar())  # masking reads no vocabulary
    task = asyncio.create_task(answer.masked(np.zeros(4)))
    await asyncio.to_thread(running.wait, 5)
    task.cancel()
    await asyncio.sleep(0.2)
    assert not task.done()  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert returned.is_set()
