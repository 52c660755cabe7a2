"""Asking afresh: the answer check's file and rating, the decoder throwing a held answer away for
the upstream's, what it does when it cannot, and the evaluation's derived records."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from fitting.afresh import derived, fit
from fitting.configs import parse_config
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.settings.routing_values import AnswerReview, CeilingRule
from gateway.tenancy.budget import HandoffGate, Ledger
from policies import Signal, build_policy
from policies.answer_check import FEATURES, AnswerCheck, AnswerStats
from policies.learned import RouterError
from tests.fakes import FakeLocalModel, FakeUpstream

VOCAB = ["Paris", " is", " nice", " big", *sorted(set("Paris is nice big."))]
SHA = "a" * 64


def constant(confidence: float) -> AnswerCheck:
    """A check that rates every answer `confidence` (no weights, the bias alone)."""
    bias = float(np.log(confidence / (1 - confidence)))
    zeros, ones = np.zeros(len(FEATURES)), np.ones(len(FEATURES))
    return AnswerCheck(zeros, bias, zeros, ones, {}, SHA, {})


def decoding(check: AnswerCheck | None, below: float | None, held: bool = True, upstream: FakeUpstream | None = None,
             policy: str = "never", limits: Limits = Limits(), ceiling: CostCeiling | None = None,
             store: MemoryStore | None = None, local: FakeLocalModel | None = None, **policy_kw) -> Decoding:
    local = local or FakeLocalModel(VOCAB, "Paris is nice.")
    upstream = upstream or FakeUpstream("Paris is big.", chars_per_token=20)
    gate = HandoffGate(Ledger(store or MemoryStore()), "t", limits, allowed=True)
    routing = RequestRouting(build_policy(policy, **policy_kw), ceiling=ceiling,
                             review=AnswerReview(check, escalate_below=below, held=held))
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=20, routing=routing)
    return Decoding(local, upstream, gate, request)


async def text_of(run: Decoding) -> str:
    return "".join([piece.text async for piece in run.pieces()])


async def test_a_held_answer_rated_below_the_bar_is_replaced_by_the_upstreams():
    run = decoding(constant(0.3), below=0.5)
    assert await text_of(run) == "Paris is big."
    usage = run.usage
    assert usage.afresh and usage.escalated and usage.answer_confidence == 0.3
    assert usage.discarded_tokens == 4 and usage.upstream_calls == 1
    assert run.source_counts() == {"local": 0, "upstream": 4, "cache": 0} and run.finish_reason == "stop"
    assert run.upstream.calls[0].answer == ""  # asked the prompt alone, as if directly


@pytest.mark.parametrize(("confidence", "below", "held"), [(0.7, 0.5, True), (0.3, None, True), (0.3, 0.5, False)])
async def test_the_local_answer_stands_when_rated_well_unasked_or_already_shown(confidence, below, held):
    run = decoding(constant(confidence), below=below, held=held)
    assert await text_of(run) == "Paris is nice."
    assert not run.usage.afresh and run.usage.upstream_calls == 0
    assert run.usage.answer_confidence == confidence  # rated all the same


def by_length(at_tokens: int) -> AnswerCheck:
    """A check rating an answer of n tokens sigmoid(log1p(n) - 2), read after `at_tokens` tokens."""
    weights, zeros, ones = np.zeros(len(FEATURES)), np.zeros(len(FEATURES)), np.ones(len(FEATURES))
    weights[FEATURES.index("log_answer_tokens")] = 1.0
    return AnswerCheck(weights, -2.0, zeros, ones, {}, SHA, {}, at_tokens)


def rated_at(tokens: int) -> float:
    return round(1 / (1 + math.exp(-(math.log1p(tokens) - 2.0))), 4)


async def test_a_check_with_at_tokens_asks_afresh_before_the_local_answer_is_finished():
    run = decoding(by_length(2), below=0.5)
    assert await text_of(run) == "Paris is big."
    assert run.usage.answer_confidence == rated_at(2) < 0.5
    assert run.usage.afresh and run.usage.discarded_tokens == 2  # "Paris is", not the whole "Paris is nice."


async def test_an_early_rating_that_stands_lets_the_answer_finish_and_an_answer_shorter_than_k_is_rated_at_its_end():
    early = decoding(by_length(2), below=0.2)
    assert await text_of(early) == "Paris is nice." and early.usage.answer_confidence == rated_at(2) >= 0.2
    late = decoding(by_length(10), below=0.2)
    assert await text_of(late) == "Paris is nice." and late.usage.answer_confidence == rated_at(4)
    assert not early.usage.afresh and not late.usage.afresh


async def test_a_failed_fresh_call_leaves_the_local_answer_and_says_so():
    run = decoding(constant(0.3), below=0.5, upstream=FakeUpstream("Paris is big.", fail=True))
    assert await text_of(run) == "Paris is nice."
    assert not run.usage.afresh and run.usage.degraded == ["upstream_unavailable"]


async def test_a_budget_that_cannot_cover_the_fresh_call_leaves_the_local_answer():
    store = MemoryStore()
    run = decoding(constant(0.3), below=0.5, limits=Limits(day_tokens=5), store=store)
    assert await text_of(run) == "Paris is nice."
    assert not run.usage.afresh and "budget_exhausted" in run.usage.degraded
    assert (await store.usage("t", time.time()))[0].upstream_prompt_tokens == 0


async def test_the_cost_ceiling_holds_for_the_fresh_call():
    upstream = FakeUpstream("Paris is big.", chars_per_token=1)
    # hand-offs of every token spend the answer's allowance first: no room is left to ask afresh
    run = decoding(constant(0.3), below=0.5, upstream=upstream, policy="always",
                   ceiling=CostCeiling(CeilingRule(1.0), upstream.prices, 10))
    await text_of(run)
    assert not run.usage.afresh and "cost_ceiling" in run.usage.degraded
    assert run.request.routing.ceiling.spent_usd <= run.request.routing.ceiling.direct_usd() + 1e-12


async def test_an_answer_the_upstream_finished_by_escalating_is_not_asked_afresh_again():
    upstream = FakeUpstream("Paris is big.", chars_per_token=1)
    unsure = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset(range(20)))
    run = decoding(constant(0.3), below=0.5, upstream=upstream, policy="always", local=unsure,
                   ceiling=CostCeiling(CeilingRule(), upstream.prices, 0), answer_value=1000.0)
    assert await text_of(run) == "Paris is big."
    assert run.usage.escalated and not run.usage.afresh and run.usage.answer_confidence is None
    assert all(call.answer for call in upstream.calls[1:])  # each call continued the answer; none began anew


async def test_an_answer_replaced_by_a_fresh_escalation_is_not_rated_with_the_discarded_ones_signals():
    upstream = FakeUpstream("Paris is big.", chars_per_token=1)
    unsure = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset(range(20)), lean=2.0)
    routing = RequestRouting(build_policy("always", answer_value=1000.0),
                             ceiling=CostCeiling(CeilingRule(), upstream.prices, 0),
                             review=AnswerReview(constant(0.3), escalate_below=0.5, escalation="afresh", held=True))
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=20, routing=routing)
    run = Decoding(unsure, upstream, HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
    pieces = [piece async for piece in run.pieces()]
    assert "".join(p.text for p in pieces) == "Paris is big." and [p.source for p in pieces if p.tokens] == ["upstream"]
    assert run.usage.afresh and run.usage.answer_confidence is None and len(upstream.calls) == 4


def test_stats_of_signals_match_those_an_evaluation_record_keeps():
    signals = [Signal(entropy=e, top1=t, margin=0.0, position=i) for i, (e, t) in enumerate([(0.5, 0.75), (1.5, 0.25)])]
    stats = AnswerStats.of(signals, 2, "length")
    record = {"mean_entropy": 1.0, "max_entropy": 1.5, "mean_top1": 0.5, "first_entropy": 0.5, "answer_tokens": 2,
              "finish_reason": "length"}
    assert stats == AnswerStats.of_record(record)
    assert stats.features().tolist() == pytest.approx([1.0, 1.5, 0.5, 0.5, np.log(3), 1.0])


def records(n: int, seed: int = 0) -> list[dict]:
    """Local answers that are right when their mean entropy is low, give or take some noise."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        entropy = rng.uniform(0, 2)
        out.append({"id": f"q{i}", "row": i, "correct": bool(entropy + rng.normal(0, 0.3) < 1.0),
                    "mean_entropy": entropy, "max_entropy": entropy * 3, "mean_top1": 1 - entropy / 3,
                    "first_entropy": rng.uniform(0, 1), "answer_tokens": int(rng.integers(50, 300)),
                    "finish_reason": "stop", "text": "local", "wall_s": 1.0, "upstream_calls": 0,
                    "upstream_prompt_tokens": 0, "upstream_completion_tokens": 0, "upstream_cost_usd": 0.0})
    return out


