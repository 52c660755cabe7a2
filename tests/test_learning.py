"""Routing that learns (policies/online_check.py, gateway/shadow/learning.py): the fit, the
promotion rule, the bar held by its interval, decay, the tenant's share of examples, and two
replicas sharing one learned check, over the in-process store and real Redis.

Examples here are synthetic: the first feature (mean entropy) decides whether the local answer
agrees, with noise, so a fitted check must rank them and a check fitted on the opposite must not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from adapters.memory_store import MemoryStore
from adapters.model_files import model_sha256
from gateway.settings import LearnSettings, RoutingSettings, TenantSettings
from gateway.settings.shadow import OperatorShadowSettings
from gateway.shadow.cases import LocalAnswer, ShadowCase
from gateway.shadow.lanes import Lane
from gateway.shadow.learning import FITTED_FEATURES, LEARNED_CHECK, CheckLearner, PromotedState, example_of
from gateway.shadow.service import Shadow
from gateway.tenancy.budget import Ledger
from policies.answer_check import FEATURES, AnswerCheck, AnswerStats
from policies.online_check import (
    AGREEMENT_FEATURES,
    LEARNED_FEATURES,
    AnswerInputs,
    Example,
    LearnedCheck,
    auc,
    choose_bar,
    fit_candidate,
    is_held_out,
    promotes,
    wilson,
)
from tests import test_shadow
from tests.fakes import FakeUpstream

SHA = "ab" * 32
redis_prefix, redis_store = test_shadow.redis_prefix, test_shadow.redis_store  # fixtures: a test's keys, two replicas
LEARNING = {"policy": "never", "shadow": {"rate": 0.2}, "quality_target": 0.8, "learn": "on"}


def stats(entropy: float, tokens: int = 20) -> AnswerStats:
    return AnswerStats(entropy, entropy * 2, 1.0 - entropy / 4, entropy, tokens, False)


def synthetic(n: int, seed: int = 0, flipped: bool = False) -> list[tuple[AnswerStats, bool]]:
    """(stats, agreed): low entropy agrees (high entropy does, `flipped`), with 10% of labels noise."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        entropy = rng.uniform(0, 3)
        agreed = (entropy < 1.5) != flipped
        rows.append((stats(entropy), agreed if rng.random() > 0.1 else not agreed))
    return rows


def examples(n: int, seed: int = 0) -> list[Example]:
    return [example_of(LocalAnswer(s, "x", 10), agreed, "number", "t") for s, agreed in synthetic(n, seed)]


# -- the math --

def test_auc_counts_pairs_ranked_right_and_ties_as_half():
    assert auc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert auc([0.5, 0.5, 0.5, 0.5], [False, True, False, True]) == 0.5
    assert auc([0.1, 0.3, 0.2, 0.4], [False, True, True, False]) == 0.5
    assert auc([0.1, 0.2], [True, True]) is None


def test_the_held_out_split_is_fixed_by_the_id_and_near_its_share():
    ids = [f"id{i}" for i in range(4000)]
    held = [is_held_out(i, 0.3) for i in ids]
    assert held == [is_held_out(i, 0.3) for i in ids]
    assert 0.27 < sum(held) / len(held) < 0.33


def test_the_bar_holds_the_target_by_the_lower_bound_not_the_point_estimate():
    # 20 held-out answers, the 2 that disagree rated lowest; an answer below the bar is asked afresh (agrees)
    scores = [i / 20 for i in range(20)]
    labels = [i >= 2 for i in range(20)]
    keep_all = choose_bar(scores, labels, 0.6)  # 18/20 = 0.9, lower bound 0.699
    assert keep_all.value == 0.0 and keep_all.agreement == 0.9 and keep_all.escalated_share == 0.0
    one = choose_bar(scores, labels, 0.7)  # 0.9 would do by the point estimate; its lower bound does not
    assert one.value == scores[1] and one.agreement == 0.95 and one.agreement_low == pytest.approx(wilson(19, 20)[0])
    two = choose_bar(scores, labels, 0.8)
    assert two.value == scores[2] and two.escalated_share == 0.1 and two.agreement == 1.0
    assert choose_bar(scores, labels, 0.85).value == 1.0  # 20 examples cannot show 0.85 even at 20/20


def test_a_target_no_bar_can_hold_asks_everything_afresh():
    bar = choose_bar([0.2, 0.4, 0.6], [True, False, True], 0.99)
    assert bar.value == 1.0 and bar.escalated_share == 1.0


