"""FS-GEN analysis: where does the small model disagree with the large one?

Take the upstream's greedy answer (the `upstream` config's recorded tokens) as the reference and
teacher-force the local model on prompt + reference in one llama.cpp pass with logits for every
position. At each answer position, the local greedy token either matches the reference token or
not. We report the share of mismatches (CoF_lower: the least share of tokens a router would have
to send upstream to reproduce the large model's answer), that share by position in the answer,
and how well each uncertainty signal separates mismatches from matches (AUROC; 0.5 is chance).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from llama_cpp import Llama

from adapters.chat_template import ChatTemplate
from adapters.vocabulary import token_piece, tokenize_parts
from fitting.datasets import Item
from gateway.decoding.signals import signal_of, token_kind
from policies.online_check import auc

POSITION_BUCKETS = ((0, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 100_000))
# Each signal oriented so that larger means "more likely a mismatch".
SCORES = {"entropy": lambda s: s["entropy"], "1-top1": lambda s: 1.0 - s["top1"], "-margin": lambda s: -s["margin"]}


@dataclass
class TeacherForcer:
    """The local model in its own llama.cpp context with logits for every position."""

    llm: Llama
    template: ChatTemplate

    @classmethod
    def load(cls, path: Path, n_ctx: int, threads: int) -> "TeacherForcer":
        llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                    n_batch=min(512, n_ctx), logits_all=True, verbose=False)
        return cls(llm, ChatTemplate.from_llama(llm))

    def close(self) -> None:
        self.llm.close()

    def analyze(self, item: Item, reference: list[int]) -> dict[str, Any]:
        """Per-position local greedy match and signals along `reference`, as one record
        (`next`: the local greedy token after the whole reference)."""
        prompt = tokenize_parts(self.llm, self.template.render_parts(item.messages))
        tokens = prompt + list(reference)
        if len(tokens) > self.llm.n_ctx():
            raise ValueError(f"item {item.id}: {len(tokens)} tokens exceed the analysis context")
        self.llm.reset()
        self.llm.eval(tokens)
        rows = self.llm.scores[len(prompt) - 1: len(tokens)]
        mismatch, entropy, top1, margin, top, kind = [], [], [], [], [], []
        for position, (logits, token) in enumerate(zip(rows, reference)):
            signal = signal_of(logits, position, lambda t: token_kind(token_piece(self.llm, t)))
            mismatch.append(int(int(np.argmax(logits)) != token))
            entropy.append(round(signal.entropy, 4))
            top1.append(round(signal.top1, 4))
            margin.append(round(signal.margin, 4))
            top.append([round(p, 4) for p in signal.top])
            kind.append(signal.kind)
        return {"id": item.id, "row": item.row, "n": len(reference), "next": int(np.argmax(rows[-1])),
                "mismatch": "".join(map(str, mismatch)), "entropy": entropy, "top1": top1, "margin": margin,
                "top": top, "kind": kind}


def steps(records: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every answer position of every record, as {position, mismatch, entropy, top1, margin} plus
    the top-4 probabilities and the local token's kind where the analysis recorded them."""
    for record in records:
        for i in range(record["n"]):
            step = {"position": i, "mismatch": record["mismatch"][i] == "1", "entropy": record["entropy"][i],
                    "top1": record["top1"][i], "margin": record["margin"][i]}
            if "top" in record:
                step.update(top=tuple(record["top"][i]), kind=record["kind"][i])
            yield step


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of `scores` for positive `labels` (policies.online_check.auc: ties
    count half); NaN, not None, unless both labels are present, so that numpy sums and plots skip it."""
    found = auc(scores, labels)
    return float("nan") if found is None else found


def auroc_gain(better: np.ndarray, worse: np.ndarray, labels: np.ndarray, answers: np.ndarray,
               resamples: int = 200, seed: int = 0) -> dict[str, float]:
    """AUROC(better) - AUROC(worse) on these rows, with a 95% percentile bootstrap interval over
    answers (positions of one answer are not independent)."""
    rng = np.random.default_rng(seed)
    rows_of_answer = [np.flatnonzero(answers == a) for a in np.unique(answers)]
    gains = []
    for _ in range(resamples):
        rows = np.concatenate([rows_of_answer[i] for i in rng.integers(0, len(rows_of_answer), len(rows_of_answer))])
        gains.append(auroc(better[rows], labels[rows]) - auroc(worse[rows], labels[rows]))
    low, high = np.nanpercentile(gains, [2.5, 97.5])
    return {"gain": auroc(better, labels) - auroc(worse, labels), "low": float(low), "high": float(high)}


def summarize_analysis(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """CoF_lower overall and by position, and the AUROC of each signal for spotting a mismatch."""
    all_steps = list(steps(records))
    if not all_steps:
        return {"items": len(records), "tokens": 0}
    labels = [s["mismatch"] for s in all_steps]
    by_position = {}
    for low, high in POSITION_BUCKETS:
        bucket = [s["mismatch"] for s in all_steps if low <= s["position"] < high]
        if bucket:
            by_position[f"{low}-{high - 1}"] = {"tokens": len(bucket), "mismatch_share": sum(bucket) / len(bucket)}
    per_item = [r["mismatch"].count("1") / r["n"] for r in records if r["n"]]
    return {
        "items": len(records),
        "tokens": len(all_steps),
        "cof_lower": sum(labels) / len(labels),
        "cof_lower_item_mean": float(np.mean(per_item)) if per_item else float("nan"),
        "items_without_mismatch": sum(1 for r in records if "1" not in r["mismatch"]),
        "by_position": by_position,
        "auroc": {name: auroc([score(s) for s in all_steps], labels) for name, score in SCORES.items()},
    }


def reliability(confidences: np.ndarray, labels: np.ndarray, bins: int = 5) -> list[tuple[float, float, int, float, float]]:
    """(low, high, count, mean confidence, share of positive labels) per bin of equal counts: a
    calibrated probability's mean matches the share of positives in every bin."""
    order = np.argsort(confidences, kind="mergesort")
    rows = []
    for part in np.array_split(order, bins):
        if len(part):
            rows.append((float(confidences[part].min()), float(confidences[part].max()), len(part),
                         float(confidences[part].mean()), float(labels[part].mean())))
    return rows