def test_a_fitted_check_ranks_answers_and_its_file_round_trips(tmp_path):
    fitted = fit(records(300), [0.2, 0.5], SHA, {"dataset": "synthetic"})
    rated = [(fitted.confidence(AnswerStats.of_record(r)), r["correct"]) for r in records(200, seed=1)]
    right = np.mean([c for c, ok in rated if ok])
    wrong = np.mean([c for c, ok in rated if not ok])
    assert right > wrong + 0.3
    assert 0 < fitted.shares[0.2] < fitted.shares[0.5] < 1
    path = tmp_path / "check.json"
    path.write_text(json.dumps(fitted.to_json()))
    loaded = AnswerCheck.load(path, SHA)
    assert loaded.confidence(AnswerStats.of_record(records(1)[0])) == fitted.confidence(AnswerStats.of_record(records(1)[0]))
    assert loaded.meta["fit_answers"] == 300 and loaded.at_tokens is None
    path.write_text(json.dumps(by_length(128).to_json()))
    assert AnswerCheck.load(path, SHA).at_tokens == 128


@pytest.mark.parametrize("change", [{"model_sha256": "b" * 64}, {"format": "other"}, {"features": ["x"]},
                                    {"weights": [1.0]}, {"scale": [0.0] * len(FEATURES)}, {"at_tokens": 0},
                                    {"at_tokens": 1.5}, {"at_tokens": True}])