def test_a_check_fitted_on_the_fit_part_ranks_the_held_out_part():
    candidate = fit_candidate(examples(400), 0.3, 0.8, SHA, {"source": "test"})
    assert candidate is not None and candidate.auc > 0.8
    assert candidate.held_out + candidate.fitted_on == 400 and 80 < candidate.held_out < 160
    assert candidate.check.model_sha256 == SHA
    assert candidate.check.confidence(stats(0.2)) > 0.7 > 0.3 > candidate.check.confidence(stats(2.8))


def test_a_fit_waits_for_both_labels():
    same = [Example(f"e{i}", tuple(stats(1.0).features()), True, {}) for i in range(200)]
    assert fit_candidate(same, 0.3, 0.8, SHA, {}) is None


def context_examples(n: int, separates: str, seed: int = 0) -> list[Example]:
    """Examples whose stats are noise and whose label is decided by one other input only: the
    answer's format (a number agrees, free text does not) or its prompt's length (long prompts
    disagree)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        agreed = rng.random() < 0.5
        long_prompt = not agreed if separates == "prompt" else rng.random() < 0.5
        numeric = agreed if separates == "format" else rng.random() < 0.5
        text = "The answer is 42." if numeric else "I could not say."
        local = LocalAnswer(stats(rng.uniform(0, 3), rng.randint(5, 60)), text, rng.randint(400, 900) if long_prompt
                            else rng.randint(10, 60))
        rows.append(example_of(local, agreed, "number", "t"))
    return rows


@pytest.mark.parametrize("separates", ["format", "prompt"])
def test_a_learned_check_reads_the_answer_format_and_prompt_length_the_six_features_do_not(separates):
    rows = context_examples(400, separates)
    learned = fit_candidate(rows, 0.3, 0.8, SHA, {}, FITTED_FEATURES)
    six = fit_candidate(rows, 0.3, 0.8, SHA, {})
    assert learned.check.features == FITTED_FEATURES and six.check.features == FEATURES
    assert learned.auc > 0.9 and six.auc < 0.75
    agreeing = AnswerInputs.of(stats(1.5), "The answer is 42.", 30)
    disagreeing = AnswerInputs.of(stats(1.5), "I could not say." if separates == "format" else "The answer is 42.",
                                  30 if separates == "format" else 800)
    assert learned.check.confidence(agreeing) > 0.8 > 0.2 > learned.check.confidence(disagreeing)


def test_the_agreement_share_is_a_feature_with_its_own_indicator_where_no_samples_ran():
    features = ("agreement", "has_agreement", "format_number", "format_text", "log_prompt_tokens")
    assert AnswerInputs.of(stats(1.0), "The answer is 42.", 9, 0.75).vector(features).tolist() == \
        [0.75, 1.0, 1.0, 0.0, math.log(10)]
    unknown = AnswerInputs.of(stats(1.0), None, None, None).vector(features)
    assert unknown[:2].tolist() == [0.0, 0.0] and np.isnan(unknown[2:]).all()
    rng = random.Random(3)
    rows = [example_of(LocalAnswer(stats(rng.uniform(0, 3)), "x", 10, share), share > 0.5, "number", "t")
            for share in (rng.choice([0.0, 0.25, 0.75, 1.0]) for _ in range(300))]
    learned = fit_candidate(rows, 0.3, 0.8, SHA, {}, LEARNED_FEATURES)
    assert learned.auc > 0.9 and fit_candidate(rows, 0.3, 0.8, SHA, {}).auc < 0.75


async def test_the_decoder_rates_a_live_answer_with_the_learned_checks_inputs():
    from adapters.store import Limits
    from gateway.decoding.decoder import DecodeRequest, Decoding
    from gateway.decoding.values import RequestRouting
    from gateway.settings.routing_values import AnswerReview
    from gateway.shadow.learning import LiveCheck
    from gateway.tenancy.budget import HandoffGate, Ledger
    from policies import build_policy
    from tests.fakes import FakeLocalModel, FakeUpstream

    async def rated(answer: str) -> float:
        live = LiveCheck()  # free text rated 0.2, a number 0.8: only the format can tell them apart
        live.current = LearnedCheck(("format_number", "format_text"), np.array([math.log(4), -math.log(4)]), 0.0,
                                    np.zeros(2), np.ones(2), SHA, {})
        vocabulary = [answer, *sorted(set(answer + "It is 7."))]  # the fresh answer is tokenized too
        routing = RequestRouting(build_policy("never"), review=AnswerReview(live, escalate_below=0.5, held=True))
        request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=20, routing=routing)
        run = Decoding(FakeLocalModel(vocabulary, answer), FakeUpstream("It is 7."),
                       HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
        [piece async for piece in run.pieces()]
        assert run.usage.afresh == (run.usage.answer_confidence < 0.5)
        return run.usage.answer_confidence

    assert await rated("Paris is nice.") == 0.2 and await rated("It is 42.") == 0.8


def test_promotion_needs_a_ranking_at_least_the_current_better_than_chance_and_a_tie_more_examples():
    assert promotes(0.7, None) and not promotes(0.5, None) and not promotes(None, 0.6)
    assert promotes(0.7, 0.7) and not promotes(0.69, 0.7)
    assert not promotes(0.7, 0.7, fitted_on_more=False)  # the same ranking on no more examples: no new version


def test_learn_settings_switch_and_refuse_what_cannot_run():
    assert RoutingSettings(**LEARNING).learn == LearnSettings()
    assert RoutingSettings(**{**LEARNING, "learn": "off", "quality_target": None}).learn.enabled is False
    for routing, needle in (({**LEARNING, "shadow": None}, "learn needs shadow"),
                            ({**LEARNING, "quality_target": None}, "learn needs a quality_target"),
                            ({**LEARNING, "knob": {"field": "escalate_below", "floor": 0.1, "ceiling": 0.9,
                                                   "step": 0.1}}, "learn and knob")):
        with pytest.raises(ValueError, match=needle):
            RoutingSettings(**routing)
    preset = RoutingSettings(preset="learning")
    assert preset.learn.enabled and preset.shadow.rate == 0.2 and preset.quality_target == 0.9


# -- the learner over a store --

def learner(tenant_share: float | None = None, **learn) -> CheckLearner:
    settings = LearnSettings(**{"min_examples": 60, "refit_every": 20, "live_window": 40, **learn})
    return CheckLearner("routed", settings, 0.8, SHA, tenant_share)


def shadow_case(tenant: str = "t") -> ShadowCase:
    return ShadowCase(alias="routed", tenant=tenant, tenant_rate=None, answer="42", routed_cost=0.0, max_tokens=16)


async def feed(one: CheckLearner, store, rows: list[tuple[AnswerStats, bool]], tenant: str = "t") -> int:
    kept = 0
    for s, agreed in rows:
        kept += await one.add(store, shadow_case(tenant), LocalAnswer(s, "x", 10), agreed, "number")
    return kept


async def promote_and_share(store_one, store_two) -> None:
    """One replica learns and promotes; the other reads the same check and routes by it."""
    one, two = learner(), learner()
    routing = RoutingSettings(**LEARNING)
    cold = one.routing_of(routing)
    assert cold.answer_check == LEARNED_CHECK and cold.escalate_below == 1.0 and one.rate(0.2) == 1.0
    await feed(one, store_one, synthetic(59))
    await one.refit(store_one)
    assert one.version is None  # below min_examples: still the cold start
    await feed(two, store_two, synthetic(200, seed=1))  # the other replica's samples pool in the same list
    await one.refit(store_one)
    assert one.version == 1 and one.state.auc > 0.8 and one.examples == 259
    learned = one.routing_of(routing)
    assert learned.answer_check == LEARNED_CHECK and 0.0 <= learned.escalate_below < 1.0 and one.rate(0.2) == 0.2
    assert one.state.bar.agreement_low >= 0.8
    await two.sync(store_two)
    assert two.version == 1 and two.routing_of(routing).escalate_below == learned.escalate_below
    assert two.live.confidence(stats(0.3)) == one.live.confidence(stats(0.3)) > 0.5
    await two.refit(store_two)  # nothing new to fit on: the figures stand
    assert two.state.history == one.state.history and len(one.state.history) == 1


async def test_examples_pool_and_a_promoted_check_is_shared_in_memory():
    store = MemoryStore()
    await promote_and_share(store, store)


@pytest.mark.integration
async def test_examples_pool_and_a_promoted_check_is_shared_in_redis(redis_store):
    await promote_and_share(*redis_store)


async def test_a_worse_candidate_is_not_promoted_and_its_figures_are_kept():
    store = MemoryStore()
    one = learner(decay_auc=0.0)
    await feed(one, store, synthetic(200))
    await one.refit(store)
    assert one.version == 1 and one.state.bar is not None
    # then examples whose fit part ranks the other way round, and whose held-out part does not
    rows = iter(synthetic(2000, seed=2))
    added = 0
    while added < 300:
        s, agreed = next(rows)
        example = example_of(LocalAnswer(s, "x", 10), agreed, "number", "t")
        flipped = not is_held_out(example.id, one.settings.held_out)
        body = {**example.to_json(), "agreed": agreed != flipped}
        added += await store.examples_add(one.key, json.dumps(body), "t", None, 2000)
    await one.refit(store)
    last = one.state.history[-1]
    assert last["promoted"] is False and last["auc"] < 0.5 < 0.8 < last["current_auc"] and one.version == 1
    assert one.state.auc == pytest.approx(last["current_auc"], abs=1e-4) and one.state.bar.held_out > 60


async def test_a_check_whose_live_ranking_decays_falls_back_and_learns_again():
    store = MemoryStore()
    one = learner()
    await feed(one, store, synthetic(200))
    await one.refit(store)
    assert one.version == 1
    await feed(one, store, synthetic(40, seed=3, flipped=True))
    await one.refit(store)
    assert one.version is None and one.state.history[-1]["event"] == "decayed"
    assert one.routing_of(RoutingSettings(**LEARNING)).escalate_below == 1.0  # back to the cold start
    await feed(one, store, synthetic(30, seed=4, flipped=True))
    await one.refit(store)
    assert one.version is None  # only examples after the fall count: 30 < min_examples
    await feed(one, store, synthetic(200, seed=5, flipped=True))
    await one.refit(store)
    assert one.version == 2 and one.live.confidence(stats(2.8)) > one.live.confidence(stats(0.2))


async def test_one_tenant_gives_at_most_its_share_of_the_examples():
    store = MemoryStore()
    one = learner(tenant_share=0.5)
    assert await feed(one, store, synthetic(10), tenant="a") == 1  # alone, past its half of what there is
    assert await feed(one, store, synthetic(3), tenant="b") == 2
    kept, total = await store.examples_read(one.key)
    assert total == 3 and len(kept) == 3 and one.refused_by_share == 10
    assert {json.loads(text)["tenant"] for text in kept} == {"a", "b"}


async def test_the_store_keeps_the_newest_examples_and_swaps_only_what_it_expects():
    store = MemoryStore()
    for i in range(7):
        assert await store.examples_add("k", str(i), "t", None, 5)
    assert await store.examples_read("k") == (["2", "3", "4", "5", "6"], 7)
    assert await store.learned_swap("k", "v1", None) and not await store.learned_swap("k", "v2", None)
    assert await store.learned_swap("k", "v2", "v1") and await store.learned_read("k") == "v2"


@pytest.mark.integration
async def test_redis_keeps_examples_and_swaps_as_the_memory_store_does(redis_store):
    one, two = redis_store
    for i in range(7):  # interleaved: each tenant stays within its half
        assert await one.examples_add("k", str(i), "a" if i % 2 else "b", 0.5, 5)
    # a has 3 of 7: it may reach ceil(half of 8) = 4 and ceil(half of 9) = 5, not ceil(half of 10) = 5 + 1
    assert [await two.examples_add("k", x, "a", 0.5, 5) for x in "xyz"] == [True, True, False]
    assert await two.examples_read("k") == (["4", "5", "6", "x", "y"], 9)
    assert await one.learned_read("k") is None
    assert await one.learned_swap("k", "v1", None) and not await two.learned_swap("k", "v2", None)
    assert await two.learned_swap("k", "v2", "v1") and await one.learned_read("k") == "v2"


def test_examples_hold_features_and_lengths_never_text():
    example = example_of(LocalAnswer(stats(0.5, 12), "The answer is 42.", 33, 0.75), True, "number", "t")
    body = example.to_json()
    assert body["features"] == list(stats(0.5, 12).features()) and body["agreed"] is True
    assert body["prompt_tokens"] == 33 and body["answer_chars"] == 17 and body["agreement"] == 0.75
    assert "answer is" not in json.dumps(body)
    assert Example.of_json(json.loads(json.dumps(body))) == example
    assert np.allclose(example.features, stats(0.5, 12).features())



# -- through the shadow service --

async def test_shadow_samples_of_the_alias_own_routing_become_examples_labelled_by_the_local_answer():
    from gateway.shadow.figures import check_version_prefix, figures_of

    store = MemoryStore()
    routing = RoutingSettings(**LEARNING)
    lane = learning_lane()
    shadow = Shadow(OperatorShadowSettings(queue=64), {"routed": lane}, Ledger(store), rng=random.Random(0))
    assert lane.rate == 1.0 and shadow.routing_of("routed", routing).escalate_below == 1.0  # learning, cold start
    shadow.offer(offered(LocalAnswer(stats(2.0), "The answer is 41.", 10)))  # asked afresh: the client got 42
    shadow.offer(offered(LocalAnswer(stats(0.2), "The answer is 42.", 10)))
    shadow.offer(offered(None))  # an answer nobody rated: no example
    shadow.offer(offered(LocalAnswer(stats(0.2), "42", 10), overrides=({"policy": "entropy"},)))  # other routing
    while not shadow.queue.empty():
        queued_lane, queued = shadow.queue.get_nowait()
        await shadow.answer(queued_lane, queued)
    await shadow.sync()
    kept, total = await store.examples_read(lane.learner.key)
    assert total == 2 and [json.loads(text)["agreed"] for text in kept] == [False, True]
    assert shadow.counts["examples", "routed"] == 2
    totals, _ = await store.quality_read("routed")
    cold = figures_of(totals, check_version_prefix(None))  # what the cold start served: both agreed
    assert cold.samples == 3 and cold.agreed == 3 and cold.routed_cost == pytest.approx(3e-6)


async def test_the_report_and_metrics_show_the_learning_state():
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.shadow.metrics import ShadowCollector
    from gateway.shadow.report import quality_report
    from tests.test_observability import samples, value

    store = MemoryStore()
    lane = learning_lane()
    shadow = Shadow(OperatorShadowSettings(), {"routed": lane}, Ledger(store))
    await feed(lane.learner, store, synthetic(200))
    cold = (await quality_report(shadow, 0.0))["aliases"][0]["learning"]
    assert cold["state"] == "cold_start" and cold["version"] is None and cold["predicted_agreement"] is None
    await lane.learner.refit(store)
    await shadow.sync()
    learning = (await quality_report(shadow, 0.0))["aliases"][0]["learning"]
    assert learning["state"] == "settled" and learning["version"] == 1 and learning["examples"] == 200
    assert learning["held_out_auc"] > 0.8 and learning["bar"]["agreement_low"] >= 0.8
    assert learning["predicted_agreement"] == learning["bar"]["agreement"] and learning["fits"][0]["promoted"]
    assert learning["measured"]["samples"] == 0  # nothing shadowed yet under version 1
    registry = CollectorRegistry()
    registry.register(ShadowCollector(lambda: shadow))
    m = samples(generate_latest(registry).decode())
    assert value(m, "gateway_learning_version", alias="routed") == 1
    assert value(m, "gateway_learning_examples_pooled", alias="routed") == 200
    assert value(m, "gateway_learning_auc", alias="routed", set="held_out") == pytest.approx(learning["held_out_auc"],
                                                                                         abs=1e-4)
    assert value(m, "gateway_learning_escalate_below", alias="routed") == learning["bar"]["value"]
    assert value(m, "gateway_learning_agreement", alias="routed", kind="predicted_low") == \
        learning["bar"]["agreement_low"]


# -- what the Store holds from another version, reloads and tenants that come later --

def test_a_state_record_this_gateway_cannot_read_is_refused_as_none(caplog):
    good = PromotedState(version=2, auc=0.8).text()
    assert PromotedState.of(good) == PromotedState(version=2, auc=0.8)
    for text in ('{"version": 3, "written_by": "a later gateway"}', '{"version": "three"}', "not json", "[1]"):
        with caplog.at_level(logging.WARNING, logger="gateway.shadow"):
            assert PromotedState.of(text, "routed:ab") == PromotedState()
        assert "routed:ab" in caplog.text and "treated as none" in caplog.text
        caplog.clear()


async def test_an_example_this_gateway_cannot_read_is_left_out_and_learning_goes_on():
    store, one = MemoryStore(), learner()
    await store.examples_add(one.key, '{"written_by": "another version"}', "t", None, 1000)
    await feed(one, store, synthetic(200))
    await one.refit(store)
    assert one.version == 1


async def test_a_check_that_does_not_load_is_none_and_the_next_promotion_replaces_it(caplog):
    store, one = MemoryStore(), learner()
    bad = PromotedState(version=4, check={"format": "not a check"}, bar=BAR).text()
    assert await store.learned_swap(one.key, bad, None)
    with caplog.at_level(logging.WARNING, logger="gateway.shadow"):
        await one.sync(store)
    assert one.version is None and "does not load here" in caplog.text
    await feed(one, store, synthetic(200))
    await one.refit(store)
    assert one.version == 1 and PromotedState.of(await store.learned_read(one.key)).version == 1


async def test_a_state_fitted_on_the_six_features_by_an_older_version_loads_and_rates_with_them():
    store, one = MemoryStore(), learner()
    # it ranks backwards (high entropy rated up): any fit on the synthetic examples beats it
    weights, mean, scale = np.array([0.0, 1.0, -0.5, 0.0, 0.2, -0.3]), np.full(6, 0.5), np.full(6, 2.0)
    older = AnswerCheck(weights, 0.4, mean, scale, {}, SHA, {"source": "an older gateway"})
    await feed(one, store, synthetic(200))  # before its promotion: its next fit reads them
    state = PromotedState(version=3, check=older.to_json(), auc=0.8, bar=BAR, fitted_on=100, promoted_at=200)
    assert await store.learned_swap(one.key, state.text(), None)
    await one.sync(store)
    assert one.version == 3 and one.live.current.features == FEATURES
    for s in (stats(0.2), stats(2.8, 200)):  # read with its own six features, whatever else is known
        rated = one.live.confidence(AnswerInputs.of(s, "The answer is 42.", 500, 0.25))
        assert rated == pytest.approx(older.confidence(s), abs=1e-12) and rated == one.live.confidence(s)
    await one.refit(store)  # its successor records the features it was fitted on
    promoted = PromotedState.of(await store.learned_read(one.key))
    assert promoted.version == 4 and promoted.check["features"] == list(FITTED_FEATURES)
    assert one.live.current.features == FITTED_FEATURES and AGREEMENT_FEATURES[0] not in FITTED_FEATURES


async def test_the_refresher_outlives_a_record_it_cannot_read_and_reads_the_next(caplog):
    store = MemoryStore()
    shadow = Shadow(OperatorShadowSettings(refresh_s=0.01), {"routed": learning_lane()}, Ledger(store))
    one = shadow.lanes["routed"].learner
    newer = '{"version": 1, "written_by": "a later gateway"}'
    assert await store.learned_swap(one.key, newer, None)
    refresher = asyncio.create_task(shadow.refresh())
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.shadow"):
            await asyncio.sleep(0.1)
        assert not refresher.done() and one.version is None and "treated as none" in caplog.text
        assert await store.learned_swap(one.key, PromotedState(version=1, check=check_for(SHA), bar=BAR).text(), newer)
        await asyncio.sleep(0.1)
        assert not refresher.done() and one.version == 1
    finally:
        refresher.cancel()


async def test_a_new_service_reads_the_promoted_check_at_once_not_after_its_first_interval():
    store = MemoryStore()
    shadow = Shadow(OperatorShadowSettings(refresh_s=300), {"routed": learning_lane()}, Ledger(store))
    one = shadow.lanes["routed"].learner
    assert await store.learned_swap(one.key, PromotedState(version=3, check=check_for(SHA), bar=BAR).text(), None)
    refresher = asyncio.create_task(shadow.refresh())
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert one.version == 3
    finally:
        refresher.cancel()


async def test_a_reload_that_keeps_the_alias_keeps_its_learned_check_counts_and_queue():
    store = MemoryStore()
    ledger, model = Ledger(store), object()
    first = Shadow.of(SETTINGS, {"routed": alias_of(SAMPLED, model)}, ledger)
    assert await store.learned_swap(first.lanes["routed"].learner.key,
                                    PromotedState(version=1, check=check_for(model_sha256("smollm2-135m-instruct")), bar=BAR).text(),
                                    None)
    await first.sync()
    first.offer(offered())  # sampled and queued on the running service
    aliases = {"routed": alias_of(SAMPLED, model)}
    second = Shadow.of(SETTINGS, aliases, ledger, running=first)
    learner_now = second.lanes["routed"].learner
    assert learner_now is first.lanes["routed"].learner and aliases["routed"].answer_check is learner_now.live
    assert learner_now.version == 1 and second.routing_of("routed", SAMPLED).escalate_below == BAR["value"]
    close(second.tasks())  # takes over the queued case and the pending counts
    assert second.queue.qsize() == 1 and second.queue.get_nowait()[0] is second.lanes["routed"]
    second.offer(offered())
    third = Shadow.of(SETTINGS, {"routed": alias_of(SAMPLED.model_copy(update={"quality_target": 0.85}), model)},
                      ledger, running=second)
    assert third.lanes["routed"].learner is not learner_now and third.lanes["routed"].learner.version is None
    close(third.tasks())
    assert third.queue.empty()  # it ran the routing before the change: no label for the new one
    await third.sync()
    totals, _ = await store.quality_read("routed")
    assert totals["eligible"] == 2 and totals["sampled"] == 2  # nothing counted was lost on the way
    assert third.lanes["routed"].learner.version == 1  # the same alias and model: the same record


async def test_tenants_added_after_start_count_at_the_next_refresh():
    directory = [TenantSettings(id="a", api_key_env="A_KEY")]
    shadow = Shadow.of(SETTINGS, {"routed": alias_of(SAMPLED, object())}, Ledger(MemoryStore()),
                       tenants=lambda: directory)
    one = shadow.lanes["routed"].learner
    assert one.tenant_share is None  # one tenant alone: its examples are all there are
    directory.append(TenantSettings(id="b", api_key_env="B_KEY"))  # created through the admin API
    await shadow.sync()
    assert one.tenant_share == SAMPLED.learn.tenant_share


SAMPLED = RoutingSettings(**{**LEARNING, "shadow": {"rate": 1.0}})
SETTINGS = SimpleNamespace(shadow=OperatorShadowSettings(queue=8), tenants=[], models=SimpleNamespace(local={"m": SimpleNamespace(
    gguf="smollm2-135m-instruct")}))  # a catalog model: its sha256 is pinned, no file is read
def check_for(sha: str) -> dict[str, Any]:
    """A check that rates every answer 0.5, stamped for the model `sha`."""
    return AnswerCheck(np.zeros(len(FEATURES)), 0.0, np.zeros(len(FEATURES)), np.ones(len(FEATURES)), {}, sha,
                       {}).to_json()


BAR = {"value": 0.5, "escalated_share": 0.0, "agreement": 0.9, "agreement_low": 0.85, "held_out": 30}


@dataclass(frozen=True)
class RuntimeAlias:
    """What Shadow.of reads of the runtime's alias (gateway/runtime.py's Alias)."""

    settings: Any
    upstream: Any
    local: Any
    answer_check: Any = None


def alias_of(routing: RoutingSettings, model: object) -> RuntimeAlias:
    return RuntimeAlias(SimpleNamespace(routing=routing, local="m"), FakeUpstream("The answer is 42."), model)


def learning_lane() -> Lane:
    return Lane("routed", FakeUpstream("The answer is 42."), RoutingSettings(**LEARNING), learner=learner())


def offered(local: LocalAnswer | None = None, **changes) -> ShadowCase:
    return ShadowCase(alias="routed", tenant="t", tenant_rate=None, answer="The answer is 42.", routed_cost=1e-6,
                      max_tokens=16, messages=[{"role": "user", "content": "q?"}], local=local, **changes)


def close(coroutines: list) -> None:
    for coroutine in coroutines:  # the service's tasks, not run here
        coroutine.close()


# -- a live gateway on real Redis --

@pytest.mark.integration
def test_a_live_gateway_keeps_examples_and_routes_by_the_promoted_check(smol_llama_server, redis_url, redis_prefix,
                                                                       tmp_path):
    import math
    import time

    import httpx

    from adapters.redis_store import RedisStore
    from tests.conftest import ADMIN_KEY, gateway_config, live_gateway
    from tests.test_playground import Browser, chromium_binary

    prefix = redis_prefix
    config = gateway_config(smol_llama_server, mode="tokens")
    config["aliases"]["routed"]["routing"] = {"policy": "never", "shadow": {"rate": 0.5}, "quality_target": 0.8,
                                              "learn": {"min_examples": 20, "refit_s": 0.5}}
    config["shadow"] = {"operator": "ops", "refresh_s": 0.5}
    config["store"] = {"backend": "redis", "url": redis_url, "key_prefix": prefix}
    question = [{"role": "user", "content": "What is 6 times 7? Answer with a number."}]

    def learning(until, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            report = httpx.get(f"{gateway.base_url}/admin/quality", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                               timeout=10).json()["aliases"][0]["learning"]
            if until(report) or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    store = RedisStore(redis_url, prefix, 2.0, 60.0, 60.0)
    try:
        with live_gateway(config, tmp_path) as gateway:
            client = gateway.client()
            for _ in range(3):  # the cold start: every held answer is asked of the upstream afresh
                answer = client.chat.completions.create(model="routed", messages=question, max_tokens=16,
                                                        temperature=0)
                assert answer.usage.model_extra["routing"]["afresh"]
            state = learning(lambda r: r["examples"] >= 3)
            assert state["state"] == "cold_start" and state["examples"] == 3
            kept, total = asyncio.run(store.examples_read(state["key"]))
            assert total == 3 and all(len(json.loads(text)["features"]) == len(FEATURES) for text in kept)
            # a check promoted by another replica (its fit is tested above): every answer rated 0.9, the bar 0.5
            check = AnswerCheck(np.zeros(len(FEATURES)), math.log(9), np.zeros(len(FEATURES)), np.ones(len(FEATURES)),
                                {}, state["model_sha256"], {})
            bar = {"value": 0.5, "escalated_share": 0.0, "agreement": 0.9, "agreement_low": 0.85, "held_out": 30}
            promoted = PromotedState(version=1, check=check.to_json(), auc=0.9, bar=bar, promoted_at=3, fitted_at=3)
            assert asyncio.run(store.learned_swap(state["key"], promoted.text(), None))
            assert learning(lambda r: r["state"] == "settled")["version"] == 1
            answer = client.chat.completions.create(model="routed", messages=question, max_tokens=16, temperature=0)
            routing = answer.usage.model_extra["routing"]
            assert not routing["afresh"] and routing["answer_confidence"] == 0.9
            browser = Browser(chromium_binary())  # the playground shows the learning state
            try:
                browser.open(f"{gateway.base_url}/playground")
                browser.js(f"$('api-key').value = {json.dumps(ADMIN_KEY)}; $('quality').click();")
                browser.wait_for("!!document.querySelector('.quality-alias .learning')")
                line = browser.js("document.querySelector('.quality-alias .learning').textContent")
                assert line.startswith("learning: ") and "learned check v1: held-out AUC 0.9 · bar 0.5" in line, line
            finally:
                browser.close()
    finally:
        asyncio.run(store.close())


@pytest.mark.integration
def test_tune_starts_from_the_examples_a_learning_gateway_holds(redis_url, redis_prefix, tmp_path):
    import yaml

    from adapters.redis_store import RedisStore
    from fitting.tune_examples import CHECK_FILE, SNIPPET_FILE, tune_from_examples
    from gateway.shadow.learning import learning_key
    from tests.conftest import SMOL, gateway_config

    prefix = redis_prefix
    config = gateway_config(None, store={"backend": "redis", "url": redis_url, "key_prefix": prefix})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    sha = model_sha256(SMOL)
    store = RedisStore(redis_url, prefix, 2.0, 60.0, 60.0)

    async def seed() -> None:
        for example in examples(300):
            await store.examples_add(learning_key("local", sha), json.dumps(example.to_json()), "t", None, 1000)
        await store.close()

    asyncio.run(seed())
    candidate = tune_from_examples(path, "local", tmp_path / "out", target=0.8)
    assert candidate.auc > 0.8 and candidate.fitted_on + candidate.held_out == 300
    check = AnswerCheck.load(tmp_path / "out" / CHECK_FILE, sha)  # a file an alias may name
    assert check.confidence(stats(0.2)) > check.confidence(stats(2.8))
    routing = yaml.safe_load((tmp_path / "out" / SNIPPET_FILE).read_text())["local"]["routing"]
    assert routing["escalate_below"] == candidate.bar.value and candidate.bar.agreement_low >= 0.8
    with pytest.raises(ValueError, match="too few"):  # an alias that has learned nothing yet
        tune_from_examples(_other_alias(path, tmp_path), "other", tmp_path / "none", target=0.8)


def _other_alias(path, tmp_path):
    """`path`'s config with a second alias that has no examples."""
    import yaml

    config = yaml.safe_load(path.read_text())
    config["aliases"]["other"] = dict(config["aliases"]["local"])
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(config))
    return other
