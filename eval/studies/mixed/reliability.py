"""Whether a learned router's probability is the chance that the upstream writes another token,
where it is fitted (the upstream's answers, teacher-forced) and where it serves (the local model's
own answers). The price-aware policy multiplies it by a value, so it should be a probability there.

    python -m eval.studies.mixed.reliability label --source csqa,reference,0:100 --source gsm8k,learned_gsm8k,100:199 ...
    python -m eval.studies.mixed.reliability report --router routers/mixed-qwen2.5-coder-0.5b.json \\
        --held-out csqa,router,0:100 ... --live csqa,reference,0:100 ... --plot docs/results_reliability_mixed.png

`label` teacher-forces the upstream model on the local model's recorded answers (the `local`
config of each DATASET,RUN[,ROWS]); a position is labelled where the upstream's greedy token is
another than the local one: the mismatch label of the positions a router reads live, which
`analyze --answers local` cannot give (it compares the local model with itself). `report` reads
those labels with the local answers' own analysis records (the router's inputs) and prints, per
task, the router's mean probability against the labelled share, its expected calibration error
over ten bins of equal counts, and its AUROC beside top-1's; then the same for each local answer's
first position alone, and (`--fit-live`) for the router's features fitted on labelled local answers.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fitting.analysis import auroc, reliability
from fitting.datasets import load_items
from fitting.records import (RUNS_DIR, analysis_path, append_record, load_analysed, parse_source, read_records,
                             records_path)
from policies.learned import FEATURES, Router

UPSTREAM = "qwen2.5-coder-1.5b-instruct"
LABELS = "local_labels"  # analysis_path's name for the upstream's labels of the local answers
BINS = 10


def label(sources: Sequence[str], upstream: str, local: str, n_ctx: int, threads: int, runs_dir: Path,
          data: Path | None = None) -> None:
    """Append, per local answer of each source not yet labelled, {"id", "row", "n", "mismatch"}:
    where the upstream's greedy token differs from the local answer's token. `data`: the file the
    sources' runs answered (default: the dataset's dev split)."""
    from llama_cpp import Llama

    from adapters.model_files import resolve_model
    from fitting.analysis import TeacherForcer

    forcer = TeacherForcer.load(resolve_model(upstream, fetch=True), n_ctx, threads)
    try:
        with contextlib.closing(Llama(model_path=str(resolve_model(local)), vocab_only=True, verbose=False)) as vocab:
            _same_vocabulary(forcer.llm, vocab)
        for spec in sources:
            dataset, run, rows = parse_source(spec)
            run_dir = runs_dir / run
            answers = {r["id"]: r for r in read_records(records_path(run_dir, dataset, "local"))}
            out = analysis_path(run_dir, dataset, LABELS)
            done = {r["id"] for r in read_records(out)}
            items = [i for i in load_items(dataset, data, rows) if i.id in answers]
            if answers and not items:
                raise ValueError(f"{spec}: none of the run's local answers is a question of {data or 'the dev split'}")
            items = [i for i in items if i.id not in done]
            for item in tqdm(items, desc=spec, unit="answer", mininterval=2.0):
                forced = forcer.analyze(item, answers[item.id]["tokens"])
                append_record(out, {key: forced[key] for key in ("id", "row", "n", "mismatch")})
    finally:
        forcer.close()


def _same_vocabulary(upstream: Any, local: Any) -> None:
    """The labels compare token ids, so both models must share one tokenizer."""
    probe = "Natalia sold 48/2 = 24 clips in May.\ndef f(x):\n    return x ** 2  # ünïcödé"
    if upstream.n_vocab() != local.n_vocab() or \
            upstream.tokenize(probe.encode(), add_bos=False) != local.tokenize(probe.encode(), add_bos=False):
        raise ValueError("the upstream and local models tokenize differently: their tokens cannot be compared")


def live_records(specs: Sequence[str], runs_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The local answers' analysis records (the router's inputs) with the upstream's labels, by task."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        dataset, run, _ = parse_source(spec)
        records = load_analysed([spec], runs_dir, "local")[dataset]
        labels = {r["id"]: r for r in read_records(analysis_path(runs_dir / run, dataset, LABELS))}
        unlabelled = sum(r["id"] not in labels for r in records)
        if unlabelled:
            raise ValueError(f"{spec}: {unlabelled} local answers are not labelled; "
                             f"run `python -m eval.studies.mixed.reliability label --source {spec}` first")
        for record in records:
            if labels[record["id"]]["n"] != record["n"]:
                raise ValueError(f"{spec}: answer {record['id']} was labelled along other tokens")
            record["mismatch"] = labels[record["id"]]["mismatch"]
        by_task.setdefault(dataset, []).extend(records)
    return by_task


def first_positions(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each analysis record cut to its answer's first position."""
    per_step = ("mismatch", "entropy", "top1", "margin", "top", "kind")
    return [{**record, "n": 1, **{key: record[key][:1] for key in per_step}} for record in records if record["n"]]


