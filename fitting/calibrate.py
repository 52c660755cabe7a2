"""Pick routing thresholds from an FS-GEN analysis, for a target upstream share or token accuracy.

On the fit rows, every answer position has the local model's signals and whether its greedy token
differs from the upstream's. A threshold routes a position when entropy > t (top1 < t,
margin < t). Its upstream share is the share of positions routed; its token accuracy is the share
of positions where the routed answer agrees with the upstream's (matched locally, or routed).
For a target share we take the signal's quantile; for a target accuracy, the threshold that
routes the fewest positions and still reaches it. The held-out rows show what the same threshold
does on answers it was not fitted on.

Caveat measured in docs/studies/reference.md: these positions lie on the upstream's answers. A live decode
follows the local model's own text wherever it is not routed, where the signals differ, so the
realised share of a threshold in a real run can differ from the teacher-forced one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

from fitting.analysis import steps

ORIENTATION = {"entropy": 1.0, "top1": -1.0, "margin": -1.0}  # +1: route above t; -1: route below t


@dataclass(frozen=True)
class Calibration:
    """One threshold: the target it was fitted for and what it does on fit and held-out rows."""

    policy: str
    target: str  # "share" | "accuracy"
    goal: float
    threshold: float
    fit: dict[str, float]
    held_out: dict[str, float] | None

    @property
    def key(self) -> str:
        return f"{self.policy}-{self.target}-{self.goal:g}"


def _arrays(records: Sequence[dict[str, Any]], policy: str) -> tuple[np.ndarray, np.ndarray]:
    """Oriented scores (larger: more likely routed) and mismatch labels of every position."""
    rows = list(steps(records))
    values = np.array([row[policy] for row in rows], dtype=float) * ORIENTATION[policy]
    return values, np.array([row["mismatch"] for row in rows], dtype=bool)


def evaluate_threshold(records: Sequence[dict[str, Any]], policy: str, threshold: float) -> dict[str, float]:
    """Upstream share, token accuracy and mismatch recall of `threshold` on `records`."""
    scores, mismatch = _arrays(records, policy)
    if scores.size == 0:
        return {"tokens": 0}
    routed = scores > threshold * ORIENTATION[policy]
    missed = int((mismatch & ~routed).sum())
    return {
        "tokens": int(scores.size),
        "upstream_share": float(routed.mean()),
        "token_accuracy": 1.0 - missed / scores.size,
        "mismatch_recall": float((mismatch & routed).sum() / mismatch.sum()) if mismatch.any() else float("nan"),
    }


def threshold_for_share(records: Sequence[dict[str, Any]], policy: str, share: float) -> float:
    """The threshold that routes about `share` of the positions."""
    scores, _ = _arrays(records, policy)
    cut = float(np.quantile(scores, 1.0 - share))
    return _rounded(cut * ORIENTATION[policy])


def threshold_for_accuracy(records: Sequence[dict[str, Any]], policy: str, accuracy: float) -> float:
    """The threshold that routes the fewest positions with token accuracy >= `accuracy`."""
    scores, mismatch = _arrays(records, policy)
    order = np.argsort(-scores, kind="mergesort")
    caught = np.concatenate([[0], np.cumsum(mismatch[order])])  # mismatches among the k top-scored
    reached = 1.0 - (mismatch.sum() - caught) / scores.size
    k = int(np.argmax(reached >= accuracy - 1e-12)) if (reached >= accuracy - 1e-12).any() else scores.size
    ranked = scores[order]
    cut = ranked[k] if k < scores.size else ranked[-1] - 1e-6
    return _rounded(float(cut) * ORIENTATION[policy])


def _rounded(threshold: float) -> float:
    return float(f"{threshold:.4g}")


def calibrate(fit: Sequence[dict[str, Any]], held_out: Sequence[dict[str, Any]], policies: Sequence[str],
              shares: Sequence[float] = (), accuracies: Sequence[float] = ()) -> list[Calibration]:
    """One Calibration per (policy, target), fitted on `fit` and measured on `held_out`."""
    found = []
    for policy in policies:
        for target, goals, pick in (("share", shares, threshold_for_share),
                                    ("accuracy", accuracies, threshold_for_accuracy)):
            for goal in goals:
                threshold = pick(fit, policy, goal)
                found.append(Calibration(
                    policy, target, goal, threshold, evaluate_threshold(fit, policy, threshold),
                    evaluate_threshold(held_out, policy, threshold) if held_out else None))
    return found


def snippet(calibrations: Sequence[Calibration], shares: Sequence[float], header: str) -> str:
    """A YAML config snippet: one `routing:` block per calibration (plus target_fraction ones).

    Each block can be pasted under an alias in config.yaml; `eval run --configs-from` reads it.
    """
    entries: dict[str, Any] = {}
    for c in calibrations:
        entry: dict[str, Any] = {"routing": {"policy": c.policy, "threshold": c.threshold},
                                 "fit": _rounded_metrics(c.fit)}
        if c.held_out:
            entry["held_out"] = _rounded_metrics(c.held_out)
        entries[c.key] = entry
    for share in shares:  # the online policy needs no fit: its target is the share itself
        routing = {"policy": "target_fraction", "target_fraction": share}
        entries[f"target_fraction-share-{share:g}"] = {"routing": routing}
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(entries, sort_keys=False, default_flow_style=None, width=120)


def _rounded_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}
