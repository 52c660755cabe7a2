"""The cost ceiling and price-aware routing against a live gateway whose upstream is a real
llama-server (tokens mode, priced in the config): an answer's hand-offs bill at most
`max_cost_ratio` times asking the upstream directly, escalation hands the rest over in one call,
price-aware routing skips hand-offs not worth their price, and bad values are a 400."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "List five fruits, one per line."}]


@pytest.fixture
def client(tokens_client: openai.OpenAI) -> openai.OpenAI:
    return tokens_client


def routed(client, n: int = 1, **routing) -> dict:
    # sampled, so that every hand-off is a call (the continuation cache serves greedy ones for free)
    answer = client.chat.completions.create(model="routed", messages=ASK, max_tokens=24, temperature=0.7, seed=7, n=n,
                                            extra_body={"routing": {"policy": "always", **routing}})
    return answer.usage.model_extra["routing"]


def test_every_token_upstream_costs_more_than_asking_directly(client):
    uncapped = routed(client)  # a call per token re-bills the prompt each time
    assert uncapped["cost_ratio"] > 3 and uncapped["upstream_calls"] > 3 and not uncapped["escalated"]
    # predicted before each call from the prices and the request's own prefix, which llama-server reuses
    assert 0.5 < uncapped["upstream_cost_usd"] / uncapped["upstream_predicted_cost_usd"] < 2


def test_an_answer_the_upstream_writes_in_one_call_costs_what_asking_directly_does(client):
    # greedy: a sampled list ran past 64 tokens on one CPU and ended 'length', where no end token is billed
    answer = client.chat.completions.create(model="routed", messages=ASK, max_tokens=64, temperature=0,
                                            extra_body={"routing": {"policy": "always", "span": 64}})
    routing = answer.usage.model_extra["routing"]
    assert answer.choices[0].finish_reason == "stop" and routing["upstream_calls"] == 1
    assert routing["cost_ratio"] == 1.0  # its end-of-turn token is billed either way


@pytest.mark.parametrize(("n", "span"), [(1, 1), (2, 1), (1, 4)])
def test_a_ceiling_of_one_never_bills_more_than_asking_directly(client, n, span):
    capped = routed(client, n=n, max_cost_ratio=1.0, span=span)
    assert 0 < capped["cost_ratio"] <= 1.0 and "cost_ceiling" in capped["degraded"]
    assert capped["local_tokens"] > 0 and capped["upstream_calls"] >= 1


def test_escalation_hands_the_rest_to_the_upstream_once(tokens_gateway, client):
    escalated = routed(client, max_cost_ratio=1.0, on_ceiling="escalate")
    assert escalated["escalated"] and escalated["local_tokens"] == 0
    assert escalated["upstream_calls"] == 2  # the first hand-off, then the rest in one call
    metrics = httpx.get(f"{tokens_gateway.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert 'gateway_escalated_requests_total{alias="routed"}' in metrics
    assert 'gateway_cost_ratio_count{alias="routed"}' in metrics
    assert 'gateway_handoff_cost_prediction_count{alias="routed"}' in metrics
    assert 'gateway_degraded_requests_total{alias="routed",reason="cost_ceiling"}' in metrics


def test_price_aware_routing_escalates_a_costly_run_of_hand_offs_and_skips_unworthy_ones(tokens_gateway, client):
    # this upstream bills every prompt token at the input price (no cached price is configured), so
    # a call per token soon costs more than the upstream writing the rest in one call
    escalated = routed(client, answer_value=1000)
    assert escalated["escalated"] and escalated["local_tokens"] == 0 and escalated["price_vetoes"] == 0
    assert escalated["upstream_calls"] == 4  # three one-token hand-offs set the running rate, then the rest
    fresh = routed(client, answer_value=1000, escalation="afresh")  # held (not streamed): asked anew instead
    assert fresh["escalated"] and fresh["afresh"] and fresh["discarded_tokens"] == 3 and fresh["local_tokens"] == 0
    assert fresh["upstream_calls"] == 4
    drafted = routed(client, answer_value=1000, escalation="draft")  # ... with no hand-off made before
    assert drafted["afresh"] and drafted["draft_hand_offs"] == 3 and drafted["discarded_tokens"] == 3
    assert drafted["upstream_calls"] == 1 and drafted["local_tokens"] == 0
    metrics = httpx.get(f"{tokens_gateway.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert float(re.search(r'gateway_draft_hand_offs_total\{alias="routed"\} (\S+)', metrics)[1]) >= 3
    worthless = routed(client, answer_value=1e-6)  # no step is worth a millionth of the answer's price
    assert worthless["upstream_calls"] == 0 and worthless["price_vetoes"] >= worthless["local_tokens"] > 0


@pytest.mark.parametrize(("routing", "param"), [
    ({"max_cost_ratio": 0}, "routing.max_cost_ratio"), ({"max_cost_ratio": "cheap"}, "routing.max_cost_ratio"),
    ({"on_ceiling": "panic"}, "routing.on_ceiling"), ({"answer_value": -1}, "routing.answer_value"),
    ({"early_escalation": "maybe"}, "routing.early_escalation"), ({"escalation": "restart"}, "routing.escalation"),
    ({"escalation": "draft"}, "routing.escalation"),  # a draft needs answer_value: nothing else could end it
    ({"escalation": "draft", "answer_value": 1, "max_upstream_tokens": 8}, "routing.escalation"),
])
def test_bad_values_are_a_400_naming_the_field(client, routing, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="routed", messages=ASK, max_tokens=4, extra_body={"routing": routing})
    assert caught.value.body["param"] == param
