"""The routing rules RoutingSettings hands out whole (gateway/settings/routing_values.py), and how a
request's decoding holds them."""

from __future__ import annotations

import dataclasses

from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.signals import Sampling
from gateway.decoding.values import DecodeRequest, RequestRouting
from gateway.settings import RoutingSettings
from gateway.settings.routing_values import AnswerReview, CeilingRule, HandoffRule, PolicyRule
from policies import build_policy
from policies.agreement import AgreementCheck
from tests.fakes import FakeUpstream


def test_each_rule_reads_the_settings_fields_of_its_own_names():
    routing = RoutingSettings(policy="entropy", threshold=1.5, span=4, span_until="word", max_cost_ratio=2.0,
                              on_ceiling="escalate", answer_value=3.0, early_escalation=False, max_upstream_calls=9)
    assert routing.handoffs == HandoffRule(span=4, span_until="word")
    assert routing.ceiling == CeilingRule(max_cost_ratio=2.0, on_ceiling="escalate")
    assert routing.policy_rule == PolicyRule(threshold=1.5, max_upstream_calls=9, answer_value=3.0,
                                             early_escalation=False)
    for rule in (HandoffRule, CeilingRule, PolicyRule):  # a renamed settings field cannot leave a rule behind
        assert {f.name for f in dataclasses.fields(rule)} <= set(RoutingSettings.model_fields)


def test_the_review_rates_with_the_agreement_check_asked_for_else_the_alias_file():
    fitted = object()  # the alias's check file, as loaded
    plain = RoutingSettings(policy="never", escalation="continue")
    assert plain.review(fitted, held=False) == AnswerReview(fitted, None, "continue", False)
    agreeing = RoutingSettings(policy="never", answer_check={"kind": "agreement", "samples": 3, "answer": "majority"},
                               escalate_below=0)  # 0: never asked afresh, as null
    review = agreeing.review(fitted, held=True)
    assert review == AnswerReview(AgreementCheck(samples=3, answer="majority"), None, "continue", True)


def test_a_local_sample_replaces_the_routing_whole_and_keeps_the_prompt_and_limits():
    upstream = FakeUpstream("")
    routed = RequestRouting(build_policy("always"), HandoffRule(8, "line"),
                            CostCeiling(CeilingRule(1.0, "escalate"), upstream.prices, 0),
                            AnswerReview(AgreementCheck(), 0.5, "afresh", held=True))
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=9, routing=routed, stop=("\n",),
                            seed=3, logprobs=2, choice=1)
    sample = request.local_sample(Sampling(0.7), seed=10)
    assert sample.routing.policy.name == "never" and not sample.routing.policy.routes
    assert (sample.routing.handoffs, sample.routing.ceiling, sample.routing.review) == (HandoffRule(), None,
                                                                                      AnswerReview())
    assert sample.logprobs is None and sample.sampling == Sampling(0.7) and sample.seed == 10
    assert (sample.messages, sample.max_tokens, sample.stop, sample.choice) == (request.messages, 9, ("\n",), 1)
    assert request.routing is routed  # the request itself is unchanged
