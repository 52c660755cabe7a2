"""Fitting a steering vector: contrast pairs' per-layer states in, per-layer directions out.

Each pair gives, at every layer, the difference between its positive and its negative prompt's
last-token state. `mean` is the mean of those differences. `pca` is their first principal
direction taken about zero, as cvector-generator takes it (centring would remove the mean
difference, which is the concept itself), signed to agree with the mean and sized to the mean's
length along it. So in both, scale 1 adds one average contrast to a steered layer's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from adapters.hidden_states import HiddenStates
from adapters.model_files import CATALOG, model_sha256, resolve_model
from adapters.steering import SteeringVector
from fitting.steering.prompts import Pair, prompt_tokens

Method = Literal["mean", "pca"]
METHODS: tuple[Method, ...] = ("mean", "pca")


@dataclass
class ContrastModel:
    """A local model opened for reading its layers (adapters.hidden_states), with the name it was opened by."""

    ref: str  # catalog name or GGUF path
    capture: HiddenStates

    def pair_states(self, pairs: list[Pair]) -> tuple[np.ndarray, np.ndarray]:
        """float32 [pairs, n_layer, n_embd] for the positives, then the negatives (last tokens)."""
        positive = [self.capture.states(prompt_tokens(self.capture, p.positive))[0] for p in pairs]
        negative = [self.capture.states(prompt_tokens(self.capture, p.negative))[0] for p in pairs]
        return np.stack(positive), np.stack(negative)


@contextlib.contextmanager
def open_model(ref: str, n_threads: int = 1, n_ctx: int = 2048) -> Iterator[ContrastModel]:
    """The model `ref` (catalog name or GGUF path) opened for capture, closed on exit."""
    with HiddenStates(resolve_model(ref), n_threads, n_ctx) as capture:
        yield ContrastModel(ref, capture)


def directions(positive: np.ndarray, negative: np.ndarray, method: Method) -> np.ndarray:
    """Per-layer directions [n_layer, n_embd] from paired states [pairs, n_layer, n_embd]."""
    diffs = (positive - negative).astype(np.float64)
    mean = diffs.mean(axis=0)
    if method == "mean":
        return mean.astype(np.float32)
    if method != "pca":
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    out = np.zeros_like(mean)
    for layer in range(diffs.shape[1]):
        first = np.linalg.svd(diffs[:, layer, :], full_matrices=False)[2][0]
        along = float(first @ mean[layer])
        out[layer] = first * along  # the sign and the length of the mean along it
    return out.astype(np.float32)


def fit(model: ContrastModel, pairs: list[Pair], method: Method, meta: dict) -> SteeringVector:
    """A steering vector for `model` from `pairs` by `method`; `meta` (concept, command) is recorded."""
    positive, negative = model.pair_states(pairs)
    name = model.ref if model.ref in CATALOG else Path(model.ref).name
    return SteeringVector(directions(positive, negative, method), model_sha256(model.ref),
                          {"local_model": name, "method": method, "pairs": len(pairs), **meta})
