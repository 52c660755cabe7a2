"""One gateway (local-only) serves as the chat-continuation upstream of another."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import DEMO_KEY, gateway_config, live_gateway
from tests.test_local_model import NEAR_TIE

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Write a haiku about the sea."}]


def test_gateway_continues_another_gateways_partial_answers(tmp_path):
    with live_gateway(gateway_config(None), tmp_path) as inner:
        outer_config = gateway_config(None)
        outer_config["upstreams"]["inner"] = {
            "model": "openai/local", "api_base": f"{inner.base_url}/v1", "api_key_env": "TEST_DEMO_KEY",
            "mode": "chat_continue", "timeout_s": 20, "retries": 0,
        }
        outer_config["aliases"]["chained"] = {"local": "smol", "upstream": "inner",
                                              "routing": {"policy": "always", "span": 4}}
        with live_gateway(outer_config, tmp_path) as outer:
            direct = openai.OpenAI(base_url=f"{inner.base_url}/v1", api_key=DEMO_KEY, max_retries=0)
            chained = openai.OpenAI(base_url=f"{outer.base_url}/v1", api_key=DEMO_KEY, max_retries=0)
            expected = direct.chat.completions.create(model="local", messages=QUESTION, max_tokens=20, temperature=0,
                                                      logprobs=True, top_logprobs=2)
            answer = chained.chat.completions.create(model="chained", messages=QUESTION, max_tokens=20, temperature=0)
    routing = answer.usage.model_extra["routing"]
    assert routing["degraded"] == [] and routing["local_tokens"] == 0
    assert routing["upstream_calls"] >= -(-answer.usage.completion_tokens // 4) >= 3  # 4 tokens a hand-off
    assert routing["upstream_prompt_tokens"] > routing["upstream_completion_tokens"] > 0
    # the inner gateway continued each partial answer instead of starting a new turn: the same text,
    # but where a continuation's prefill rounded a near-tie the other way than decoding did
    assert_same_up_to_a_near_tie(answer.choices[0].message.content, expected.choices[0])


def assert_same_up_to_a_near_tie(text: str, reference) -> None:
    """`text` is `reference`'s answer, or leaves it at a token whose top two were under NEAR_TIE apart."""
    if text == reference.message.content:
        return
    before = ""
    for entry in reference.logprobs.content:
        if not text.startswith(before + entry.token):
            assert len(text) > len(before), f"{text!r} stops inside {reference.message.content!r}"
            top, runner_up = entry.top_logprobs[:2]
            assert top.logprob - runner_up.logprob < NEAR_TIE, f"{text!r} left {reference.message.content!r}"
            return
        before += entry.token
    raise AssertionError(f"{text!r} goes on after {reference.message.content!r}")


def test_client_disconnect_stops_decoding_and_upstream_calls(tmp_path):
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}
    with live_gateway(gateway_config(None), tmp_path) as inner:
        outer_config = gateway_config(None)
        outer_config["upstreams"]["inner"] = {
            "model": "openai/local", "api_base": f"{inner.base_url}/v1", "api_key_env": "TEST_DEMO_KEY",
            "mode": "chat_continue", "timeout_s": 20, "retries": 0,
        }
        outer_config["aliases"]["chained"] = {"local": "smol", "upstream": "inner", "routing": {"policy": "always"}}
        with live_gateway(outer_config, tmp_path) as outer:
            def inner_requests() -> int:
                return httpx.get(f"{inner.base_url}/v1/usage", headers=headers).json()["windows"][0]["requests"]

            body = {"model": "chained", "messages": QUESTION, "max_tokens": 200, "temperature": 0.8, "seed": 3,
                    "stream": True}
            with httpx.stream("POST", f"{outer.base_url}/v1/chat/completions", json=body, headers=headers,
                              timeout=60) as response:
                seen = 0
                for line in response.iter_lines():
                    seen += line.startswith("data: ") and '"content"' in line
                    if seen >= 4:
                        break  # leaving the block closes the connection mid-stream
            time.sleep(1.5)
            settled = inner_requests()
            time.sleep(2.0)
            assert inner_requests() == settled < 30, "upstream calls must stop when the client leaves"
            usage = httpx.get(f"{outer.base_url}/v1/usage", headers=headers).json()["windows"][0]
            assert usage["upstream_prompt_tokens"] > 0  # what was spent before the disconnect is on the ledger
            quick = httpx.post(f"{outer.base_url}/v1/chat/completions", headers=headers, timeout=30,
                               json={"model": "local", "messages": QUESTION, "max_tokens": 2})
            assert quick.status_code == 200  # the local model was released