def on_policy_router(fit: dict[str, list[dict[str, Any]]], model_sha256: str) -> Router:
    """A logistic router over the scalar features, fitted on labelled local answers of every task."""
    from fitting.learn import train

    meta = {"labels": "mismatch on the local model's own answers", "fitted_on": {t: len(r) for t, r in fit.items()}}
    return train([r for records in fit.values() for r in records], [], model_sha256, meta)


def calibration(router: Router, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The router's probability against the labels along `records`: means, calibration error, AUROC."""
    from fitting.learn import scored

    scores, labels, x = scored(router, records)
    bins = reliability(scores, labels, bins=BINS)
    top1 = 1.0 - x[:, FEATURES.index("top1")]  # the price-aware policy's need without a router
    return {"positions": len(scores), "label_share": float(labels.mean()), "mean_probability": float(scores.mean()),
            "ece": _calibration_error(bins, len(scores)), "auroc": auroc(scores.tolist(), labels.tolist()),
            "ece_top1": _calibration_error(reliability(top1, labels, bins=BINS), len(scores)),
            "auroc_top1": auroc(top1.tolist(), labels.tolist()), "bins": [(mean, share) for *_, mean, share in bins]}


def _calibration_error(bins: Sequence[tuple[float, float, int, float, float]], positions: int) -> float:
    """Expected calibration error: the gap between mean probability and share, weighted by bin."""
    return sum(count * abs(mean - share) for _, _, count, mean, share in bins) / positions


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| task | answers read | positions | mismatch share | router's mean probability "
             "| calibration error (router / 1 - top-1) | AUROC (router / top-1) |", "|---|---|---|---|---|---|---|"]
    for where, tasks in results.items():
        for task, r in tasks.items():
            lines.append(f"| {task} | {where} | {r['positions']:,} | {r['label_share']:.4f} | "
                         f"{r['mean_probability']:.4f} | {r['ece']:.4f} / {r['ece_top1']:.4f} | "
                         f"{_shown(r['auroc'])} / {_shown(r['auroc_top1'])} |")
    return "\n".join(lines) + "\n"


def _shown(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.3f}"  # AUROC has no value where no position is labelled


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 5), squeeze=False)
    for ax, (where, tasks) in zip(axes[0], results.items()):
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
        for task, r in tasks.items():
            means, shares = zip(*r["bins"])
            ax.plot(means, shares, marker="o", label=f"{task} (error {r['ece']:.3f})")
        ax.set(title=where, xlabel="router probability (mean of a tenth of the positions)",
               ylabel="share of positions where the upstream writes another token", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "label":
        label(args.source, args.upstream, args.local, args.n_ctx, args.threads, args.runs_dir, args.data)
        return 0
    router = Router.load(args.router)
    live = live_records(args.live, args.runs_dir)
    read = {"upstream's answers, teacher-forced": load_analysed(args.held_out, args.runs_dir, "upstream"),
            "the local model's own answers": live}
    results = {where: {task: calibration(router, records) for task, records in tasks.items()}
               for where, tasks in read.items()}
    print(table(results), end="")
    first = {task: calibration(router, first_positions(records)) for task, records in live.items()}
    print("\nEach local answer's first position alone (where a short answer is decided):\n")
    print(table({"the local model's own answers, first position": first}), end="")
    if args.fit_live:
        fitted = on_policy_router(live_records(args.fit_live, args.runs_dir), router.model_sha256)
        print("\nThe same features fitted on the labelled local answers of --fit-live (on-policy):\n")
        print(table({where: {task: calibration(fitted, records) for task, records in tasks.items()}
                     for where, tasks in read.items()}), end="")
    if args.plot:
        plot(results, args.plot, args.title or f"{args.router.name}: probability against the upstream's choice")
        print(f"plot: {args.plot}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.studies.mixed.reliability", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    labelling = commands.add_parser("label", help="label the local answers with the upstream's greedy tokens")
    labelling.add_argument("--source", action="append", required=True, metavar="DATASET,RUN[,ROWS]")
    labelling.add_argument("--upstream", default=UPSTREAM, help=f"the model that labels (default {UPSTREAM})")
    labelling.add_argument("--local", default="qwen2.5-coder-0.5b-instruct", help="the model that wrote the answers")
    labelling.add_argument("--data", type=Path, help="the file the runs answered (default: each dataset's dev split)")
    labelling.add_argument("--n-ctx", type=int, default=2048)
    labelling.add_argument("--threads", type=int, default=2)
    report = commands.add_parser("report", help="the router's probability against the labels")
    report.add_argument("--router", type=Path, required=True)
    report.add_argument("--held-out", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="the upstream's answers, analysed (`python -m eval analyze`)")
    report.add_argument("--live", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="the local answers, analysed (`analyze --answers local`) and labelled (`label`)")
    report.add_argument("--fit-live", action="append", default=[], metavar="DATASET,RUN[,ROWS]",
                        help="also fit the router's features on these labelled local answers and report that router")
    report.add_argument("--plot", type=Path)
    report.add_argument("--title")
    for sub in (labelling, report):
        sub.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    return parser


if __name__ == "__main__":
    sys.exit(main())
