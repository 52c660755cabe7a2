"""Combined routed steps through the OpenAI API: the real local model, real upstream servers over HTTP
(llama-server in tokens mode, one tokenizer family; Qwen on llama-cpp-python's server in
completions mode, another tokenizer), `usage.routing.combined` counting how each step chose."""

from __future__ import annotations

import pytest

from tests.conftest import QWEN, gateway_config, live_gateway

pytestmark = pytest.mark.integration

QUESTIONS = ["Name three colours of the rainbow.", "What do bees make?", "Why is the sky blue? One sentence.",
             "Give a word that rhymes with cat.", "What is the opposite of hot?", "Name a large animal."]


@pytest.fixture(scope="module")
def same_family(smol_llama_server, tmp_path_factory):
    with live_gateway(gateway_config(smol_llama_server, mode="tokens"), tmp_path_factory.mktemp("combine")) as gw:
        yield gw.client()


@pytest.fixture(scope="module")
def other_tokenizer(qwen_upstream, tmp_path_factory):
    config = gateway_config(qwen_upstream, template_gguf=QWEN, mode="completions")
    with live_gateway(config, tmp_path_factory.mktemp("combine-qwen")) as gw:
        yield gw.client()


def ask(client, question: str, **routing) -> tuple[str, dict]:
    response = client.chat.completions.create(
        model="routed", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0,
        extra_body={"routing": routing})
    text, usage = response.choices[0].message.content, response.usage.model_extra["routing"]
    assert text and "\ufffd" not in text, text  # whole characters, something written
    return text, usage


def test_same_family_contrastive_agrees_at_every_step_and_aligns_every_token(same_family):
    """One model on both sides: log p_up - 0.5 log p_local is half the same log p, so its argmax is
    the upstream's own token at every routed step; each aligns exactly (none falls back)."""
    _, usage = ask(same_family, QUESTIONS[0], combine="contrastive", combine_beta=0.5)
    combined = usage["combined"]
    assert usage["upstream_calls"] > 0 and set(combined) <= {"agreed", "changed"}, usage
    assert sum(combined.values()) == usage["upstream_calls"], usage
    assert combined.get("agreed", 0) >= combined.get("changed", 0)  # near-ties may flip between the two runtimes


def test_same_family_contrastive_changes_tokens_when_the_local_model_is_penalised_hard(same_family):
    """beta 10: of the plausible tokens, the one the (same) local model likes least: the rule changes
    the upstream's token wherever another one is plausible, and the answer stays well formed."""
    _, usage = ask(same_family, QUESTIONS[1], combine="contrastive", combine_beta=10, combine_alpha=0.05)
    combined = usage["combined"]
    assert combined.get("changed", 0) > 0 and "fell_back" not in combined, usage


def test_same_family_fuse_counts_every_routed_step(same_family):
    _, usage = ask(same_family, QUESTIONS[2], combine="fuse", combine_weight=0.5)
    combined = usage["combined"]
    assert sum(combined.values()) == usage["upstream_calls"] > 0 and "fell_back" not in combined, usage


def test_take_is_counted_as_taken(same_family):
    _, usage = ask(same_family, QUESTIONS[3])
    assert usage["combined"] == {"taken": usage["upstream_calls"]}, usage


def test_a_request_may_not_combine_on_an_upstream_without_alternatives(smol_llama_server, tmp_path_factory):
    config = gateway_config(smol_llama_server, mode="chat_fallback")
    config["upstreams"]["up"]["model"] = "openai/up"
    with live_gateway(config, tmp_path_factory.mktemp("combine-chat")) as gw:
        client = gw.client()
        with pytest.raises(Exception) as refused:
            ask(client, QUESTIONS[4], combine="fuse")
        assert getattr(refused.value, "status_code", None) == 400 and "routing.combine" in str(refused.value)


def test_other_tokenizer_fuse_and_contrastive_serve_with_text_alignment(other_tokenizer):
    """SmolLM2 local, Qwen upstream: alternatives align by their text; the counts cover every routed step."""
    for question, routing in zip(QUESTIONS[4:], ({"combine": "fuse"}, {"combine": "contrastive"})):
        _, usage = ask(other_tokenizer, question, **routing)
        combined = usage["combined"]
        assert usage["upstream_calls"] > 0 and sum(combined.values()) == usage["upstream_calls"], usage
        assert set(combined) <= {"agreed", "changed", "fell_back"}
