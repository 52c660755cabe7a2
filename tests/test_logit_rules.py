"""Penalties and logit_bias as OpenAI defines them, checked against hand-computed logits."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.decoding.logit_rules import LogitRules


def test_bias_is_added_to_the_named_tokens():
    rules = LogitRules.of(0.0, 0.0, {"2": 5.0, "0": -100.0})
    logits = rules.apply(np.zeros(4, dtype=np.float32), answer=[])
    assert logits.tolist() == [-100.0, 0.0, 5.0, 0.0]


def test_frequency_counts_repeats_and_presence_counts_once():
    rules = LogitRules.of(presence=0.5, frequency=0.25, bias=None)
    logits = rules.apply(np.ones(4, dtype=np.float32), answer=[1, 3, 3, 3])
    # token 1: 1 - 0.25*1 - 0.5; token 3: 1 - 0.25*3 - 0.5; unseen tokens unchanged
    assert logits.tolist() == pytest.approx([1.0, 0.25, 1.0, -0.25])


def test_negative_penalties_favour_repeats():
    logits = LogitRules.of(-1.0, 0.0, None).apply(np.zeros(3, dtype=np.float32), answer=[2])
    assert logits.tolist() == [0.0, 0.0, 1.0]


def test_inactive_rules_and_upstream_parameters():
    assert not LogitRules.of(0.0, 0.0, {}).active
    assert LogitRules.of(0.0, 0.0, {"1": 1.0}).active
    assert LogitRules.of(0.3, 0.0, {"1": 1.0}).upstream_params() == {"presence_penalty": 0.3}
