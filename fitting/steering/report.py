"""The "Intervention Detector" read-outs for contrast concepts on one local model.

Per layer: a linear probe's held-out accuracy at telling a concept's positive prompts from its
negative ones (where the concept is linearly readable, hence worth steering); with two concepts,
each one's probe scored on the other's pairs (transfer: whether what is read is shared, not the
words of one set of prompts) and the cosine between their mean-difference directions (concepts
that share a direction steer together). The picture shows the accuracies as a rows-by-layers
heatmap and the cosines as a layers-by-layers heatmap (the diagonal is the same-layer cosine; with
one concept, its own direction against itself: where it stays the same, one vector serves a range
of layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fitting.steering.fit import ContrastModel, directions
from fitting.steering.probe import held_out_accuracy, transfer_accuracy
from fitting.steering.prompts import Pair


@dataclass(frozen=True)
class Readout:
    concept: str
    accuracy: list[float]  # per layer
    direction: np.ndarray  # mean difference [n_layer, n_embd]
    positive: np.ndarray  # the captured states [pairs, n_layer, n_embd]
    negative: np.ndarray


def readout(model: ContrastModel, pairs: list[Pair], concept: str, folds: int = 5) -> Readout:
    """Capture `pairs` on `model` and read the concept out at every layer."""
    positive, negative = model.pair_states(pairs)
    accuracy = [held_out_accuracy(positive[:, layer], negative[:, layer], folds) for layer in range(positive.shape[1])]
    return Readout(concept, accuracy, directions(positive, negative, "mean"), positive, negative)


def transfer(source: Readout, target: Readout) -> list[float]:
    """Per layer: `source`'s probe, fitted on all its pairs, scored on `target`'s (probe.transfer_accuracy)."""
    return [transfer_accuracy(source.positive[:, layer], source.negative[:, layer], target.positive[:, layer],
                              target.negative[:, layer]) for layer in range(len(source.accuracy))]


def transfers(readouts: list[Readout]) -> dict[str, list[float]]:
    """With two concepts, each one's probe on the other's pairs, by 'source -> target'; else none."""
    if len(readouts) < 2:
        return {}
    a, b = readouts[:2]
    return {f"{a.concept} -> {b.concept}": transfer(a, b), f"{b.concept} -> {a.concept}": transfer(b, a)}


@dataclass(frozen=True)
class Report:
    """One or two concepts' read-outs, with their transfers computed once."""

    readouts: list[Readout]
    transfer: dict[str, list[float]]  # per layer, by 'source -> target'; empty with one concept

    @classmethod
    def of(cls, readouts: list[Readout]) -> Report:
        return cls(readouts, transfers(readouts))

    @property
    def accuracies(self) -> dict[str, list[float]]:
        """Per layer, each concept's held-out probe accuracy, then the transfers."""
        return {r.concept: r.accuracy for r in self.readouts} | self.transfer


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[n_layer, n_layer]: cosine of a's direction at layer i with b's at layer j."""
    a = a / (np.linalg.norm(a, axis=1, keepdims=True) + 1e-12)
    b = b / (np.linalg.norm(b, axis=1, keepdims=True) + 1e-12)
    return a @ b.T


def summary(report: Report) -> dict:
    """The read-outs as JSON: per concept its accuracies; of the first two, the transfers and the
    same-layer cosines."""
    readouts = report.readouts
    out: dict = {"layers": len(readouts[0].accuracy),
                 "probe_accuracy": {r.concept: [round(a, 4) for a in r.accuracy] for r in readouts}}
    if len(readouts) > 1:
        out["transfer_accuracy"] = {name: [round(a, 4) for a in rows] for name, rows in report.transfer.items()}
        out["cosine"] = {"concepts": [readouts[0].concept, readouts[1].concept],
                         "same_layer": [round(float(c), 4) for c in np.diag(cosines(readouts[0].direction,
                                                                                    readouts[1].direction))]}
    return out


def table(report: Report) -> str:
    """A layer-per-line text table of the read-outs: accuracies, transfers, the same-layer cosine."""
    readouts, rows = report.readouts, report.accuracies
    same = np.diag(cosines(readouts[0].direction, readouts[-1].direction)) if len(readouts) > 1 else None
    head = "layer " + " ".join(f"{name[:24]:>24}" for name in rows) + ("     cosine" if same is not None else "")
    lines = [head]
    for layer in range(len(readouts[0].accuracy)):
        line = f"{layer:5d} " + " ".join(f"{row[layer]:24.3f}" for row in rows.values())
        lines.append(line + (f" {same[layer]:10.3f}" if same is not None else ""))
    return "\n".join(lines)


def draw_heatmap(report: Report, path: str | Path) -> None:
    """Write the picture (PNG) described in the module's docstring. Needs matplotlib (the fitting
    extra: fitting/extras.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    readouts, rows = report.readouts, report.accuracies
    other = readouts[1] if len(readouts) > 1 else readouts[0]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 10 + 0.3 * len(rows)), height_ratios=[len(rows), 8])
    # 0.5 is chance; a transfer below it ranks the other concept's pairs the wrong way round
    image = top.imshow(list(rows.values()), aspect="auto", vmin=0.0, vmax=1.0, cmap="RdBu_r")
    top.set_yticks(range(len(rows)), list(rows))
    top.set_xlabel("layer")
    top.set_title("linear probe accuracy: held out within a concept; across concepts (source -> target)")
    figure.colorbar(image, ax=top)
    image = bottom.imshow(cosines(readouts[0].direction, other.direction), vmin=-1, vmax=1, cmap="RdBu_r")
    bottom.set_xlabel(f"layer ({other.concept})")
    bottom.set_ylabel(f"layer ({readouts[0].concept})")
    bottom.set_title("cosine of mean-difference directions")
    figure.colorbar(image, ax=bottom)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(report: Report, out_dir: str | Path, meta: dict, heatmap: bool = True) -> list[Path]:
    """report.json and, with `heatmap` (it needs matplotlib: the fitting extra), heatmap.png under
    `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**meta, **summary(report)}, indent=1) + "\n")
    if not heatmap:
        return [out / "report.json"]
    draw_heatmap(report, out / "heatmap.png")
    return [out / "report.json", out / "heatmap.png"]
