"""Legacy text completions (/v1/completions) against a live gateway whose upstream is a real
llama-server in tokens mode, driven by the openai SDK: raw prompts continued as plain text on the
token-level path, hand-offs that continue the same raw text, echo, stop, n, logprobs, streaming,
token-id prompts, and the refusals."""

from __future__ import annotations

import openai
import pytest
from llama_cpp import Llama

pytestmark = pytest.mark.integration

PROMPT = "The three primary colors are"


@pytest.fixture
def client(tokens_client: openai.OpenAI) -> openai.OpenAI:
    return tokens_client


def complete(client, policy: str = "never", **fields):
    fields = {"model": "routed", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    return client.completions.create(**fields, extra_body={"routing": {"policy": policy}})


def test_hand_offs_continue_the_raw_text(client):
    local = complete(client)
    assert local.object == "text_completion" and local.id.startswith("cmpl-") and local.choices[0].text
    assert local.usage.model_extra["routing"]["upstream_tokens"] == 0
    first = complete(client, policy="always", max_tokens=1).usage
    # one hand-off of the empty answer: the upstream (same tokenizer) was sent exactly the prompt's
    # tokens, as raw text; a chat template around it would add its turn markers
    assert first.model_extra["routing"]["upstream_calls"] == 1
    assert first.model_extra["routing"]["upstream_prompt_tokens"] == first.prompt_tokens
    handed = complete(client, policy="always").usage.model_extra["routing"]
    assert handed["upstream_tokens"] > 1 and handed["local_tokens"] == 0


def test_echo_stop_and_n(client):
    answer = complete(client, echo=True, stop=[","], n=2, max_tokens=24)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.text.startswith(PROMPT) and "," not in choice.text[len(PROMPT):]
        assert choice.finish_reason in ("stop", "length")


def test_logprobs_are_the_legacy_object(client):
    answer = complete(client, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_a_stream_carries_text_logprobs_and_usage(client):
    chunks = list(client.completions.create(model="routed", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            logprobs=1, echo=False, stream_options={"include_usage": True},
                                            extra_body={"routing": {"policy": "never"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert text and "".join(tokens) == text
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]  # offsets run across chunks
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_token_id_prompts_and_batches(client, smol_path):
    ids = Llama(str(smol_path), vocab_only=True, verbose=False).tokenize(PROMPT.encode(), add_bos=False)
    by_ids = complete(client, prompt=ids, max_tokens=4)
    assert by_ids.choices[0].text and by_ids.usage.prompt_tokens == complete(client, max_tokens=4).usage.prompt_tokens
    batch = complete(client, prompt=[PROMPT, "Two plus two is"], max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text != batch.choices[1].text
    assert batch.usage.prompt_tokens == by_ids.usage.prompt_tokens + complete(
        client, prompt="Two plus two is", max_tokens=4).usage.prompt_tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "."}, "suffix"), ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": [10**6]}, "prompt"),
    ({"best_of": 3}, "best_of"), ({"model": "nope"}, "model"), ({"n": 9}, "n"), ({"prompt": ["", "Hi"]}, "prompt"),
    ({"max_tokens": 100_000}, "max_tokens"),
])
def test_refusals_name_the_field(client, fields, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        complete(client, **fields)
    assert caught.value.body["param"] == param
