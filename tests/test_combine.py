"""Combining a routed step's two distributions (policies/combine.py), its settings, its cache entries
and its start-up refusal."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from adapters.continuation_modes import Alternatives, first_alternatives, gives_alternatives
from adapters.upstream import Continuation
from gateway.config_checks import check_routing
from gateway.decoding.handoffs import cache_entry, cached_continuation
from gateway.settings import RoutingOverride, RoutingSettings, Settings, SettingsError
from gateway.tenancy.routing import resolve_routing
from policies.combine import CombineParams, TokenIndex, combine, log_softmax

# A toy local vocabulary: id -> bytes (id 0 is a control token, without bytes).
VOCAB = [b"", b" Paris", b" London", b" the", b" a", b" Rome"]
INDEX = TokenIndex(VOCAB)


def local(**probabilities: float) -> np.ndarray:
    """Local log-probabilities over VOCAB from probabilities by token text (the rest shares what is left)."""
    named = {VOCAB.index(f" {word}".encode()): p for word, p in probabilities.items()}
    rest = (1 - sum(named.values())) / (len(VOCAB) - len(named))
    return np.log(np.array([named.get(t, rest) for t in range(len(VOCAB))]))


def upstream(**probabilities: float) -> tuple[tuple[bytes, float], ...]:
    return tuple(sorted(((f" {w}".encode(), math.log(p)) for w, p in probabilities.items()), key=lambda a: -a[1]))


def test_take_keeps_the_upstream_token_uncounted_as_combined():
    got = combine(CombineParams("take"), b" Paris", upstream(Paris=0.5, London=0.4), local(London=0.9), INDEX)
    assert (got.how, got.text) == ("taken", b" Paris")


def test_contrastive_prefers_what_the_upstream_believes_and_the_local_model_does_not():
    alternatives = upstream(Paris=0.5, London=0.4, Rome=0.01)
    # Paris: log .5 - .5 log .8 = -0.582; London: log .4 - .5 log .05 = 0.582; Rome is not plausible (< 0.1 * 0.5)
    got = combine(CombineParams("contrastive", alpha=0.1, beta=0.5), b" Paris", alternatives,
                  local(Paris=0.8, London=0.05, Rome=0.0001), INDEX)
    assert (got.how, got.text) == ("changed", b" London")


def test_contrastive_leaves_out_implausible_tokens_however_unlikely_locally():
    alternatives = upstream(Paris=0.9, Rome=0.05)  # Rome is below alpha = 0.1 of the top
    got = combine(CombineParams("contrastive", alpha=0.1, beta=1.0), b" Paris", alternatives,
                  local(Paris=0.9, Rome=1e-9), INDEX)
    assert got.how == "agreed" and got.text == b" Paris"


def test_contrastive_with_beta_zero_is_the_upstream_argmax():
    alternatives = upstream(Paris=0.6, London=0.3)
    got = combine(CombineParams("contrastive", beta=0.0), b" Paris", alternatives, local(London=0.99), INDEX)
    assert got.how == "agreed"


def test_fuse_weighs_the_two_log_probabilities():
    alternatives = upstream(Paris=0.5, London=0.45)
    probabilities = local(Paris=0.1, London=0.8)
    assert combine(CombineParams("fuse", weight=0.5), b" Paris", alternatives, probabilities, INDEX, VOCAB).text \
        == b" London"
    assert combine(CombineParams("fuse", weight=1.0), b" Paris", alternatives, probabilities, INDEX, VOCAB).how \
        == "agreed"


def test_fuse_scores_a_local_candidate_the_upstream_did_not_list_at_its_lowest_listed_logprob():
    alternatives = upstream(Paris=0.4, London=0.35)  # " the" unlisted: scored at log 0.35
    probabilities = local(Paris=0.01, London=0.01, the=0.95)
    got = combine(CombineParams("fuse", weight=0.5), b" Paris", alternatives, probabilities, INDEX, VOCAB)
    # the: .5 log .95 + .5 log .35 = -0.55 beats Paris: .5 log .01 + .5 log .4 = -2.76
    assert (got.how, got.text) == ("changed", b" the")


def test_a_token_without_a_local_counterpart_falls_back_to_take():
    alternatives = ((b" Par", math.log(0.6)), (b" London", math.log(0.3)))  # " Par" is no local token
    for rule in ("contrastive", "fuse"):
        got = combine(CombineParams(rule), b" Par", alternatives, local(London=0.9), INDEX, VOCAB)
        assert (got.how, got.text) == ("fell_back", b" Par")
    assert combine(CombineParams("fuse"), b" Paris", (), local(), INDEX, VOCAB).how == "fell_back"


def test_unaligned_alternatives_are_left_out_and_aligned_ones_kept():
    assert INDEX.align(((b" Paris", -0.1), (b"xyz", -2.0), (b"", -3.0))) == [(1, b" Paris", -0.1)]
    assert INDEX.id_of(b"") is None  # a control token's empty bytes align with nothing


def test_log_softmax_sums_to_one():
    assert np.exp(log_softmax(np.array([3.0, 1.0, -2.0, 0.5]))).sum() == pytest.approx(1.0)


def test_first_alternatives_read_llama_server_and_legacy_shapes():
    server = SimpleNamespace(choices=[SimpleNamespace(logprobs=SimpleNamespace(content=[
        {"token": " the", "bytes": [32, 116, 104, 101], "logprob": -1.5,
         "top_logprobs": [{"token": " the", "bytes": [32, 116, 104, 101], "logprob": -1.5},
                          {"token": "", "bytes": [240, 159], "logprob": -4.0}]}]))])
    assert first_alternatives(server) == Alternatives(b" the", ((b" the", -1.5), (b"\xf0\x9f", -4.0)))
    legacy = SimpleNamespace(choices=[SimpleNamespace(logprobs=SimpleNamespace(
        content=None, tokens=[" a", " b"], top_logprobs=[{" b": -2.0, " a": -0.5}, {}]))])
    assert first_alternatives(legacy) == Alternatives(b" a", ((b" a", -0.5), (b" b", -2.0)))
    assert first_alternatives(SimpleNamespace(choices=[SimpleNamespace(logprobs=None)])) is None


def test_cache_entries_keep_the_alternatives_bytes_and_what_was_read_ahead_exactly():
    first = Alternatives(b"\xf0\x9f", ((b"\xf0\x9f", -0.2), (b" x", -1.0)))
    entry = cache_entry(Continuation("é x", True, 1, 1, 0.0, 0.0, first=first, ahead=(" y", "é")), structured=True)
    cached = cached_continuation(entry, structured=True)
    assert (cached.text, cached.finished, cached.first, cached.ahead) == ("é x", True, first, (" y", "é"))
    plain = cached_continuation(cache_entry(Continuation("ab", False, 1, 1, 0.0, 0.0), False), False)
    assert (plain.text, plain.finished, plain.completion_tokens) == ("ab", False, 0)


def test_combine_settings_travel_as_one_rule_and_a_request_may_override_them():
    alias = RoutingSettings(policy="entropy", threshold=1.0, combine="contrastive", combine_beta=0.7)
    rule = alias.combining
    assert (rule.combine, rule.combine_beta, rule.alternatives, rule.params.alpha) == ("contrastive", 0.7, 5, 0.1)
    resolved = resolve_routing(alias, RoutingOverride(combine="fuse", combine_weight=0.3))
    assert (resolved.combining.combine, resolved.combining.params.weight) == ("fuse", 0.3)
    assert RoutingSettings().combining.alternatives == 0  # take asks for none
    with pytest.raises(ValueError):
        RoutingSettings(combine="average")


def config(mode: str, combine: str) -> Settings:
    return Settings(**{
        "models": {"local": {"smol": {"gguf": "/nonexistent.gguf"}}},
        "upstreams": {"big": {"model": "openai/gpt-4o-mini", "mode": mode}},
        "aliases": {"routed": {"local": "smol", "upstream": "big",
                               "routing": {"policy": "entropy", "threshold": 1.0, "combine": combine}}},
        "tenants": [{"id": "demo", "api_key_env": "TEST_DEMO_KEY"}],
    })


@pytest.mark.parametrize("mode", ["chat_fallback", "chat_prefix"])
def test_an_upstream_without_alternatives_is_refused_at_start_up_naming_alias_and_upstream(mode):
    assert not gives_alternatives(mode)
    refusal = rf"aliases\.routed: routing\.combine 'fuse' .*upstream 'big' \(mode {mode}\)"
    with pytest.raises(SettingsError, match=refusal):
        check_routing(config(mode, "fuse"), {"routed": None})
    assert check_routing(config(mode, "take"), {"routed": None}) == []


def test_an_upstream_with_alternatives_passes_the_check():
    assert gives_alternatives("chat_continue") and gives_alternatives("tokens")
    assert check_routing(config("chat_continue", "contrastive"), {"routed": None}) == []


def test_an_end_token_sent_with_empty_bytes_aligns_with_the_local_end():
    index = TokenIndex(VOCAB, end=0)  # id 0: the local end token, its bytes empty
    alternatives = ((b"", math.log(0.5)), (b" Paris", math.log(0.45)))
    ends = combine(CombineParams("fuse"), b"", alternatives, local(Paris=0.9), index, VOCAB)
    assert (ends.how, ends.text) == ("changed", b" Paris")  # the local model would not end here
    goes_on = combine(CombineParams("fuse"), b" Paris", ((b" Paris", math.log(0.5)), (b"", math.log(0.45))),
                      np.log(np.array([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])), index, VOCAB)
    assert (goes_on.how, goes_on.text) == ("changed", b"")  # ... and here it would: the end is chosen
    assert combine(CombineParams("fuse"), b"", alternatives, local(), INDEX, VOCAB).how == "fell_back"  # no end given
