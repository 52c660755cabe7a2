"""Train an MLP router (policies/mlp_router.py) offline, in numpy.

Rows are steps: the FEATURES of policies/learned.py followed by the local model's last hidden
state there; labels are the router's training label (mismatch or divergent). One hidden layer of
ReLU units and a sigmoid output, fitted by Adam on the mean binary cross-entropy with L2 weight
decay, on standardised inputs. `forward` is the training-side computation; the router file it
produces must score every row as `forward` does (tests/test_mlp_router.py).

With few training rows an MLP over ~900 hidden dimensions overfits, so the hidden state may first
be projected on its leading principal directions (`pca`). The projection is linear, so it folds
into the first layer: the router file still reads the raw hidden state, and its format and
serving cost do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from policies.learned import FEATURES
from policies.mlp_router import MlpRouter

SCALARS = len(FEATURES)  # a row's leading columns; the hidden state follows


@dataclass(frozen=True)
class MlpParams:
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float
    mean: np.ndarray
    scale: np.ndarray


def forward(params: MlpParams, x: np.ndarray) -> np.ndarray:
    """The model's probabilities for the rows of `x`."""
    h = np.maximum(((x - params.mean) / params.scale) @ params.w1.T + params.b1, 0.0)
    return 1.0 / (1.0 + np.exp(-np.clip(h @ params.w2 + params.b2, -500, 500)))


def fit_mlp(x: np.ndarray, y: np.ndarray, units: int = 64, epochs: int = 40, batch: int = 256,
            learning_rate: float = 1e-3, l2: float = 1e-4, seed: int = 0,
            on_epoch: Callable[[int, MlpParams], None] | None = None) -> MlpParams:
    """Fit the MLP on rows `x` and 0/1 labels `y` (deterministic for a seed); `on_epoch` sees the
    parameters after each epoch (1, 2, ...)."""
    rng = np.random.default_rng(seed)
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-8] = 1.0
    z = (x - mean) / scale
    n, d = z.shape
    weights = {"w1": rng.normal(0.0, np.sqrt(2.0 / d), (units, d)), "b1": np.zeros(units),
               "w2": rng.normal(0.0, np.sqrt(1.0 / units), units),
               "b2": np.array(np.log(max(y.mean(), 1e-6) / max(1 - y.mean(), 1e-6)))}  # starts at the base rate
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in weights.items()}
    beta1, beta2, eps, t = 0.9, 0.999, 1e-8, 0
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        for start in range(0, n, batch):
            rows = order[start:start + batch]
            zb, yb = z[rows], y[rows]
            pre = zb @ weights["w1"].T + weights["b1"]
            h = np.maximum(pre, 0.0)
            p = 1.0 / (1.0 + np.exp(-np.clip(h @ weights["w2"] + weights["b2"], -500, 500)))
            dz = (p - yb) / len(rows)  # d(mean cross-entropy) / d(output logit)
            dh = np.outer(dz, weights["w2"]) * (pre > 0)
            grads = {"w1": dh.T @ zb + l2 * weights["w1"], "b1": dh.sum(axis=0),
                     "w2": h.T @ dz + l2 * weights["w2"], "b2": np.array(dz.sum())}
            t += 1
            for key, grad in grads.items():
                m, v = moments[key]
                m[...] = beta1 * m + (1 - beta1) * grad
                v[...] = beta2 * v + (1 - beta2) * grad * grad
                step = (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + eps)
                weights[key] = weights[key] - learning_rate * step
        if on_epoch is not None:
            on_epoch(epoch, MlpParams(weights["w1"], weights["b1"], weights["w2"], float(weights["b2"]), mean, scale))
    return MlpParams(weights["w1"], weights["b1"], weights["w2"], float(weights["b2"]), mean, scale)


@dataclass(frozen=True)
class Projection:
    """The hidden state's leading principal directions on training rows, each scaled so that the
    projected rows have unit variance."""

    mean: np.ndarray  # (hidden,)
    components: np.ndarray  # (k, hidden)


def projection(hidden: np.ndarray, k: int) -> Projection:
    """The first `k` principal directions of the rows of `hidden`."""
    mean = hidden.mean(axis=0)
    _, singular, directions = np.linalg.svd(hidden - mean, full_matrices=False)
    spread = np.maximum(singular[:k] / np.sqrt(len(hidden)), 1e-8)
    return Projection(mean, directions[:k] / spread[:, None])


def reduce(x: np.ndarray, basis: Projection) -> np.ndarray:
    """Rows of FEATURES then the hidden state's coordinates on `basis`."""
    return np.hstack([x[:, :SCALARS], (x[:, SCALARS:] - basis.mean) @ basis.components.T])


def fold(params: MlpParams, basis: Projection) -> MlpParams:
    """`params` fitted on `reduce`d rows, as parameters over whole rows that compute the same scores."""
    w_hidden = params.w1[:, SCALARS:] / params.scale[SCALARS:]
    return MlpParams(np.hstack([params.w1[:, :SCALARS], w_hidden @ basis.components]),
                     params.b1 - w_hidden @ params.mean[SCALARS:], params.w2, params.b2,
                     np.concatenate([params.mean[:SCALARS], basis.mean]),
                     np.concatenate([params.scale[:SCALARS], np.ones(len(basis.mean))]))


def fit_projected(x: np.ndarray, y: np.ndarray, pca: int | None = None, **fit: Any) -> MlpParams:
    """`fit_mlp` on rows `x` (FEATURES then hidden state), the hidden state first projected on its
    first `pca` principal directions if given; the parameters read whole rows either way."""
    if not pca:
        return fit_mlp(x, y, **fit)
    basis = projection(x[:, SCALARS:], pca)
    return fold(fit_mlp(reduce(x, basis), y, **fit), basis)


def train_mlp(x: np.ndarray, y: np.ndarray, shares: Sequence[float], model_sha256: str, meta: dict[str, Any],
              pca: int | None = None, **fit: Any) -> MlpRouter:
    """An MLP router fitted on rows `x` (FEATURES then hidden state) and labels `y`, the hidden
    state projected on its first `pca` principal directions if given, with score thresholds that
    route each share of those rows."""
    return router_of(fit_projected(x, y, pca, **fit), x, shares, model_sha256, meta)


def router_of(params: MlpParams, x: np.ndarray, shares: Sequence[float], model_sha256: str, meta: dict[str, Any]
              ) -> MlpRouter:
    """The MLP router with `params`, its score thresholds routing each share of rows `x`."""
    router = MlpRouter(params.w1, params.b1, params.w2, params.b2, params.mean, params.scale, {}, model_sha256, meta)
    scores = forward(params, x)
    return replace(router, shares={float(s): float(np.quantile(scores, 1.0 - s)) for s in shares})
