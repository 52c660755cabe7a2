"""The llama.cpp grammar over SmolLM2's real vocabulary: what it allows, masks and accepts."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from llama_cpp import Llama

from adapters.grammar import MAX_REPEAT, Grammar, GrammarUnsupported, SchemaRefused, check_schema, gbnf_for
from tests.conftest import DEMO_KEY

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
          "required": ["city", "people"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab(smol_path):
    return Llama(str(smol_path), vocab_only=True, verbose=False)


def tokens_of(vocab, text: str) -> list[int]:
    return vocab.tokenize(text.encode(), add_bos=False, special=False)


def grammar(vocab, kind="json_schema", schema=SCHEMA) -> Grammar:
    return Grammar(vocab._model.vocab, vocab.n_vocab(), gbnf_for(kind, schema))


def test_only_what_the_schema_allows_survives_the_mask(vocab):
    g = grammar(vocab)
    answer = tokens_of(vocab, '{"city": "Paris", "people": ')
    masked = g.mask(answer, np.zeros(vocab.n_vocab(), dtype=np.float32))
    allowed = [vocab.detokenize([t]).decode("utf-8", "replace") for t in np.flatnonzero(np.isfinite(masked))]
    assert allowed and all(piece[:1].isdigit() or piece[:1] in "-" for piece in allowed), allowed[:20]
    assert not g.allows(answer, tokens_of(vocab, '"')[0])


def test_a_proposed_continuation_is_accepted_up_to_the_first_break(vocab):
    g = grammar(vocab)
    start = tokens_of(vocab, '{"city": "Par')
    good, bad = tokens_of(vocab, 'is", "people": 3'), tokens_of(vocab, "}}")
    assert g.accepted(start, good + bad) == len(good)
    assert g.accepted(start, good + bad) == len(good)  # the trial leaves the state where it was


def test_the_answer_may_end_only_where_the_grammar_is_complete(vocab):
    g = grammar(vocab)
    eos = vocab.token_eos()
    assert not g.allows(tokens_of(vocab, '{"city": "Paris", "people": 3'), eos)
    done = tokens_of(vocab, '{"city": "Paris", "people": 3}')
    assert g.allows(done, eos)
    json.loads(vocab.detokenize(done))


def test_a_retokenized_answer_replays_the_state(vocab):
    g = grammar(vocab, "json_object")
    text = '{"a": [1, 2, "xyz"]'
    by_char = [t for ch in text for t in tokens_of(vocab, ch)]
    assert g.allows(tokens_of(vocab, text), tokens_of(vocab, "}")[0])
    assert g.allows(by_char, tokens_of(vocab, "}")[0])  # same bytes, other tokens: same state
    assert not g.allows(by_char, tokens_of(vocab, "{")[0])


def test_strings_refuse_raw_control_characters(vocab):
    g = grammar(vocab, schema={"type": "object", "properties": {"text": {"type": "string"}}})
    start = tokens_of(vocab, '{"text": "one')
    assert not g.allows(start, tokens_of(vocab, "\n")[0])  # JSON needs "\\n" inside a string
    assert g.allows(start, tokens_of(vocab, "\\")[0])


def test_schemas_the_converter_cannot_express_are_refused():
    with pytest.raises(GrammarUnsupported):
        gbnf_for("json_schema", {"not": {"type": "string"}})
    with pytest.raises(GrammarUnsupported):
        gbnf_for("json_schema", {"$ref": "https://example.com/remote.json"})


@pytest.mark.parametrize(("schema", "path"), [
    ({"type": "string", "maxLength": 100_000_000}, "maxLength"),
    ({"type": "string", "minLength": 1e7}, "minLength"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 100_000}, "maxItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x{0,50000}$"}}}, "properties.a.pattern"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "properties.a.$ref"),
    ({"anyOf": [{"type": "string", "maxLength": 1000}] * 11}, "anyOf[10].maxLength"),  # 11,000 in all
    ({"enum": [[]] * 5_001}, "enum[4998]"),  # the 5,001st object or list: the schema and its enum count too
])
def test_schemas_that_would_size_a_grammar_past_the_bounds_are_refused_naming_the_keyword(schema, path):
    with pytest.raises(SchemaRefused) as refused:
        check_schema(schema)
    assert refused.value.path == path
    with pytest.raises(SchemaRefused):
        gbnf_for("json_schema", schema)  # the converter never sees it


def test_schemas_within_the_bounds_pass(vocab):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": MAX_REPEAT}, "tags": {"type": "array", "maxItems": MAX_REPEAT},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "$defs": {"x": {"type": "integer"}}}
    check_schema(schema)
    g = grammar(vocab, schema=schema)
    assert g.allows(tokens_of(vocab, '{"name": "'), tokens_of(vocab, "a")[0])


def test_a_clone_starts_where_its_original_stands_and_moves_apart(vocab):
    g = grammar(vocab)
    start = tokens_of(vocab, '{"city": "')
    assert g.allows(start, tokens_of(vocab, "P")[0])
    twin = g.clone()
    digit = tokens_of(vocab, '{"city": "Paris", "people": ')
    assert twin.allows(digit, tokens_of(vocab, "3")[0]) and not twin.allows(digit, tokens_of(vocab, '"')[0])
    assert g.allows(start, tokens_of(vocab, "P")[0])  # the original kept its own state
    twin.close()
    g.close()


def post_chat(gateway, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("fmt", "status", "param"), [
    ({"type": "string", "maxLength": 100_000_000}, 400, "response_format.json_schema.schema.maxLength"),
    ({"type": "array", "maxItems": 100_000}, 400, "response_format.json_schema.schema.maxItems"),
    ({"enum": []}, 400, "response_format"),  # llama.cpp cannot parse it, nor can the upstream
])
def test_schemas_that_crashed_the_gateway_are_a_400_and_it_keeps_serving(tokens_gateway, fmt, status, param):
    """The reproducers of security round three, against a real gateway and its llama-server upstream,
    on the local alias and on the routed one (whose upstream would be asked to follow what the
    local model cannot)."""
    for model in ("local", "routed"):
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": fmt}}}
        answer = post_chat(tokens_gateway, body)
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["param"] == param
    assert tokens_gateway.process.poll() is None
    fine = post_chat(tokens_gateway, {"model": "routed", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert fine.status_code == 200
