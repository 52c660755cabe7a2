"""Steering vectors: the file `python -m gateway steer fit` writes and a steered engine applies.

A file is numpy's `.npz` (read with allow_pickle=False) holding two arrays:

- `directions`: float32 [n_layer, n_embd]; row `il` is added, times the entry's scale, to the
  output of layer `il` (llama.cpp's "l_out-<il>", after its feed-forward residual). Row 0 is kept
  for the read-outs; llama.cpp applies no control to layer 0.
- `meta`: one JSON string: `format` (FORMAT), `model_sha256`, `local_model`, `n_layer`, `n_embd`,
  and how it was made (`method`, `concept`, `pairs`, `command`), as routers/*.json record theirs.

llama.cpp's own control-vector GGUF (cvector-generator's output) needs the `gguf` package, which
the pinned requirements do not have; this format carries the same rows plus the model they fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "routing-gateway/steering-vector@1"


class SteeringError(ValueError):
    """A steering vector file is unusable for a model; the message is one line."""


@dataclass(frozen=True)
class SteeringVector:
    """Per-layer directions fitted for one model (see the module's docstring)."""

    directions: np.ndarray  # float32 [n_layer, n_embd]
    model_sha256: str
    meta: dict[str, Any] = field(default_factory=dict)  # local_model, method, concept, pairs, command

    @property
    def n_layer(self) -> int:
        return int(self.directions.shape[0])

    @property
    def n_embd(self) -> int:
        return int(self.directions.shape[1])

    def save(self, path: str | Path) -> None:
        meta = {**self.meta, "format": FORMAT, "model_sha256": self.model_sha256,
                "n_layer": self.n_layer, "n_embd": self.n_embd}
        with Path(path).open("wb") as handle:  # savez would append .npz to a name without it
            np.savez(handle, directions=self.directions.astype(np.float32), meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: str | Path, model_sha256: str | None = None) -> "SteeringVector":
        """Read `path`; with `model_sha256`, refuse a file fitted for another model.
        Raises SteeringError (one line)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                directions, meta = data["directions"], json.loads(str(data["meta"]))
        except FileNotFoundError as exc:
            raise SteeringError(f"steering vector file not found: {path}") from exc
        except (OSError, ValueError, KeyError) as exc:
            raise SteeringError(f"{path} is not a steering vector file ({exc})") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SteeringError(f"{path} is not a {FORMAT} file")
        if directions.ndim != 2 or [meta.get("n_layer"), meta.get("n_embd")] != list(directions.shape):
            raise SteeringError(f"{path}: directions of shape {directions.shape} do not match its n_layer and n_embd")
        if model_sha256 is not None and meta.get("model_sha256") != model_sha256:
            raise SteeringError(f"{path} was fitted for the model with sha256 {meta.get('model_sha256')} "
                                f"({meta.get('local_model', 'unnamed')}), not {model_sha256}")
        return cls(directions.astype(np.float32), str(meta["model_sha256"]), meta)


@dataclass(frozen=True)
class Steering:
    """A vector as one engine applies it: `scale` times its rows for layers first..last (inclusive)."""

    vector: SteeringVector
    scale: float
    layers: tuple[int, int]

    def control(self, n_layer: int, n_embd: int) -> np.ndarray:
        """The buffer llama_set_adapter_cvec reads: rows for layers 1..n_layer-1, each n_embd wide.
        Raises SteeringError for a vector of another model's shape or layers it does not have."""
        if (self.vector.n_layer, self.vector.n_embd) != (n_layer, n_embd):
            raise SteeringError(f"the steering vector has {self.vector.n_layer} layers of width {self.vector.n_embd}; "
                                f"the model has {n_layer} of width {n_embd}")
        first, last = self.layers
        if not 1 <= first <= last < n_layer:
            raise SteeringError(f"steering layers [{first}, {last}] are outside the model's layers 1..{n_layer - 1}")
        return np.ascontiguousarray(self.vector.directions[1:] * np.float32(self.scale), dtype=np.float32)
