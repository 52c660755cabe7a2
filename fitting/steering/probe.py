"""A linear probe: L2-regularised logistic regression in numpy, scored on held-out pairs."""

from __future__ import annotations

import numpy as np

ITERATIONS = 400
L2 = 1.0  # on standardised features: with a few hundred rows and ~1000 features the data separate easily


def held_out_accuracy(positive: np.ndarray, negative: np.ndarray, folds: int = 5, seed: int = 0) -> float:
    """Share of held-out prompts a logistic regression classifies right, over `folds` folds of
    pairs (a pair's two prompts are always in the same fold). positive, negative: [pairs, features]."""
    pairs = len(positive)
    folds = max(2, min(folds, pairs))
    order = np.random.default_rng(seed).permutation(pairs)
    right = 0
    for fold in range(folds):
        test = order[fold::folds]
        train = np.setdiff1d(order, test)
        weights, bias, mean, std = _fit(np.concatenate([positive[train], negative[train]]),
                                        np.r_[np.ones(len(train)), np.zeros(len(train))])
        x = (np.concatenate([positive[test], negative[test]]) - mean) / std
        right += int(np.sum((x @ weights + bias > 0) == np.r_[np.ones(len(test)), np.zeros(len(test))].astype(bool)))
    return right / (2 * pairs)


def transfer_accuracy(train_positive: np.ndarray, train_negative: np.ndarray, test_positive: np.ndarray,
                      test_negative: np.ndarray) -> float:
    """Share of the test pairs whose positive prompt a probe fitted on all the train pairs scores
    above that pair's negative one: whether the contrast read in one set (a wording, a task) is the
    one read in another. Compared within pairs, so an offset between the sets (another task's
    prompts) does not count; 0.5 is chance."""
    weights, _, mean, std = _fit(np.concatenate([train_positive, train_negative]),
                                 np.r_[np.ones(len(train_positive)), np.zeros(len(train_negative))])
    return float(np.mean((test_positive - mean) / std @ weights > (test_negative - mean) / std @ weights))


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Gradient descent on the mean log-loss plus L2/2n |w|^2, with the step 1/Lipschitz constant."""
    x = x.astype(np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    x = (x - mean) / std
    rows = len(x)
    lipschitz = 0.25 * np.linalg.norm(x, 2) ** 2 / rows + 0.25 + L2 / rows
    weights, bias = np.zeros(x.shape[1]), 0.0
    for _ in range(ITERATIONS):
        error = 1.0 / (1.0 + np.exp(-(x @ weights + bias))) - y
        weights -= (x.T @ error / rows + L2 * weights / rows) / lipschitz
        bias -= float(error.mean()) / lipschitz
    return weights, bias, mean, std
