"""Fit routers on train rows and compare them on held-out dev rows: does the hidden state help?

    python -m eval.studies.hidden_state.hidden_router --dataset gsm8k --train-run gsm8k_train_hidden \
        --train-data data/gsm8k_train7473.jsonl --dev-run router --dev-rows 0:100 \
        --out-router routers/gsm8k-mlp-qwen2.5-coder-0.5b.json --share 0.05 0.1 0.2

Both runs hold the upstream's answers (`python -m eval run --configs upstream`). Every answer
position is teacher-forced through the local model with its hidden state (eval/hidden_steps.py;
the rows are cached outside the repository, they are large and can be made again). On the train
rows only, this fits a logistic router on the twelve scalar FEATURES (fitting/learn.py's), an MLP on
the scalars alone and an MLP on scalars + hidden state (eval/learn_mlp.py); it reports each
one's AUROC for the mismatch label on the dev rows, beside the fixed signals', and writes the
comparison as JSON (hidden_router_<dataset>_dev<rows>.json in the train run) and the scalars +
hidden MLP as a router file with thresholds fitted on the train rows.

With `--label divergent` (R2R's label, from `python -m eval diverge` on the train run) no dev
run is needed: the dev rows have no such labels, so each half of the labelled train answers
(even rows, odd rows) is rated by routers fitted on the other half
(hidden_router_<dataset>_divergent_halves.json), and `--out-router` fits on all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from adapters.model_files import model_sha256, resolve_model
from fitting.analysis import auroc, auroc_gain
from eval.hidden_steps import CACHE_DIR, HiddenForcer, rows_of
from fitting.learn import fit_logistic, logistic_scores
from eval.learn_mlp import SCALARS, MlpParams, fit_mlp, fit_projected, forward, projection, reduce, router_of
from fitting.records import RUNS_DIR, analysis_path, read_records, write_json
from policies.learned import FEATURES, Router

LOCAL = "qwen2.5-coder-0.5b-instruct"
UNITS, LEARNING_RATE = 64, 3e-3
PCAS = (16, 64, None)  # hidden-state projections tried (None: the whole state)


def choose_fit(x: np.ndarray, y: np.ndarray, answers: np.ndarray, pcas: tuple[int | None, ...] = (None,),
               epochs: int = 30, seed: int = 0) -> dict[str, Any]:
    """The MLP settings (hidden-state projection, weight decay, epochs) with the best AUROC on a
    fifth of the train answers held out: train rows only, the dev rows are never looked at."""
    rng = np.random.default_rng(seed)
    held = np.isin(answers, rng.choice(answers.max() + 1, size=max(1, (answers.max() + 1) // 5), replace=False))
    best: dict[str, Any] = {"held_out_train_auroc": -1.0}
    for pca in pcas:
        fit_x, held_x = x[~held], x[held]
        if pca:
            basis = projection(fit_x[:, SCALARS:], pca)
            fit_x, held_x = reduce(fit_x, basis), reduce(held_x, basis)
        for l2 in (1e-4, 1e-3, 1e-2, 1e-1):
            def judge(epoch: int, params: MlpParams, l2: float = l2, pca: int | None = pca) -> None:
                found = auroc(forward(params, held_x), y[held].astype(bool))
                if found > best["held_out_train_auroc"]:
                    best.update(pca=pca, units=UNITS, epochs=epoch, l2=l2, learning_rate=LEARNING_RATE,
                                held_out_train_auroc=found)

            fit_mlp(fit_x, y[~held], units=UNITS, epochs=epochs, l2=l2, learning_rate=LEARNING_RATE, on_epoch=judge)
    return best


def _settings(chosen: dict[str, Any], *left_out: str) -> dict[str, Any]:
    return {k: v for k, v in chosen.items() if k not in ("held_out_train_auroc", *left_out)}


def compare(x: np.ndarray, y: np.ndarray, answers: np.ndarray, eval_x: np.ndarray, eval_y: np.ndarray,
            eval_answers: np.ndarray) -> dict[str, Any]:
    """Routers fitted on rows `x` with labels `y` (MLP settings chosen on `x`'s answers alone),
    rated on `eval_x` with labels `eval_y`: each one's AUROC beside the fixed signals', and the
    scalars + hidden MLP's gains with 95% intervals over the rated answers, and its fitted `params`."""
    labels = eval_y.astype(bool)
    scalars = x[:, :SCALARS].astype(float)
    found: dict[str, float] = {
        "entropy": auroc(eval_x[:, FEATURES.index("entropy")], labels),
        "1-top1": auroc(-eval_x[:, FEATURES.index("top1")], labels),
        "-margin": auroc(-eval_x[:, FEATURES.index("margin")], labels),
    }
    logistic = logistic_scores(*fit_logistic(scalars, y), eval_x[:, :SCALARS])
    found["logistic (scalars)"] = auroc(logistic, labels)
    scalar_fit = choose_fit(scalars, y, answers)
    scalar_scores = forward(fit_mlp(scalars, y, **_settings(scalar_fit, "pca")), eval_x[:, :SCALARS])
    found["mlp (scalars)"] = auroc(scalar_scores, labels)
    hidden_fit = choose_fit(x.astype(float), y, answers, PCAS)
    hidden_params = fit_projected(x.astype(float), y, **_settings(hidden_fit))
    hidden_scores = forward(hidden_params, eval_x)
    found["mlp (scalars + hidden)"] = auroc(hidden_scores, labels)
    return {"auroc": found, "scores": {"logistic (scalars)": logistic, "mlp (scalars + hidden)": hidden_scores},
            "params": hidden_params,
            "gain": {"over logistic (scalars)": auroc_gain(hidden_scores, logistic, labels, eval_answers),
                     "over mlp (scalars)": auroc_gain(hidden_scores, scalar_scores, labels, eval_answers)},
            "settings": {"scalars": scalar_fit, "scalars + hidden": hidden_fit}}


def divergent_labels(run_dir: Path, dataset: str, ids: list[str], answers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(divergent label per row, which answers have them) from `python -m eval diverge`'s records,
    aligned with the rows of `ids`' answers."""
    found = {r["id"]: r["divergent"] for r in read_records(analysis_path(run_dir, dataset, "divergent"))}
    labels = np.zeros(len(answers))
    labelled = np.zeros(len(ids), dtype=bool)
    for index, answer_id in enumerate(ids):
        if answer_id not in found:
            continue
        rows = np.flatnonzero(answers == index)
        if len(found[answer_id]) != len(rows):
            raise ValueError(f"{answer_id}: {len(found[answer_id])} divergent labels for {len(rows)} positions")
        labels[rows] = [float(c == "1") for c in found[answer_id]]
        labelled[index] = True
    return labels, labelled


def divergent_halves(x: np.ndarray, mismatch: np.ndarray, divergent: np.ndarray, answers: np.ndarray,
                     rows: np.ndarray) -> dict[str, Any]:
    """Each half of the labelled answers (even and odd dataset rows) rated by routers fitted on the
    other half's divergent labels; also the same MLP fitted on the other half's mismatch labels,
    and AUROC among mismatches alone (does a router tell the mismatches that change the answer
    from those that only reword it?)."""
    halves: dict[str, Any] = {}
    for parity in (0, 1):
        rated = rows[answers] % 2 == parity
        fit_answers = np.unique(answers[~rated], return_inverse=True)[1]
        rated_answers = answers[rated]
        result = compare(x[~rated], divergent[~rated], fit_answers, x[rated], divergent[rated], rated_answers)
        del result["params"]  # the report keeps numbers, not fitted weights
        on_mismatch = fit_projected(x[~rated].astype(float), mismatch[~rated],
                                    **_settings(result["settings"]["scalars + hidden"]))
        labels = divergent[rated].astype(bool)
        result["auroc"]["mlp (scalars + hidden) fitted on mismatch labels"] = auroc(forward(on_mismatch, x[rated]), labels)
        among = mismatch[rated].astype(bool)
        result["auroc among mismatches"] = {
            "1-top1": auroc(-x[rated][among, FEATURES.index("top1")], labels[among]),
            **{name: auroc(scores[among], labels[among]) for name, scores in result.pop("scores").items()}}
        halves["odd rows" if parity else "even rows"] = {
            "answers": int(len(np.unique(rated_answers))), "positions": int(rated.sum()),
            "divergent_share": float(labels.mean()), "mismatches": int(among.sum()), **result}
    return halves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--train-run", required=True)
    parser.add_argument("--train-data", type=Path, required=True, help="the dataset file the train run used")
    parser.add_argument("--train-rows", help="only these train rows (default all answered)")
    parser.add_argument("--label", choices=["mismatch", "divergent"], default="mismatch",
                        help="divergent: `python -m eval diverge`'s labels, rated on halves of the labelled train answers")
    parser.add_argument("--dev-run", help="(mismatch labels) the run whose held-out rows are reported on")
    parser.add_argument("--dev-rows", help="(mismatch labels) held-out rows to report on, e.g. 0:100")
    parser.add_argument("--local", default=LOCAL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--share", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    parser.add_argument("--out-router", type=Path, help="write the scalars + hidden MLP router here")
    parser.add_argument("--cache", type=Path, default=CACHE_DIR)
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    parser.add_argument("--baseline-router", type=Path, action="append", default=[],
                        help="also score the dev rows with this logistic router file (fitted elsewhere)")
    args = parser.parse_args(argv)
    if args.label == "mismatch" and not (args.dev_run and args.dev_rows):
        parser.error("mismatch labels are reported on --dev-run's --dev-rows")

    started = time.monotonic()
    loaded: list[HiddenForcer] = []

    def forcer() -> HiddenForcer:
        if not loaded:
            loaded.append(HiddenForcer.load(resolve_model(args.local), args.n_ctx, args.threads))
        return loaded[0]

    train_dir = args.runs_dir / args.train_run
    try:
        x, y, answers, ids = rows_of(forcer, train_dir, args.dataset, args.train_data, args.train_rows, args.cache)
        if args.label == "mismatch":
            dev_x, dev_y, dev_answers, _ = rows_of(forcer, args.runs_dir / args.dev_run, args.dataset, None,
                                                   args.dev_rows, args.cache)
    finally:
        for model in loaded:
            model.close()
    rows_s = time.monotonic() - started
    sha = model_sha256(args.local)
    command = "python -m eval.studies.hidden_state.hidden_router " + " ".join(argv if argv is not None else sys.argv[1:])
    train = {"run": args.train_run, "rows": args.train_rows, "answers": len(ids), "positions": int(len(y)),
             "mismatch_share": float(y.mean())}
    if args.label == "divergent":
        divergent, labelled = divergent_labels(train_dir, args.dataset, ids, answers)
        keep = labelled[answers]
        rows = np.array([int(i.rsplit("-", 1)[1]) for i in ids])
        x, y, divergent = x[keep], y[keep], divergent[keep]
        answers = np.unique(answers[keep], return_inverse=True)[1]
        rows = rows[labelled]
        train.update(answers=int(labelled.sum()), positions=int(len(y)), mismatch_share=float(y.mean()),
                     divergent_share=float(divergent.mean()))
        report = {"dataset": args.dataset, "local_model_sha256": sha, "label": "divergent", "train": train,
                  "halves": divergent_halves(x, y, divergent, answers, rows)}
        out, y = train_dir / f"hidden_router_{args.dataset}_divergent_halves.json", divergent
    else:
        result = compare(x, y, answers, dev_x, dev_y, dev_answers)
        for path in args.baseline_router:
            baseline = Router.load(path, sha)
            result["auroc"][f"logistic {path.name}"] = auroc(
                [baseline.score(row) for row in dev_x[:, :SCALARS].astype(float)], dev_y.astype(bool))
        report = {"dataset": args.dataset, "local_model_sha256": sha, "label": "mismatch", "train": train,
                  "dev": {"run": args.dev_run, "rows": args.dev_rows, "positions": int(len(dev_y)),
                          "mismatch_share": float(dev_y.mean())},
                  "dev_auroc": result["auroc"], "mlp (scalars + hidden) dev_auroc_gain": result["gain"],
                  "mlp_settings": result["settings"]}
        out = train_dir / f"hidden_router_{args.dataset}_dev{args.dev_rows.replace(':', '-')}.json"
    report.update(rows_seconds=round(rows_s, 1), command=command)
    write_json(out, report)
    if args.out_router:
        if args.label == "mismatch":  # compare fitted it on these rows already
            hidden_fit, params = report["mlp_settings"]["scalars + hidden"], result["params"]
        else:  # on every labelled answer
            hidden_fit = choose_fit(x.astype(float), y, answers, PCAS)
            params = fit_projected(x.astype(float), y, **_settings(hidden_fit))
        labels = "mismatch (local greedy token != upstream token, teacher-forced)" if args.label == "mismatch" \
            else "divergent (the local model's token changes the answer's prediction; R2R)"
        router = router_of(params, x.astype(float), args.share, sha, {
            "command": command, "labels": labels,
            "fit": {"run": args.train_run, "rows": args.train_rows or "all answered", "answers": int(answers.max() + 1),
                    "positions": int(len(y)), **hidden_fit}})
        args.out_router.write_text(json.dumps(router.to_json()) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
