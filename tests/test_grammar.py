"""The llama.cpp grammar over SmolLM2's real vocabulary: what it allows, masks and accepts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llama_cpp import Llama

from adapters.grammar import Grammar, GrammarUnsupported, gbnf_for

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
