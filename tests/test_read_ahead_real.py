"""chat_fallback reading ahead through the OpenAI API: the real local model, a real llama-server
reached as a chat-only provider, every step routed."""

from __future__ import annotations

import pytest

from tests.conftest import gateway_config, live_gateway

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def chat_fallback(smol_llama_server, tmp_path_factory):
    config = gateway_config(smol_llama_server, mode="chat_fallback")
    config["upstreams"]["up"]["model"] = "openai/up"
    config["aliases"]["routed"]["routing"] = {"policy": "always"}
    with live_gateway(config, tmp_path_factory.mktemp("read-ahead")) as gw:
        yield gw.client()


def ask(client) -> tuple[str, dict]:
    response = client.chat.completions.create(model="routed", messages=QUESTION, max_tokens=24, temperature=0)
    text, usage = response.choices[0].message.content, response.usage.model_extra["routing"]
    assert text and "\ufffd" not in text, text  # whole characters, something written
    return text, usage


def test_routed_steps_take_what_a_call_read_ahead_and_a_like_request_repeats_the_answer(chat_fallback):
    """Every step is routed: a call writes its step and reads 8 tokens ahead, which the next steps
    take with no call (SmolLM2 seldom repeats the answer's end as asked, so its later replies add
    nothing and those steps are local). The continuation cache keeps what was read ahead with its
    step: the same request again writes the same answer with no call."""
    text, usage = ask(chat_fallback)
    routed, written = sum(usage["combined"].values()), usage["upstream_tokens"] + usage["cache_tokens"]
    assert usage["cache_tokens"] > 0 and 0 < usage["upstream_calls"] < routed, usage
    again, cached = ask(chat_fallback)
    assert again == text and cached["upstream_calls"] == 0 and cached["cache_tokens"] == written, cached
