"""Signal extraction and sampling against straightforward reference formulas."""

from __future__ import annotations

import numpy as np

from gateway.decoding.signals import Sampling, log_softmax, sample, signal_of


def reference(logits: np.ndarray) -> tuple[float, float, float]:
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    ordered = np.sort(p)[::-1]
    return entropy, float(ordered[0]), float(ordered[0] - ordered[1])


def test_signal_matches_the_definitions():
    rng = np.random.default_rng(0)
    for scale in (0.1, 1.0, 5.0, 30.0):
        logits = (rng.standard_normal(49_152) * scale).astype(np.float32)
        got = signal_of(logits, position=3)
        entropy, top1, margin = reference(logits)
        assert np.isclose(got.entropy, entropy, rtol=1e-4, atol=1e-5)
        assert np.isclose(got.top1, top1, rtol=1e-4)
        assert np.isclose(got.margin, margin, rtol=1e-4, atol=1e-7)
        assert got.position == 3


def test_uniform_and_peaked_extremes():
    uniform = signal_of(np.zeros(1000, dtype=np.float32), 0)
    assert np.isclose(uniform.entropy, np.log(1000), rtol=1e-5) and np.isclose(uniform.margin, 0.0)
    peaked = np.full(1000, -100.0, dtype=np.float32)
    peaked[7] = 100.0
    sharp = signal_of(peaked, 0)
    assert sharp.entropy < 1e-6 and np.isclose(sharp.top1, 1.0) and np.isclose(sharp.margin, 1.0)


def test_greedy_is_argmax_and_sampling_is_seeded():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert sample(logits, Sampling(0.0), np.random.default_rng(1)) == 1
    draws = [sample(logits, Sampling(1.0, 0.9), np.random.default_rng(s)) for s in range(200)]
    again = [sample(logits, Sampling(1.0, 0.9), np.random.default_rng(s)) for s in range(200)]
    assert draws == again
    assert set(draws) == {1, 2}  # top_p 0.9 keeps only the two likely tokens
    assert np.isclose(np.exp(log_softmax(logits)).sum(), 1.0)


def test_a_subnormal_temperature_samples_the_argmax():
    """Found by the fuzz test: temperature 2.2e-311 made logits / t overflow to inf - inf = nan."""
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    for top_p in (1.0, 0.5):
        assert sample(logits, Sampling(2.225073858507e-311, top_p), np.random.default_rng(0)) == 1
