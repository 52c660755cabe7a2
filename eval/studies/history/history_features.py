"""Do routing-history features help the learned router? An offline ablation (issue 23).

    python -m eval.studies.history.history_features --fit gsm8k,gsm8k_train_hidden --held-out gsm8k,router,0:100

The logistic router reads one step's signals. History features add what the decoder knows of the
steps before it: the previous step's entropy, top-1 and margin (known to any policy), and the
routing so far: whether the previous step was handed off and how many steps ago the last hand-off
was. On the upstream's teacher-forced answers (the mismatch labels' text) the text after a
mismatch is the upstream's, as if every mismatch had been routed, so "the previous step was a
mismatch" is "the previous step was routed" under a router that routes exactly the mismatches:
the most that routing-history features could add. Routers are fitted on --fit answers and rated on
--held-out answers (AUROC for a mismatch; gains over the twelve features with 95% intervals
over answers).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fitting.analysis import auroc, auroc_gain
from fitting.learn import fit_logistic, logistic_scores, matrix
from fitting.records import RUNS_DIR, load_analysed, write_json

SETS = ("the router's twelve features", "+ the previous step's signals", "+ routing history (every mismatch routed)")


def history(records: Sequence[dict[str, Any]]) -> np.ndarray:
    """Per position of `records` (in `matrix` order): the previous step's entropy, top-1 and margin
    (0, 1, 1 before the first), whether it was a mismatch, and log(1 + steps since the last
    mismatch), the answer's start counting as one."""
    rows = []
    for record in records:
        since = -1  # the answer's start counts as a hand-off just before its first step
        for i in range(record["n"]):
            before = i - 1
            previous = (record["entropy"][before], record["top1"][before], record["margin"][before]) if i else (0.0, 1.0, 1.0)
            routed = i > 0 and record["mismatch"][before] == "1"
            since = 0 if routed else since + 1
            rows.append((*previous, float(routed), math.log1p(since)))
    return np.array(rows).reshape(-1, 5)


def feature_sets(records: Sequence[dict[str, Any]]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """({set name: rows}, mismatch labels, answer index) of every position of `records`."""
    x, labels, answers = matrix(records)
    extra = history(records)
    return {SETS[0]: x, SETS[1]: np.hstack([x, extra[:, :3]]), SETS[2]: np.hstack([x, extra])}, labels, answers


def ablation(fit_records: Sequence[dict[str, Any]], held_records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """AUROC on the held-out positions of a logistic router fitted on each feature set, and each
    larger set's gain over the twelve features."""
    fit_sets, fit_labels, _ = feature_sets(fit_records)
    held_sets, held_labels, answers = feature_sets(held_records)
    labels = held_labels.astype(bool)
    scores = {name: logistic_scores(*fit_logistic(fit_sets[name], fit_labels), held_sets[name]) for name in SETS}
    return {"fit": {"answers": len(fit_records), "positions": int(len(fit_labels))},
            "held_out": {"answers": len(held_records), "positions": int(len(labels)), "mismatch_share": float(labels.mean())},
            "auroc": {name: auroc(s, labels) for name, s in scores.items()},
            "gain over the twelve": {name: auroc_gain(scores[name], scores[SETS[0]], labels, answers) for name in SETS[1:]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="teacher-forced upstream answers of one dataset the routers are fitted on")
    parser.add_argument("--held-out", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="teacher-forced upstream answers of the same dataset the routers are rated on")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    parser.add_argument("--report", type=Path, help="default: results/runs/history/<dataset>.json")
    args = parser.parse_args(argv)

    fit, held = load_analysed(args.fit, args.runs_dir, "upstream"), load_analysed(args.held_out, args.runs_dir, "upstream")
    if len(fit) != 1 or set(fit) != set(held):
        raise SystemExit("--fit and --held-out name answers of one and the same dataset")
    dataset = next(iter(fit))
    report = {"dataset": dataset, **ablation(fit[dataset], held[dataset]),
              "command": "python -m eval.studies.history.history_features " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_json(args.report or RUNS_DIR / "history" / f"{dataset}.json", report)
    for name in SETS:
        gain = report["gain over the twelve"].get(name)
        print(f"{dataset} | {name} | {report['auroc'][name]:.4f}"
              + (f" | {gain['gain']:+.4f} [{gain['low']:+.4f}, {gain['high']:+.4f}]" if gain else " | -"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
