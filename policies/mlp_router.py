"""An MLP router over the step's scalar features and the local model's last hidden state, in numpy.

The R2R-style router (issue #23): a step's input is the FEATURES of policies/learned.py followed
by the local model's last hidden state there (the engine returns it to sequences that ask, see
adapters/engine.py), standardised, then one hidden layer of ReLU units and a sigmoid. Its file is
format @2 with `kind: mlp`: the layers' weights, the standardisation, the hidden state's size, the
local model's SHA-256 (a hidden state means nothing for another model), and the score thresholds
fitted for shares of tokens, as a logistic router's. Trained offline by eval/learn_mlp.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.base import Signal
from policies.learned import FEATURES, RouterError, check_header, features, threshold_for_share

MLP_FORMAT = "routing-gateway/learned-router@2"
CORE_KEYS = ("format", "kind", "features", "hidden_size", "model_sha256", "mean", "scale", "layers", "shares")


@dataclass(frozen=True)
class MlpRouter:
    """score = sigmoid(w2 . relu(w1 @ ((x - mean) / scale) + b1) + b2), in [0, 1], where x is the
    step's FEATURES then its hidden state (`hidden_size` floats)."""

    w1: np.ndarray  # (units, inputs)
    b1: np.ndarray  # (units,)
    w2: np.ndarray  # (units,)
    b2: float
    mean: np.ndarray  # (inputs,)
    scale: np.ndarray  # (inputs,)
    shares: dict[float, float]  # upstream share of the fit rows' tokens -> score threshold
    model_sha256: str
    meta: dict[str, Any]
    # the first layer with the standardisation folded in: one matrix-vector product per step
    _w1: np.ndarray = field(init=False, repr=False, compare=False)
    _b1: np.ndarray = field(init=False, repr=False, compare=False)

    reads_hidden = True

    def __post_init__(self) -> None:
        folded = self.w1 / self.scale
        object.__setattr__(self, "_w1", folded)
        object.__setattr__(self, "_b1", self.b1 - folded @ self.mean)

    @property
    def hidden_size(self) -> int:
        return len(self.mean) - len(FEATURES)

    def inputs(self, signal: Signal) -> np.ndarray:
        """The router's input for one step: FEATURES, then the hidden state the signal carries."""
        if signal.hidden is None:
            raise ValueError("an mlp router reads the local model's hidden state, and this step has none")
        return np.concatenate([features(signal), signal.hidden])

    def score(self, x: np.ndarray) -> float:
        h = np.maximum(self._w1 @ x + self._b1, 0.0)
        z = float(self.w2 @ h) + self.b2
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def score_signal(self, signal: Signal) -> float:
        """The score of one decoding step (its Signal must carry the hidden state)."""
        return self.score(self.inputs(signal))

    def threshold_for_share(self, share: float) -> float:
        """See policies.learned.threshold_for_share."""
        return threshold_for_share(self.shares, share)

    def to_json(self) -> dict[str, Any]:
        return {"format": MLP_FORMAT, "kind": "mlp", "features": list(FEATURES), "hidden_size": self.hidden_size,
                "model_sha256": self.model_sha256, "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "layers": [{"weights": self.w1.tolist(), "bias": self.b1.tolist()},
                           {"weights": self.w2.tolist(), "bias": self.b2}],
                "shares": {str(k): v for k, v in sorted(self.shares.items())},
                **{k: v for k, v in self.meta.items() if k not in CORE_KEYS}}

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str | Path, model_sha256: str | None = None) -> "MlpRouter":
        """A router from a parsed file of kind mlp; RouterError if it is not a usable one or was
        trained for another model than `model_sha256`."""
        check_header(data, path, MLP_FORMAT, model_sha256)
        try:
            first, second = data["layers"]
            router = cls(np.array(first["weights"], dtype=float), np.array(first["bias"], dtype=float),
                         np.array(second["weights"], dtype=float), float(second["bias"]),
                         np.array(data["mean"], dtype=float), np.array(data["scale"], dtype=float),
                         {float(k): float(v) for k, v in data["shares"].items()}, str(data["model_sha256"]),
                         {k: v for k, v in data.items() if k not in CORE_KEYS})
            inputs = len(FEATURES) + int(data["hidden_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RouterError(f"{path} is not a complete mlp router file: {exc!r}") from exc
        units = router.b1.shape[0] if router.b1.ndim == 1 else -1
        shapes_ok = (router.w1.shape == (units, inputs) and router.w2.shape == (units,)
                     and router.mean.shape == (inputs,) and router.scale.shape == (inputs,))
        arrays = (router.w1, router.b1, router.w2, router.mean, router.scale)
        if not shapes_ok or not all(np.isfinite(a).all() for a in arrays) or not (router.scale > 0).all() \
                or not math.isfinite(router.b2) or not router.shares:
            raise RouterError(f"{path} is not a usable mlp router: layers of {inputs} inputs and one output, "
                              "finite numbers, scale positive, and shares at least one threshold")
        return router