def test_a_check_file_for_another_model_or_of_another_shape_is_refused(tmp_path, change):
    path = tmp_path / "check.json"
    path.write_text(json.dumps({**constant(0.5).to_json(), **change}))
    with pytest.raises(RouterError):
        AnswerCheck.load(path, SHA)


def test_derived_records_take_the_upstreams_answer_below_the_bar_and_bill_both():
    local = records(40)
    for record in local:
        record["upstream_calls"], record["upstream_cost_usd"] = 2, 0.5  # a routed base's hand-offs
    upstream = [{**r, "text": "upstream", "correct": True, "upstream_calls": 1, "upstream_cost_usd": 1.0,
                 "wall_s": 2.0} for r in local]
    check = fit(local, [0.5], SHA, {})
    out = derived(local, upstream, check, check.shares[0.5], "local,afresh=x")
    asked = [r for r in out if r["afresh"]]
    assert 15 <= len(asked) <= 25 and all(r["text"] == "upstream" for r in asked)
    assert all(r["upstream_calls"] == 3 and r["upstream_cost_usd"] == 1.5 and r["wall_s"] == 3.0 for r in asked)
    assert all(r["text"] == "local" and r["upstream_calls"] == 2 for r in out if not r["afresh"])
    assert max(r["answer_confidence"] for r in asked) < min(r["answer_confidence"] for r in out if not r["afresh"])


def test_derived_records_of_an_early_check_discard_only_the_rated_tokens_and_their_share_of_the_time():
    local = [{**r, "answer_tokens": 200, "wall_s": 10.0} for r in records(4)]
    upstream = [{**r, "text": "upstream", "wall_s": 2.0} for r in local]
    early = {r["id"]: dataclasses.replace(AnswerStats.of_record(r), answer_tokens=50) for r in local}
    out = derived(local, upstream, by_length(50), 0.9, "local,afresh=0.9", early)
    assert all(r["afresh"] and r["discarded_tokens"] == 50 and r["wall_s"] == 2.0 + 10.0 * 50 / 200 for r in out)
    assert {r["answer_confidence"] for r in out} == {rated_at(50)}  # rated on the 50 tokens, not the 200


def test_afresh_configs_parse_and_bad_ones_are_refused():
    local = parse_config("local,afresh=0.3")
    assert local.policy == "never" and local.escalate_below == 0.3 and local.uses_upstream and local.family == "afresh"
    routed = parse_config("learned@0.05,afresh=0.25")
    assert routed.policy == "learned" and routed.escalate_below == 0.25
    for bad in ("local,afresh=2", "local,span=3", "upstream,afresh=0.3", "local,agree=1", "local,agree=x"):
        with pytest.raises(ValueError):
            parse_config(bad)
    agreed = parse_config("local,agree=4,afresh=0.5")
    assert (agreed.agree, agreed.escalate_below, agreed.family) == (4, 0.5, "afresh")
    assert parse_config("local,agree=3").family == "agree" and not parse_config("local,agree=3").uses_upstream


