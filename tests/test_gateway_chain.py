"""One gateway (local-only) serves as the chat-continuation upstream of another."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import DEMO_KEY, gateway_config, live_gateway

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
            expected = direct.chat.completions.create(model="local", messages=QUESTION, max_tokens=20, temperature=0)
            answer = chained.chat.completions.create(model="chained", messages=QUESTION, max_tokens=20, temperature=0)
    routing = answer.usage.model_extra["routing"]
    assert routing["degraded"] == [] and routing["local_tokens"] == 0
    assert routing["upstream_calls"] >= 5  # 20 tokens, 4 per hand-off
    assert routing["upstream_prompt_tokens"] > routing["upstream_completion_tokens"] > 0
    # the inner gateway continued each partial answer instead of starting a new turn
    assert answer.choices[0].message.content == expected.choices[0].message.content


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
