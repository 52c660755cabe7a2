"""Can an answer be rated before it is finished? The answer check on the first K tokens only.

    python -m eval.studies.afresh.early_rating --dataset gsm8k --run-name gsm8k_train_local --rows 0:140 --at 16 32 64 128

An answer asked afresh throws away every local token decoded before it was rated; rated after its
first K tokens instead, the local model stops there and the upstream starts at once. This measures
what the check loses by looking only at those K tokens: the check's six aggregates (AnswerStats)
over each local answer's first K steps (an answer shorter than K is rated at its end, as now), from
the teacher-forced signals of the local model's own answers (`python -m eval analyze --answers
local`, the same signals the decoder sees live), labelled by whether the answer was right. Two-fold
over the rows (fitted on even rows, rated on odd, and the reverse), beside the check on whole answers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fitting.afresh import prefix_stats
from fitting.analysis import auroc
from fitting.datasets import parse_rows
from fitting.learn import fit_logistic
from fitting.records import RUNS_DIR, analysis_path, in_rows, read_records, records_path


def two_fold_auroc(x: np.ndarray, y: np.ndarray) -> float:
    """AUROC of a logistic check fitted on one half of the answers (alternate rows) and rated on the other."""
    scores = np.empty(len(y))
    halves = np.arange(len(y)) % 2
    for half in (0, 1):
        weights, bias, mean, scale = fit_logistic(x[halves != half], y[halves != half])
        scores[halves == half] = ((x[halves == half] - mean) / scale) @ weights + bias
    return auroc(scores, y.astype(bool))


def table(analyses: Sequence[dict[str, Any]], records: dict[str, dict[str, Any]], cuts: Sequence[int]) -> str:
    """Markdown: for each K (and whole answers), the check's two-fold AUROC and the local tokens an
    answer asked afresh would have cost."""
    y = np.array([float(records[a["id"]]["correct"]) for a in analyses])
    lengths = np.array([a["n"] for a in analyses])
    lines = [f"{len(y)} answers, {y.mean():.1%} right, {lengths.mean():.0f} tokens on average",
             "", "| rated after | AUROC (two-fold) | local tokens before the rating, mean |", "|---|---|---|"]
    for k in [*cuts, None]:
        x = np.array([prefix_stats(a, records[a["id"]], k).features() for a in analyses])
        spent = lengths if k is None else np.minimum(lengths, k)
        lines.append(f"| {'the whole answer' if k is None else f'{k} tokens'} | {two_fold_auroc(x, y):.3f} "
                     f"| {spent.mean():.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.studies.afresh.early_rating", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--run-name", required=True, help="a run with local answers and their local analysis")
    parser.add_argument("--rows", help="only these dataset rows, e.g. 0:140")
    parser.add_argument("--at", nargs="+", type=int, required=True, help="ratings after this many tokens")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    args = parser.parse_args(argv)
    run_dir = args.runs_dir / args.run_name
    records = {r["id"]: r for r in read_records(records_path(run_dir, args.dataset, "local"))}
    analyses = [a for a in read_records(analysis_path(run_dir, args.dataset, "local")) if a["id"] in records]
    if args.rows:
        analyses = in_rows(analyses, parse_rows(args.rows))
    if not analyses:
        parser.error(f"no analysed local answers in {run_dir}: run `python -m eval analyze --answers local` first")
    print(table(sorted(analyses, key=lambda a: a["row"]), records, args.at), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