def test_derived_records_of_the_agreement_check_read_each_answers_own_agreement():
    local = [{**r, "agreement": a} for r, a in zip(records(4), (0.0, 0.3333, 0.6667, 1.0))]
    upstream = [{**r, "text": "upstream"} for r in local]
    out = derived(local, upstream, None, 0.5, "local,agree=4,afresh=0.5")
    assert [r["afresh"] for r in out] == [True, True, False, False]
    assert [r["answer_confidence"] for r in out] == [0.0, 0.3333, 0.6667, 1.0]


def test_eval_afresh_by_agreement_writes_each_threshold_and_says_how_agreement_ranks(tmp_path, capsys):
    from eval.__main__ import main
    from fitting.records import read_records, records_path, write_records

    agreements = (0.0, 0.0, 0.3333, 1.0)
    local = [{**r, "agreement": a, "correct": a == 1.0} for r, a in zip(records(4), agreements)]
    write_records(records_path(tmp_path / "run", "gsm8k", "local,agree=4"), local)
    write_records(records_path(tmp_path / "run", "gsm8k", "upstream"), [{**r, "correct": True} for r in local])
    assert main(["afresh", "--dataset", "gsm8k", "--run-name", "run", "--runs-dir", str(tmp_path),
                 "--base", "local,agree=4", "--check", "agreement", "--below", "0.5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:3] == ["agreement 0: 0 of 2 answers correct", "agreement 0.3333: 0 of 1 answers correct",
                           "agreement 1: 1 of 1 answers correct"]
    written = read_records(records_path(tmp_path / "run", "gsm8k", "local,agree=4,afresh=0.5"))
    assert [r["afresh"] for r in written] == [True, True, True, False] and all(r["correct"] for r in written)


# -- against a live gateway whose upstream is a real llama-server (tokens mode) --

@pytest.fixture(scope="module")
def checked(smol_llama_server, tmp_path_factory):
    """A gateway whose alias `checked` (local only, an upstream for fresh answers) rates every answer 0.5."""
    from adapters.model_files import model_sha256
    from tests.conftest import SMOL, gateway_config, live_gateway

    tmp = tmp_path_factory.mktemp("afresh")
    path = tmp / "check.json"
    path.write_text(json.dumps({**constant(0.5).to_json(), "model_sha256": model_sha256(SMOL)}))
    config = gateway_config(smol_llama_server, mode="tokens")
    config["aliases"]["checked"] = {"local": "smol", "upstream": "up",
                                    "routing": {"policy": "never", "answer_check": str(path)}}
    with live_gateway(config, tmp) as running:
        yield running


def chat(client, content: str, model: str = "checked", **kw):
    routing = kw.pop("routing", {})
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=24,
                                          temperature=0, extra_body={"routing": routing}, **kw)


