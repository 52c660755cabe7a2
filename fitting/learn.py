"""Train a learned router on an FS-GEN analysis and compare it with the fixed rules at equal share.

Each answer position of the upstream's answers (teacher-forced through the local model, see
fitting/analysis.py) is one example: the features the decoder has at that step (policies/learned.py)
and the label "the local greedy token is not the upstream's" (mismatch). The model is an
L2-regularised logistic regression fitted by Newton's method in numpy: a dozen features need no
more, and the gateway serves it with one dot product. Score thresholds are fitted for target
shares of the fit rows' tokens; `with_thresholds` refits them on other answers (another task's,
or the local model's own text, which is what the router reads live).

`compare` measures, on held-out rows, each method at the same share of tokens routed: mismatch
recall, token accuracy (positions that agree with the upstream after routing) and answers
reproduced (answers whose every mismatch is routed: teacher-forced, they are the upstream's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fitting.analysis import auroc, reliability, steps
from fitting.calibrate import ORIENTATION
from policies.base import Signal
from policies.learned import FEATURES, Router, features
from policies.online_check import fit_logistic


def step_signal(step: dict[str, Any]) -> Signal:
    return Signal(step["entropy"], step["top1"], step["margin"], step["position"], step.get("top", ()),
                  step.get("kind", ""))


def matrix(records: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, mismatch labels and the answer index of every position of `records`."""
    rows, labels, answers = [], [], []
    for index, record in enumerate(records):
        for step in steps([record]):
            rows.append(features(step_signal(step)))
            labels.append(step["mismatch"])
            answers.append(index)
    return np.array(rows).reshape(-1, len(FEATURES)), np.array(labels, dtype=float), np.array(answers)


def scored(router: Router, records: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The router's score, the mismatch label (bool) and the features of every position of `records`."""
    x, labels, _ = matrix(records)
    return np.array([router.score(row) for row in x]), labels.astype(bool), x


def logistic_scores(weights: np.ndarray, bias: float, mean: np.ndarray, scale: np.ndarray,
                    x: np.ndarray) -> np.ndarray:
    """The probabilities a `fit_logistic` fit gives the rows `x`."""
    return 1.0 / (1.0 + np.exp(-np.clip(((x - mean) / scale) @ weights + bias, -500, 500)))


def train(records: Sequence[dict[str, Any]], shares: Sequence[float], model_sha256: str,
          meta: dict[str, Any]) -> Router:
    """A router fitted on `records`, with score thresholds for each share of their tokens."""
    x, y, _ = matrix(records)
    weights, bias, mean, scale = fit_logistic(x, y)
    router = Router(weights, bias, mean, scale, {}, model_sha256, meta)
    return replace(router, shares=_share_thresholds(router, x, shares))


def with_thresholds(router: Router, x: np.ndarray, shares: Sequence[float],
                    meta: dict[str, Any] | None = None) -> Router:
    """`router` with its score thresholds refitted so that each share of the rows `x` (what the
    router reads at each position: `matrix(records)[0]`, or an MLP router's FEATURES and hidden
    state) scores above its threshold (`meta`, if given, is added to the router's)."""
    return replace(router, shares=_share_thresholds(router, x, shares), meta={**router.meta, **(meta or {})})


def _share_thresholds(router: Router, x: np.ndarray, shares: Sequence[float]) -> dict[float, float]:
    scores = np.array([router.score(row) for row in x])
    return {float(share): float(np.quantile(scores, 1.0 - share)) for share in shares}


def _metrics(routed: np.ndarray, labels: np.ndarray, answers: np.ndarray) -> dict[str, float]:
    mismatch = labels.astype(bool)
    missed = mismatch & ~routed
    reproduced = np.ones(answers.max() + 1, dtype=bool)
    reproduced[answers[missed]] = False
    return {"share": float(routed.mean()), "mismatch_recall": float((mismatch & routed).sum() / max(1, mismatch.sum())),
            "token_accuracy": float(1.0 - missed.mean()), "answers_reproduced": float(reproduced.mean())}


def compare(router: Router, records: Sequence[dict[str, Any]], shares: Sequence[float]) -> list[dict[str, Any]]:
    """On `records`: the router at each share's fitted threshold, each rule at the share the router
    actually reached there, and routing the first 1 and 2 tokens."""
    x, labels, answers = matrix(records)
    all_steps = list(steps(records))
    positions = np.array([s["position"] for s in all_steps])
    learned = np.array([router.score(row) for row in x])
    found = []
    for share in shares:
        routed = learned > router.shares[float(share)]
        reached = routed.mean()
        found.append({"method": "learned", "target_share": share, **_metrics(routed, labels, answers)})
        for name, orientation in ORIENTATION.items():
            values = np.array([orientation * s[name] for s in all_steps])
            cut = np.quantile(values, 1.0 - reached)
            found.append({"method": name, "target_share": share, **_metrics(values > cut, labels, answers)})
    for k in (1, 2):
        found.append({"method": f"first {k}", "target_share": None, **_metrics(positions < k, labels, answers)})
    return found


def ranking_quality(router: Router, records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """AUROC of each score for spotting a mismatch on `records`."""
    x, labels, _ = matrix(records)
    all_steps = list(steps(records))
    found = {"learned": auroc([router.score(row) for row in x], labels.astype(bool))}
    found.update({name: auroc([orientation * s[name] for s in all_steps], labels.astype(bool))
                  for name, orientation in ORIENTATION.items()})
    return found


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| method | target share | share routed | mismatch recall | token accuracy | answers reproduced |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        target = "-" if r["target_share"] is None else f"{r['target_share']:g}"
        lines.append(f"| {r['method']} | {target} | {r['share']:.1%} | {r['mismatch_recall']:.1%} "
                     f"| {r['token_accuracy']:.1%} | {r['answers_reproduced']:.1%} |")
    return "\n".join(lines) + "\n"


def reliability_table(router: Router, records: Sequence[dict[str, Any]], label: str) -> str:
    """Markdown: the router's probability against the share of `label` positions, in ten bins of
    equal counts of `records`' positions (the top bins matter: few positions are routed)."""
    scores, labels, _ = scored(router, records)
    lines = [f"| router probability | positions | mean probability | {label} share |", "|---|---|---|---|"]
    lines += [f"| {low:.4f}-{high:.4f} | {count} | {mean:.4f} | {share:.4f} |"
              for low, high, count, mean, share in reliability(scores, labels, bins=10)]
    return "\n".join(lines) + "\n"