@pytest.mark.integration
def test_a_held_answer_below_the_bar_is_the_upstreams_direct_answer(checked):
    import httpx

    from tests.conftest import ADMIN_KEY

    client = checked.client()
    raw = client.chat.completions.with_raw_response.create(
        model="checked", messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=24, temperature=0,
        extra_body={"routing": {"escalate_below": 0.6}})
    fresh = raw.parse()
    assert "afresh=1" in raw.headers["x-routing-summary"]
    routing = fresh.usage.model_extra["routing"]
    assert routing["afresh"] == 1 and routing["answer_confidence"] == 0.5 and routing["discarded_tokens"] > 0
    assert routing["local_tokens"] == 0 and routing["upstream_calls"] == 1
    direct = chat(client, "Name three rivers.", model="routed", routing={"policy": "always", "span": 24})
    assert fresh.choices[0].message.content == direct.choices[0].message.content != ""
    metrics = httpx.get(f"{checked.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert 'gateway_afresh_answers_total{alias="checked"} 1.0' in metrics


@pytest.mark.integration
def test_streamed_answers_are_rated_but_never_asked_afresh(checked):
    stream = chat(checked.client(), "Name three lakes.", routing={"escalate_below": 0.6}, stream=True,
                  stream_options={"include_usage": True})
    routing = list(stream)[-1].usage.model_extra["routing"]
    assert routing["afresh"] == 0 and routing["answer_confidence"] == 0.5 and routing["local_tokens"] > 0


@pytest.mark.integration
def test_each_choice_and_a_legacy_completion_are_checked_on_their_own(checked):
    client = checked.client()
    both = chat(client, "Name three seas.", routing={"escalate_below": 0.6}, n=2).usage.model_extra["routing"]
    assert both["afresh"] == 2 and both["answer_confidence"] == [0.5, 0.5] and both["local_tokens"] == 0
    kept = chat(client, "Name three seas.", routing={"escalate_below": 0.4}).usage.model_extra["routing"]
    assert kept["afresh"] == 0 and kept["upstream_calls"] == 0 and kept["local_tokens"] > 0
    legacy = client.completions.create(model="checked", prompt="Three seas:", max_tokens=12, temperature=0,
                                       extra_body={"routing": {"escalate_below": 0.6}})
    assert legacy.usage.model_extra["routing"]["afresh"] == 1


@pytest.mark.integration
@pytest.mark.parametrize(("model", "below"), [("routed", 0.5), ("checked", 1.5)])
def test_escalate_below_without_a_check_or_out_of_range_is_a_400_naming_it(checked, model, below):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(checked.client(), "Hi", model=model, routing={"escalate_below": below})
    assert caught.value.body["param"] == "routing.escalate_below"


def test_rows_with_a_step_select_every_other_row_for_disjoint_fit_and_report_halves():
    from fitting.datasets import parse_rows
    from fitting.records import in_rows

    rows = [{"row": i} for i in range(10)]
    assert [r["row"] for r in in_rows(rows, parse_rows("0:10:2"))] == [0, 2, 4, 6, 8]
    assert [r["row"] for r in in_rows(rows, parse_rows("1::2"))] == [1, 3, 5, 7, 9]
    assert [r["row"] for r in in_rows(rows, parse_rows("3:6"))] == [3, 4, 5]


def test_the_reliability_table_bins_answers_by_confidence_in_equal_counts():
    from fitting.analysis import reliability

    confidences = np.array([0.9, 0.1, 0.8, 0.2, 0.85, 0.15])
    labels = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    low, high = reliability(confidences, labels, bins=2)
    assert low == (0.1, 0.2, 3, pytest.approx(0.15), pytest.approx(1 / 3))
    assert high == (0.8, 0.9, 3, pytest.approx(0.85), pytest.approx(2 / 3))


def test_every_shipped_router_and_check_loads_for_the_reference_local_model():
    from pathlib import Path

    from adapters.model_files import model_sha256
    from policies.learned import Router

    sha = model_sha256("qwen2.5-coder-0.5b-instruct")
    files = sorted((Path(__file__).resolve().parent.parent / "routers").glob("*.json"))
    checks = [f for f in files if "answer-check" in f.name]
    assert checks and len(files) > len(checks)
    for path in files:
        loaded = AnswerCheck.load(path, sha) if path in checks else Router.load(path, sha)
        assert loaded.model_sha256 == sha


def test_an_early_rating_aggregates_only_the_first_k_steps():
    from fitting.afresh import prefix_stats

    analysis = {"n": 4, "entropy": [2.0, 0.5, 0.1, 3.0], "top1": [0.2, 0.8, 0.9, 0.1]}
    cut = {"finish_reason": "length"}
    early = prefix_stats(analysis, cut, 2)
    assert (early.mean_entropy, early.max_entropy, early.mean_top1) == (1.25, 2.0, pytest.approx(0.5))
    assert early.first_entropy == 2.0 and early.answer_tokens == 2 and not early.cut_by_length  # still going
    whole = prefix_stats(analysis, cut, 8)  # shorter than k: rated at its end, as the check rates it
    assert whole == prefix_stats(analysis, cut, None) and whole.answer_tokens == 4 and whole.cut_by_length
    assert whole.max_entropy == 3.0


async def test_an_answer_asked_afresh_and_cut_at_the_limit_bills_no_end_token_in_asking_directly():
    upstream = FakeUpstream("Paris is big. " * 40, chars_per_token=20)
    # the local answer ends on its end token, the fresh one at the limit
    ceiling = CostCeiling(CeilingRule(), upstream.prices, 10)
    run = decoding(constant(0.3), below=0.5, upstream=upstream, ceiling=ceiling)
    await text_of(run)
    assert run.usage.afresh and run.finish_reason == "length"
    assert ceiling.answered == {0: len(run.answer_tokens)}
